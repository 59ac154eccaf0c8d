"""One TRL GRPO training step with and without the grpo-fast drop-in, at a vocabulary where the lm_head dominates.

Variants (``--variants``), each a trainer class with the same config, model and data:

  grpo_fast     ``grpo_fast.integrations.trl.FastGRPOTrainer``: the loss and the reference-model pass through
                grpo-fast (hidden states + lm_head weight, no logits)
  trl           ``trl.GRPOTrainer`` as installed (TRL >= 1.16 already scores tokens with its own chunked fused head)
  materialised  ``GRPOTrainer`` with log-probs from the model's full ``[B, T, V]`` logits, as TRL did before its
                fused head and as most trainers still do (tests/trl_fixtures.py ``MaterializedLogitsGRPOTrainer``)

The model is a one-layer Qwen2 (hidden ``--hidden``) with the vocabulary of Qwen2.5 (151,936 rows, bench/models.py),
so the lm_head matmuls and anything of size tokens x V dominate a step; completions come from a scripted rollout
(TRL's ``rollout_func``; full length, no EOS) so that generation, which the drop-in does not change, costs nothing.
One step = ``trainer.training_step`` on one generation batch of ``--num-generations`` completions (one group): the
rollout, the reference model's log-prob pass (``--beta`` > 0), the policy forward, the loss and the backward; no
optimizer step. ``--warmup`` untimed and ``--reps`` timed steps per process; ``--rounds`` processes per variant,
round-robin in alternating order (CPU timings on a shared machine drift with its load): the row reports the median
of the per-process medians, the minimum step and the largest peak.

Each variant runs in its own fresh process (``bench.harness.run_isolated``): ``peak_extra_mib`` is that process's
peak resident set during the steps minus its resident set before them (model, reference model and trainer already
built), so it counts activations, logits or their tiles, temporaries and the gradients. The CSV (default
``bench/results/trl_cpu.csv``) carries device, library versions, git commit and the command line.

    python -m bench.bench_trl                       # G=8 completions of 512 tokens, H=64, V=151936
    python -m bench.bench_trl --completion-len 256 --variants grpo_fast trl
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_trl.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.models import get_model

BENCHMARK = "trl_grpo_step"
VARIANTS = ("grpo_fast", "trl", "materialised")
TESTS_DIR = harness.REPO_ROOT / "tests"  # the offline TRL fixtures (tokenizer, tiny model, scripted rollout)


# --------------------------------------------------------------------------------------------------------------------
# One variant (runs inside an isolated child process)


def _trainer_class(variant: str):
    if variant == "grpo_fast":
        from grpo_fast.integrations.trl import FastGRPOTrainer

        return FastGRPOTrainer
    if variant == "trl":
        from trl import GRPOTrainer

        return GRPOTrainer
    from trl_fixtures import MaterializedLogitsGRPOTrainer

    return MaterializedLogitsGRPOTrainer


def run_variant(variant: str, completion_len: int, num_generations: int, prompt_len: int, hidden: int, vocab: int,
                layers: int, loss_type: str, beta: float, threads: int, warmup: int, reps: int, seed: int) -> dict:
    """Build the trainer, then time ``reps`` training steps after ``warmup``; peak RSS beyond the built trainer."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    sys.path.insert(0, str(TESTS_DIR))
    from trl_fixtures import build_tiny_grpo_trainer, scripted_rollout, tiny_qwen2, tiny_tokenizer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        model_dir = str(Path(tmp) / "model")
        tokenizer = tiny_tokenizer(num_words=vocab - 3)  # word ids span the vocabulary, so do the completions
        tiny_qwen2(len(tokenizer), seed=seed, hidden_size=hidden, intermediate_size=2 * hidden,
                   num_hidden_layers=layers, max_position_embeddings=prompt_len + completion_len + 8,
                   ).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        prompt = " ".join(f"w{i}" for i in range(prompt_len))
        trainer = build_tiny_grpo_trainer(
            model_dir, Path(tmp) / "out", [_length_reward], [prompt], trainer_cls=_trainer_class(variant),
            trainer_kwargs={"rollout_func": scripted_rollout(completion_len, seed=seed, full_length=True)},
            num_generations=num_generations, per_device_train_batch_size=num_generations,
            max_completion_length=completion_len, loss_type=loss_type, beta=beta, bf16=False, seed=seed,
        )
        assert trainer.model.get_output_embeddings().weight.shape[0] == vocab
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        batch = [{"prompt": prompt} for _ in range(num_generations)]
        grad_norms = []

        def step():
            trainer.training_step(trainer.model, batch, None)
            if not grad_norms:  # the first step's gradient: the same data in every variant
                grads = [p.grad.double().norm() for p in trainer.model.parameters() if p.grad is not None]
                grad_norms.append(float(torch.stack(grads).norm()))

        def drop_grads():
            trainer.model.zero_grad(set_to_none=True)

        m = harness.measure(step, warmup=warmup, reps=reps, device="cpu", setup=drop_grads)
    return dict(median_ms=m.median_ms, min_ms=m.min_ms, peak_extra_bytes=m.peak_extra_bytes,
                memory_method=m.memory_method, first_grad_norm=grad_norms[0],
                trainer=type(trainer).__module__ + "." + type(trainer).__qualname__)


def _length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]  # varied, so the group has advantages


# --------------------------------------------------------------------------------------------------------------------
# Driver


