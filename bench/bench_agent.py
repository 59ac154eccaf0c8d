"""The agentic task: ``builtin:calc`` learned with its tool, on both rollout engines, next to the same run without the
tool and next to TRL's GRPOTrainer with ``tools=``.

The task (grpo_fast/train/tasks.py): prompts ``"37*408="``, two numbers of 2 or 3 digits; the answer is judged on
the transcript's last number, the tool's output included (reward ``last_number``). The tiny model cannot multiply
such numbers in its head; with the ``calc`` tool it has to write the prompt's expression, the call token, and end its
turn after the result: ``37*408<call>15096 <eos>``, the result being the tool's tokens (never trained).

Every arm starts from the default tiny model of the seed. The tool arms first take ``--warmup`` supervised steps on
demonstration transcripts (``--sft-warmup-steps``: the model learns the call format; its sampled calls are still
mostly wrong, so the rewards are near 0 at temperature 1), then ``--steps`` GRPO steps of ``--prompts`` prompts x
``--group`` completions. Arms, each in its own fresh process, one after the other:

  grpo_fast        ``grpo-fast train --dataset builtin:calc --tools calc --sft-warmup-steps W`` (engine hf)
  grpo_fast_vllm   the same on the vllm engine (vLLM's CPU backend in this process; token-in/token-out turns)
  no_tools         the same run without the tool (and so without the warm-up, whose demonstrations call it)
  trl              TRL 1.16's GRPOTrainer with ``tools=[calc]`` from the same warmed-up weights
                   (bench/agent_trl.py: the same tokens through a chat template; every option passed)

Measured per arm: the sampled reward, calls per completion and the failed-call fraction of every step, the held-out
reward (greedy, ``--eval-size`` prompts of the task's held-out split, the tool available) before GRPO and every
``--eval-every`` steps, and the time per step.

Outputs: ``--out`` (default ``bench/results/agent_calc_cpu.csv``: one summary row per seed and arm, with the command
and the machine), ``<out>_curve.csv`` (seed, arm, step, reward, call_frequency, failure_frequency, held_out) and
``<out>.png``. Both CSVs are rewritten after every run, so a stopped benchmark keeps the runs it finished.

    python -m bench.bench_agent                              # seeds 0 1 2, every arm
    python -m bench.bench_agent --seeds 0 --steps 5 --arms grpo_fast   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_agent.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness

ARMS = ("grpo_fast", "grpo_fast_vllm", "no_tools", "trl")
DEFAULT_OUT = Path(__file__).parent / "results" / "agent_calc_cpu.csv"
FINAL_WINDOW = 20  # final_reward: mean sampled reward of the last this many steps


def task_config(arm: str, *, steps: int, seed: int, warmup: int, prompts: int, group: int, eval_size: int,
                output_dir: str, threads: int):
    """The ``TrainConfig`` of an arm (the trl arm: of the grpo-fast run it mirrors, which bench/agent_trl.py maps
    option by option)."""
    from grpo_fast.train import build_config

    tools = arm != "no_tools"
    values = {"dataset": "builtin:calc", "rewards": "last_number", "max_new_tokens": 24, "steps": steps,
              "seed": seed, "prompts_per_step": prompts, "group_size": group, "micro_batch_size": prompts * group // 4,
              "eval_size": eval_size, "output_dir": output_dir, "device": "cpu", "threads": threads,
              "progress": False, "plot": False, "save_every": 0,
              "tools": "calc" if tools else "", "sft_warmup_steps": warmup if tools else 0,
              "rollout": "vllm" if arm == "grpo_fast_vllm" else "hf"}
    return build_config(overrides={k: str(v) for k, v in values.items()})


def run_grpo_fast(arm: str, steps: int, seed: int, warmup: int, prompts: int, group: int, eval_size: int,
                  eval_every: int, threads: int) -> dict:
    """One grpo-fast arm in this process: the run's own set-up (warm-up, before-evaluation), then its steps, with a
    held-out evaluation every ``eval_every`` steps."""
    from grpo_fast.train.evaluation import evaluate
    from grpo_fast.train.lifecycle import prepare
    from grpo_fast.train.trainer import train_step

    with tempfile.TemporaryDirectory(prefix="bench_agent_") as tmp:
        started = time.perf_counter()
        config = task_config(arm, steps=steps, seed=seed, warmup=warmup, prompts=prompts, group=group,
                             eval_size=eval_size, output_dir=tmp, threads=threads)
        prepared = prepare(config)
        run = prepared.run
        held_out = {0: prepared.eval_before}
        curve = []
        try:
            for _ in range(steps):
                m = train_step(run)
                curve.append(dict(step=m["step"], reward=m["reward"], step_ms=1000 * m["time_step_s"],
                                  call_frequency=m.get("tools/call_frequency", 0.0),
                                  failure_frequency=m.get("tools/failure_frequency", 0.0)))
                if m["step"] % eval_every == 0 or m["step"] == steps:
                    held_out[m["step"]] = evaluate(run)
        finally:
            run.engine.close()
        return dict(curve=curve, held_out=held_out, seconds=time.perf_counter() - started)


def run_trl(steps: int, seed: int, warmup: int, prompts: int, group: int, eval_size: int, eval_every: int,
            threads: int) -> dict:
    from bench import agent_trl

    with tempfile.TemporaryDirectory(prefix="bench_agent_") as tmp:
        config = task_config("trl", steps=steps, seed=seed, warmup=warmup, prompts=prompts, group=group,
                             eval_size=eval_size, output_dir=tmp, threads=threads)
        return agent_trl.run_mirrored(config, eval_every=eval_every)


def summary_row(arm: str, r: dict) -> dict:
    curve = r["curve"]
    held = {int(k): v for k, v in r["held_out"].items()}
    last = curve[-FINAL_WINDOW:]
    return dict(arm=arm, steps=len(curve), held_out_before=round(held[0], 4),
                held_out_after=round(held[max(held)], 4),
                first_reward=round(curve[0]["reward"], 4),
                final_reward=round(statistics.fmean(c["reward"] for c in last), 4),
                first_call_frequency=round(curve[0]["call_frequency"], 3),
                final_call_frequency=round(statistics.fmean(c["call_frequency"] for c in last), 3),
                first_failure_frequency=round(curve[0]["failure_frequency"], 3),
                final_failure_frequency=round(statistics.fmean(c["failure_frequency"] for c in last), 3),
                median_step_ms=round(statistics.median(c["step_ms"] for c in curve), 1),
                run_s=round(r["seconds"], 1), error="")


def curve_path(out: Path) -> Path:
    return out.with_name(out.stem + "_curve.csv")


def plot(out: Path) -> Path:
    """Sampled reward, calls per completion and failed calls per step, and the held-out reward, mean over seeds per
    arm (each seed faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = harness.read_csv(curve_path(out))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    panels = (("reward", "sampled reward (temperature 1)"), ("call_frequency", "tool calls per completion"),
              ("failure_frequency", "failed calls (fraction)"), ("held_out", "held-out reward (greedy)"))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for i, arm in enumerate(arms):
            color = f"C{i}"
            seeds = sorted({r["seed"] for r in rows if r["arm"] == arm})
            series = []
            for seed in seeds:
                points = [(int(r["step"]), float(r[key])) for r in rows
                          if r["arm"] == arm and r["seed"] == seed and r[key] not in ("", None)]
                series.append(dict(points))
                if points:
                    ax.plot(*zip(*points), color=color, alpha=0.2, lw=0.8)
            steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if steps:
                ax.plot(steps, [statistics.fmean(s[x] for s in series) for x in steps], color=color, lw=1.8,
                        label=f"{arm} ({len(seeds)} seeds)", marker="o" if key == "held_out" else None, ms=3)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("builtin:calc with the calc tool, tiny model (2-core CPU): grpo-fast (hf, vllm), without the tool, "
                 "and TRL's GRPOTrainer(tools=)", fontsize=10)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    return png


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--steps", type=int, default=200, help="GRPO steps per run (default 200)")
    p.add_argument("--warmup", type=int, default=40, help="supervised warm-up steps of the tool arms (default 40)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    p.add_argument("--group", type=int, default=16, help="completions per prompt (default 16)")
    p.add_argument("--eval-size", type=int, default=128, help="held-out prompts (default 128)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out evaluation every N steps (default 25)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--keep", action="store_true", help="keep the CSV's runs and add the missing ones")
    p.add_argument("--replot", action="store_true", help="only redraw the plot from the CSVs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.replot:
        print(f"plot: {plot(args.out)}")
        return 0
    rows, curve_rows = [], []
    if args.keep and args.out.exists():
        rows = [r for r in harness.read_csv(args.out) if not r["error"]]
        kept = {(r["seed"], r["arm"]) for r in rows}
        curve_rows = [c for c in harness.read_csv(curve_path(args.out)) if (c["seed"], c["arm"]) in kept]
    done = {(str(r["seed"]), r["arm"]) for r in rows}
    print(f"calc agent on {harness.device_name('cpu')}, {args.threads} threads: {args.steps} steps of "
          f"{args.prompts}x{args.group}, warm-up {args.warmup}, seeds {' '.join(map(str, args.seeds))}", flush=True)
    for seed in args.seeds:
        for arm in args.arms:
            if (str(seed), arm) in done:
                continue
            env = harness.env_fields("cpu")
            print(f"  seed {seed} {arm:>14} ... ", end="", flush=True)
            params = dict(steps=args.steps, seed=seed, warmup=args.warmup, prompts=args.prompts, group=args.group,
                          eval_size=args.eval_size, eval_every=args.eval_every, threads=args.threads)
            try:
                if arm == "trl":
                    r = harness.run_isolated("bench.bench_agent:run_trl", params, timeout=args.timeout)
                else:
                    r = harness.run_isolated("bench.bench_agent:run_grpo_fast", {"arm": arm, **params},
                                             timeout=args.timeout)
                row = summary_row(arm, r)
                held = {int(k): v for k, v in r["held_out"].items()}
                curve_rows += [dict(seed=seed, arm=arm, step=0, reward="", call_frequency="", failure_frequency="",
                                    held_out=held[0])]
                curve_rows += [dict(seed=seed, arm=arm, step=c["step"], reward=round(c["reward"], 4),
                                    call_frequency=round(c["call_frequency"], 4),
                                    failure_frequency=round(c["failure_frequency"], 4),
                                    held_out=held.get(c["step"], "")) for c in r["curve"]]
                print(f"held-out {row['held_out_before']:.3f} -> {row['held_out_after']:.3f}, reward "
                      f"{row['first_reward']:.3f} -> {row['final_reward']:.3f}, calls/completion "
                      f"{row['first_call_frequency']:.2f} -> {row['final_call_frequency']:.2f}, "
                      f"{row['median_step_ms']:.0f} ms/step, {row['run_s']:.0f} s", flush=True)
            except harness.IsolatedError as e:
                row = dict(arm=arm, steps=args.steps, error=str(e)[-500:])
                print(f"ERROR: {e}", flush=True)
            rows.append({"seed": seed, **row, "warmup": args.warmup if arm != "no_tools" else 0,
                         "prompts": args.prompts, "group": args.group, "eval_size": args.eval_size, **env})
            harness.write_csv(args.out, rows)
            harness.write_csv(curve_path(args.out), curve_rows)
    png = plot(args.out) if curve_rows else None
    print(f"\nCSV: {args.out}, {curve_path(args.out)}" + (f"; plot: {png}" if png else ""))
    return 0 if all(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
