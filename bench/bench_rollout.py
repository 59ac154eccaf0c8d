"""Rollout engines side by side: ``hf`` (grpo-fast's transformers loop) vs ``vllm`` (vLLM in the process).

For each model and engine, in a fresh process (``bench.harness.run_isolated``): the same prompts, group size,
lengths and sampling; one warm-up generation, then ``--reps`` timed generations, each followed by a weight sync
(vLLM: the policy's tensors pushed and the prefix cache reset; ``hf`` samples from the policy itself: nothing to
push). Then ``--steps`` full ``grpo-fast train`` steps on the default task with ``--rollout`` set to the engine
(tiny model only). Columns:

  startup_s         engine construction (vLLM: checkpoint written, engine built, KV cache allocated)
  gen_ms            one generation of prompts x group completions (median of the reps)
  tokens_per_s      completion tokens generated (EOS included, padding not) per second of gen_ms
  cached_tokens     prompt tokens served from vLLM's prefix cache in one generation (the group sharing a prompt)
  sync_ms           one weight sync (median)
  step_ms           one training step of the default task with that engine (median over --steps), generation,
                    rewards, old-log-prob pass (the importance-sampling correction with vLLM), update and sync
  peak_rss_mib      the process's peak resident set after the generations (imports, model and engine included;
                    the training steps come after it)

Models: ``tiny`` (the built-in 2-layer Qwen2 of the default run, 16 digits prompts x 16 completions x 4 tokens)
and ``qwen2-50m`` (H=512, 8 layers, V=32,000, untied head: 8 prompts of 96 random tokens x 8 completions x 64
tokens, no EOS so every row runs to the end). fp32 on the CPU.

    python -m bench.bench_rollout --out bench/results/rollout_cpu.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench import harness
from grpo_fast.benchmarking import PhaseTimer

MODELS = {
    "tiny": dict(prompts=16, group=16, new_tokens=4, prompt_tokens=None),
    "qwen2-50m": dict(prompts=8, group=8, new_tokens=64, prompt_tokens=96),
}
QWEN2_50M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _model_and_prompts(name: str, seed: int):
    from grpo_fast.train.tasks import builtin_records, tiny_model, tiny_tokenizer

    spec = MODELS[name]
    if name == "tiny":
        tok = tiny_tokenizer()
        model = tiny_model(tok, seed)
        records = builtin_records("digits", "train", spec["prompts"])
        enc = tok([r["prompt"] for r in records], padding=True, return_tensors="pt", padding_side="left")
        return model, enc["input_ids"], enc["attention_mask"], [tok.eos_token_id], tok.pad_token_id
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_50M))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, QWEN2_50M["vocab_size"], (spec["prompts"], spec["prompt_tokens"]), generator=g)
    return model, ids, torch.ones_like(ids), [], 0  # no EOS: every row runs to new_tokens


def measure_engine(model: str, engine: str, reps: int, steps: int, seed: int, threads: int) -> dict:
    """One (model, engine) configuration; runs in its own process."""
    torch.set_num_threads(threads)
    from grpo_fast.train.rollout import SamplingParams, generate

    policy, prompt_ids, prompt_mask, eos, pad = _model_and_prompts(model, seed)
    spec = MODELS[model]
    params = SamplingParams(spec["new_tokens"], 1.0)
    P = prompt_ids.shape[1]
    t0 = time.perf_counter()
    if engine == "vllm":
        from grpo_fast.train.vllm_engine import VLLMEngine, kv_bytes_per_token

        rows = spec["prompts"] * spec["group"]
        kv = kv_bytes_per_token(policy.config, torch.float32) * rows * (P + spec["new_tokens"] + 32)
        eng = VLLMEngine(policy, dtype=torch.float32, seed=seed, kv_cache_memory_bytes=kv,
                         max_model_len=P + spec["new_tokens"])

        def sample(s):
            return eng.generate(prompt_ids, prompt_mask, spec["group"], params, eos_token_id=eos,
                                pad_token_id=pad, seed=s)

        def sync():
            eng.update_weights(policy)
    else:
        def sample(s):
            return generate(policy, prompt_ids, prompt_mask, spec["group"], params, eos_token_id=eos,
                            pad_token_id=pad, generator=torch.Generator().manual_seed(s))

        def sync():
            pass
    startup = time.perf_counter() - t0
    sample(0)  # warm-up
    timer, tokens, cached = PhaseTimer("cpu", ("generate", "sync")), [], []
    for r in range(reps):
        with timer.phase("generate"):
            ro = sample(r + 1)
        tokens.append(int(ro.completion_mask.sum()))
        cached.append(getattr(eng, "cached_prompt_tokens", 0) if engine == "vllm" else 0)
        with timer.phase("sync"):
            sync()
    gen_s = statistics.median(timer.ms["generate"]) / 1e3
    row = {
        "model": model, "engine": engine, "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 2),
        "prompts": spec["prompts"], "group": spec["group"], "prompt_tokens": P, "new_tokens": spec["new_tokens"],
        "startup_s": round(startup, 2), "gen_ms": round(1000 * gen_s, 1),
        "tokens_per_s": round(statistics.median(tokens) / gen_s, 1), "cached_tokens": statistics.median(cached),
        "sync_ms": round(statistics.median(timer.ms["sync"]), 2),
    }
    if engine == "vllm":
        eng.close()
    row["peak_rss_mib"] = round(harness.peak_rss_bytes() / 2**20, 1)  # the generation's, before any training
    if steps and model == "tiny":
        row["step_ms"] = _train_steps(engine, steps, seed, threads)
    return row


def _train_steps(engine: str, steps: int, seed: int, threads: int) -> float:
    import tempfile

    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.lifecycle import prepare
    from grpo_fast.train.trainer import train_step

    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(rollout=engine, seed=seed, steps=steps + 1, output_dir=tmp, progress=False,
                             plot=False, eval_size=16, threads=threads)
        prepared = prepare(config)
        run = prepared.run
        times = []
        for _ in range(steps + 1):
            times.append(train_step(run)["time_step_s"])
        return round(1000 * statistics.median(times[1:]), 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--reps", type=int, default=5, help="timed generations (and syncs) per configuration")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per engine on the tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="bench/results/rollout_cpu.csv")
    args = p.parse_args(argv)
    rows = harness.CsvRows(args.out)
    print(f"rollout engines on {harness.device_name(torch.device('cpu'))}, {args.threads} threads")
    for model in args.models:
        for engine in args.engines:
            env = harness.env_fields(torch.device("cpu"))
            try:
                row = harness.run_isolated("bench.bench_rollout:measure_engine",
                                           dict(model=model, engine=engine, reps=args.reps, steps=args.steps,
                                                seed=args.seed, threads=args.threads), timeout=args.timeout)
            except harness.IsolatedError as exc:
                row = {"model": model, "engine": engine, "error": str(exc)}
            rows.add({**row, **env, "num_threads": args.threads})
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    headers = ["model", "engine", "startup_s", "gen_ms", "tokens_per_s", "cached_tokens", "sync_ms", "step_ms",
               "peak_rss_mib"]
    print(harness.markdown_table(headers, [[r.get(h, "") for h in headers] for r in rows.rows]))
    print(f"CSV: {Path(args.out)}")


if __name__ == "__main__":
    main()