def _parse_args(argv):
    qwen = get_model("qwen2.5-0.5b")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--completion-len", type=int, default=512, help="tokens per completion T (default 512)")
    p.add_argument("--num-generations", type=int, default=8, help="completions per step G (default 8)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--hidden", type=int, default=64, help="backbone hidden size H (default 64: a tiny backbone)")
    p.add_argument("--vocab", type=int, default=qwen.vocab_size,
                   help=f"vocabulary V (default {qwen.vocab_size}, {qwen.name}'s)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (default dapo, TRL's default)")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient; > 0 adds the reference pass")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per process (default 1)")
    p.add_argument("--reps", type=int, default=2, help="timed steps per process (default 2)")
    p.add_argument("--rounds", type=int, default=1,
                   help="processes per variant, run round-robin in alternating order so that load from other work "
                        "on the machine hits every variant alike (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=harness.RESULTS_DIR / "trl_cpu.csv")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant process")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="address-space cap per variant process (default: none)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    env = harness.env_fields("cpu")
    env["trl"] = importlib.metadata.version("trl")
    G, T, V, H = args.num_generations, args.completion_len, args.vocab, args.hidden
    logits_mib = G * T * V * 4 / harness.MIB
    print(f"TRL GRPO step on {env['device']}, {threads} threads, torch {env['torch']}, trl {env['trl']}, commit "
          f"{env['commit']}: G={G} completions x T={T} tokens, H={H}, V={V} (one fp32 [G, T, V] logits tensor = "
          f"{logits_mib:,.0f} MiB), {args.loss_type}, beta={args.beta}; warmup {args.warmup}, reps {args.reps}",
          flush=True)
    params = dict(completion_len=T, num_generations=G, prompt_len=args.prompt_len, hidden=H, vocab=V,
                  layers=args.layers, loss_type=args.loss_type, beta=args.beta, threads=threads,
                  warmup=args.warmup, reps=args.reps, seed=args.seed)
    mem_limit = int(args.mem_limit_gib * 1024**3) if args.mem_limit_gib else None
    results = {v: [] for v in args.variants}  # variant -> one result dict (or error string) per round
    loads = {v: [] for v in args.variants}
    for round_ in range(args.rounds):
        order = args.variants if round_ % 2 == 0 else args.variants[::-1]
        for variant in order:
            loads[variant].append(os.getloadavg()[0])  # other work on the machine skews CPU timings
            print(f"  round {round_ + 1}/{args.rounds} {variant:>12} ... ", end="", flush=True)
            t0 = time.perf_counter()
            try:
                r = harness.run_isolated("bench.bench_trl:run_variant", dict(variant=variant, **params),
                                         timeout=args.timeout, mem_limit_bytes=mem_limit)
                print(f"{r['median_ms'] / 1e3:8.2f} s/step (min {r['min_ms'] / 1e3:.2f}), peak "
                      f"+{r['peak_extra_bytes'] / harness.MIB:,.1f} MiB, first-step grad norm "
                      f"{r['first_grad_norm']:.6g}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            except harness.IsolatedError as e:
                r = str(e)
                print(f"ERROR: {e}", flush=True)
            results[variant].append(r)

    rows = []
    for variant in args.variants:
        row = {"benchmark": BENCHMARK, "variant": variant, "G": G, "T": T, "prompt_len": args.prompt_len, "H": H,
               "V": V, "layers": args.layers, "loss_type": args.loss_type, "beta": args.beta,
               "logits_mib": round(logits_mib, 1), "warmup": args.warmup, "reps": args.reps, "rounds": args.rounds,
               "load_avg_1m": round(max(loads[variant]), 2)}
        errors = [r for r in results[variant] if isinstance(r, str)]
        if errors:
            row.update(error=errors[0])
        else:
            runs = results[variant]
            row.update(trainer=runs[0]["trainer"],
                       median_ms=round(statistics.median(r["median_ms"] for r in runs), 1),
                       min_ms=round(min(r["min_ms"] for r in runs), 1),
                       peak_extra_mib=round(max(r["peak_extra_bytes"] for r in runs) / harness.MIB, 1),
                       first_grad_norm=runs[0]["first_grad_norm"], memory_method=runs[0]["memory_method"], error="")
        row.update(env)
        rows.append(row)

    harness.write_csv(args.csv, rows)
    print()
    print(results_table(rows))
    print(f"\nCSV: {args.csv}")
    ok = [r for r in rows if not r["error"]]
    norms = [r["first_grad_norm"] for r in ok]
    if norms and max(norms) - min(norms) > 1e-4 * max(norms):
        print("note: the variants' first-step gradient norms differ by more than 1e-4 relative", file=sys.stderr)
    return 0 if len(ok) == len(rows) else 1


def results_table(rows: list[dict]) -> str:
    """Markdown: one line per variant, ratios against TRL's own trainer."""
    base = next((r for r in rows if r["variant"] == "trl" and not r["error"]), None)
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["variant"], "error", "", "", "", "", "", r["error"][:60]])
            continue
        t_ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base else ""
        m_ratio = f"{r['peak_extra_mib'] / base['peak_extra_mib']:.2f}x" if base and base["peak_extra_mib"] else ""
        body.append([r["variant"], r["median_ms"], r["min_ms"], r["peak_extra_mib"], t_ratio, m_ratio,
                     f"{r['first_grad_norm']:.6g}", ""])
    return harness.markdown_table(
        ["variant", "median ms / step", "min ms / step", "peak extra MiB", "time vs trl (median)", "memory vs trl",
         "first-step grad norm", "error"], body)


if __name__ == "__main__":
    sys.exit(main())
