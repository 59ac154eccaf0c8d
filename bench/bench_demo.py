"""The default ``grpo-fast train`` run (no arguments) over several seeds: held-out reward before and after, time.

This is the measurement behind the README's claim that the default run learns: each seed is a fresh process
running exactly what ``grpo-fast train --seed S`` runs, with the progress bar off.

    python -m bench.bench_demo                      # seeds 0 1 2 -> bench/results/demo_cpu.csv (+ .png: seed 0)
    python -m bench.bench_demo --seeds 0 --steps 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: python bench/bench_demo.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import command_line, env_fields, markdown_table, run_isolated, write_csv


FINAL_WINDOW = 100  # final_reward_avg: the mean training reward of the last this many steps


def train_one(seed: int, steps: int | None, plot_path: str | None) -> dict:
    """Child process: the default run with ``seed`` (and ``steps`` when given); its plot copied to ``plot_path``."""
    import shutil

    import torch

    from grpo_fast.train import build_config, train
    from grpo_fast.train.metrics import read_steps

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        overrides = {"seed": str(seed), "output_dir": out, "progress": "false", "plot": str(plot_path is not None)}
        if steps is not None:
            overrides["steps"] = str(steps)
        summary = train(build_config(overrides=overrides))
        last = [s["reward"] for s in read_steps(os.path.join(out, "metrics.jsonl"))][-FINAL_WINDOW:]
        if plot_path:
            shutil.copy(os.path.join(out, "reward_kl.png"), plot_path)
    return {"seed": seed, "steps": summary.steps, "eval_before": summary.eval_before,
            "eval_after": summary.eval_after, "final_reward_avg": round(statistics.fmean(last), 4),
            "train_s": round(summary.seconds, 1), "load_avg_start": round(load_start, 2),
            "load_avg_end": round(os.getloadavg()[0], 2), **env_fields(torch.device("cpu"))}


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="default: the trainer's own default")
    parser.add_argument("--out", default="bench/results/demo_cpu.csv")
    args = parser.parse_args(argv)
    rows = []
    plot_path = os.path.splitext(args.out)[0] + ".png"  # the first seed's reward/KL plot
    for seed in args.seeds:
        params = {"seed": seed, "steps": args.steps, "plot_path": plot_path if seed == args.seeds[0] else None}
        row = run_isolated("bench.bench_demo:train_one", params)
        row["command"] = command_line()  # the command that made the CSV, not the harness's child
        rows.append(row)
        print(f"seed {seed}: {row['eval_before']:.3f} -> {row['eval_after']:.3f}, last-{FINAL_WINDOW} reward "
              f"{row['final_reward_avg']:.3f} in {row['train_s']:.0f} s", flush=True)
        write_csv(args.out, rows)  # after every seed: a stopped run keeps what it finished
    table = [[r["seed"], r["steps"], f"{r['eval_before']:.3f}", f"{r['eval_after']:.3f}",
              f"{r['final_reward_avg']:.3f}", f"{r['train_s']:.0f}",
              f"{r['load_avg_start']:.1f} / {r['load_avg_end']:.1f}"]
             for r in rows]
    print(markdown_table(["seed", "steps", "held-out reward before", "after", f"reward, last {FINAL_WINDOW} steps",
                          "seconds", "load avg start/end"], table))
    print(f"held-out reward after: {spread([r['eval_after'] for r in rows])}")
    print(f"reward, last {FINAL_WINDOW} steps: {spread([r['final_reward_avg'] for r in rows])}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
