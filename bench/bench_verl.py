"""One verl 0.9.1 ``update_actor`` at Qwen2.5's vocabulary: verl's logits path, verl's own fused path, grpo-fast's.

Runs in verl's venv (scripts/setup_verl.sh), on CPU, through the CPU harness of the verl tests
(tests/in_verl/harness.py: verl's real ``TrainingWorker`` around ``FSDPEngineWithLMHead``, FSDP2 on a gloo world of
one):

    .venv-verl/bin/python -m bench.bench_verl                      # V = 151,936, tied and untied heads
    .venv-verl/bin/python -m bench.bench_verl --heads untied --reps 1

Variants, each ``actor_rollout_ref.model.*`` as a verl config sets it:

  verl_logits       ``use_fused_kernels=False``: the ``[tokens, V]`` logits, their log-softmax and their gradient
  verl_fused_torch  ``use_fused_kernels=True, fused_kernel_options.impl_backend=torch`` (verl's chunked head; with an
                    untied head it fails under FSDP2: verl issue #5633, recorded as the row's error)
  grpo_fast         ``use_fused_kernels=True, fused_kernel_options.impl_backend=grpo_fast``

One step = ``train_mini_batch`` as ``RayPPOTrainer._update_actor`` calls it: one mini-batch of ``--batch`` sequences
(``--prompt-len`` + ``--response-len`` tokens, varied lengths, packed: ``use_remove_padding=True``) in one
micro-batch, verl's vanilla loss with its token-mean, the KL loss (low_var_kl) and the optimizer step. Each variant
runs in a fresh process (``bench.harness.run_isolated``): ``peak_extra_mib`` is that process's peak resident set
during the steps minus its resident set before them (actor built, optimizer state made by one untimed step), and
``logits_mib`` the most memory held at once by tensors whose last dimension is V (``bench.memtrack``: logits, their
softmax and gradients; the weight and grpo-fast's vocabulary tiles are narrower) in one more step, tracked. The CSV
(default ``bench/results/verl_cpu.csv``) carries device, versions, commit and the command line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_verl.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.memtrack import StorageTracker

BENCHMARK = "verl_update_actor"
HARNESS_DIR = harness.REPO_ROOT / "tests" / "in_verl"
VARIANTS = {  # name -> (use_fused_kernels, impl_backend)
    "verl_logits": (False, None),
    "verl_fused_torch": (True, "torch"),
    "grpo_fast": (True, "grpo_fast"),
}


def run_variant(variant: str, tied: bool, vocab: int, hidden: int, layers: int, batch: int, prompt_len: int,
                response_len: int, warmup: int, reps: int, threads: int, seed: int) -> dict:
    """One variant in this (fresh) process: time and peak RSS of ``reps`` steps, then one tracked step."""
    torch.set_num_threads(threads)
    sys.path.insert(0, str(HARNESS_DIR))
    import harness as verl_cpu  # tests/in_verl/harness.py: the CPU shims (test code, not the library)

    fused, backend = VARIANTS[variant]
    with tempfile.TemporaryDirectory(prefix="bench_verl_") as tmp:
        model_dir = verl_cpu.tiny_model_dir(tmp, tied=tied, vocab=vocab, hidden=hidden, layers=layers, seed=seed,
                                            heads=4, kv_heads=2, intermediate=2 * hidden)
        rollout = verl_cpu.make_batch(vocab, batch=batch, prompt_len=prompt_len, response_len=response_len,
                                      seed=seed)
        actor = verl_cpu.make_actor(model_dir, use_remove_padding=True, use_fused_kernels=fused,
                                    fused_backend=backend, temperature=1.0, n_micro=1, use_kl_loss=True,
                                    kl_loss_type="low_var_kl", kl_loss_coef=0.001, seed=seed)
        verl_cpu.train_step(actor, rollout)  # the optimizer state, lazy set-up: before the baseline
        losses = []

        def step():
            losses.append(verl_cpu.train_step(actor, rollout)["loss"])

        m = harness.measure(step, warmup=warmup, reps=reps, device="cpu")
        tracker = StorageTracker(vocab, hidden)
        with tracker, tracker.phase("update_actor"):
            step()
        peak = tracker.peaks["update_actor"]
    tokens = int(rollout.batch["attention_mask"].sum())
    return dict(median_ms=m.median_ms, min_ms=m.min_ms, peak_extra_bytes=m.peak_extra_bytes,
                memory_method=m.memory_method, logits_bytes=peak.tag_max.get("logits", 0),
                tracked_peak_bytes=peak.peak_bytes - peak.start_bytes, tokens=tokens, first_loss=losses[0])


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--heads", nargs="+", choices=("tied", "untied"), default=["tied", "untied"])
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary V (default 151936, Qwen2.5's)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size H (default 128: a tiny backbone)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences in the mini-batch (default 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, left-padded (default 64)")
    p.add_argument("--response-len", type=int, default=448, help="response tokens, right-padded (default 448)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per process after the first (default 0)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per process (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=harness.RESULTS_DIR / "verl_cpu.csv")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant process")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    import verl

    rows = harness.CsvRows(args.csv)
    print(f"verl {verl.__version__} update_actor, V={args.vocab}, H={args.hidden}, {args.layers} layers, "
          f"{args.batch} x ({args.prompt_len} + {args.response_len}) tokens, {threads} threads", flush=True)
    for head in args.heads:
        for variant in args.variants:
            params = dict(variant=variant, tied=head == "tied", vocab=args.vocab, hidden=args.hidden,
                          layers=args.layers, batch=args.batch, prompt_len=args.prompt_len,
                          response_len=args.response_len, warmup=args.warmup, reps=args.reps, threads=threads,
                          seed=args.seed)
            env = harness.env_fields("cpu")
            env["verl"] = verl.__version__
            row = {"benchmark": BENCHMARK, "variant": variant, "head": head, "V": args.vocab, "H": args.hidden,
                   "layers": args.layers, "batch": args.batch, "prompt_len": args.prompt_len,
                   "response_len": args.response_len, "warmup": args.warmup, "reps": args.reps}
            print(f"  {head:>6} {variant:>16} ... ", end="", flush=True)
            t0 = time.perf_counter()
            try:
                r = harness.run_isolated("bench.bench_verl:run_variant", params, timeout=args.timeout)
                row.update(tokens=r["tokens"], median_ms=round(r["median_ms"], 1), min_ms=round(r["min_ms"], 1),
                           peak_extra_mib=round(r["peak_extra_bytes"] / harness.MIB, 1),
                           logits_mib=round(r["logits_bytes"] / harness.MIB, 1),
                           tracked_peak_mib=round(r["tracked_peak_bytes"] / harness.MIB, 1),
                           first_loss=r["first_loss"], memory_method=r["memory_method"], error="")
                print(f"{r['median_ms'] / 1e3:7.2f} s/step, peak +{row['peak_extra_mib']:,.1f} MiB, [.., V] tensors "
                      f"{row['logits_mib']:,.1f} MiB  [{time.perf_counter() - t0:.0f} s]", flush=True)
            except harness.IsolatedError as e:
                row.update(error=str(e)[:300])
                print(f"ERROR: {str(e)[:200]}", flush=True)
            row.update(env)
            rows.add(row)
    print()
    print(results_table(rows.rows))
    print(f"\nCSV: {args.csv}")
    return 0


def results_table(rows: list[dict]) -> str:
    """Markdown: one line per head and variant, ratios against verl's logits path with the same head."""
    body = []
    for r in rows:
        base = next((b for b in rows if b["head"] == r["head"] and b["variant"] == "verl_logits"
                     and not b.get("error")), None)
        if r.get("error"):
            body.append([r["head"], r["variant"], "error", "", "", "", "", r["error"][:70]])
            continue
        ratio = (f"{float(r['peak_extra_mib']) / float(base['peak_extra_mib']):.2f}x"
                 if base and float(base["peak_extra_mib"]) else "")
        body.append([r["head"], r["variant"], float(r["median_ms"]) / 1e3, float(r["peak_extra_mib"]), ratio,
                     float(r["logits_mib"]), float(r["tracked_peak_mib"]), ""])
    return harness.markdown_table(["head", "variant", "s / update_actor (median)", "peak extra MiB (RSS)",
                                   "vs verl logits", "[.., V] tensors MiB (logits or tiles)", "tracked peak MiB",
                                   "error"], body)


if __name__ == "__main__":
    sys.exit(main())
