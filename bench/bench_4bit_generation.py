"""Generation with a 4-bit base on a CPU: bitsandbytes' training layout against its repacked CPU inference layout
(AVX512-BF16), and what switching between them costs per generation.

    python -m bench.bench_4bit_generation                      # writes bench/results/qlora_generation_cpu.csv

Per model (``--models``: ``tiny``, the default run's 2-layer H=64 Qwen2; ``50m``, bench_qlora's 12-layer H=512 Qwen2,
V=32,000) and compute dtype (bfloat16, float32): the model is loaded as ``grpo-fast train --load-in-4bit`` loads it
(NF4, double quantization; ``grpo_fast.train.model.load_4bit``), then grpo-fast's sampler (``rollout.generate``)
draws completions of exactly ``--new-tokens`` tokens for random prompts of ``--prompt-len`` tokens (``--batches``:
prompts x group size, 1x8, 8x8 and 16x8 by default), once in the training layout and once inside
``grpo_fast.bnb_layout.inference_layout`` (the repacking and the exact restore included in the time).
``switch_ms`` is the repacking and restore alone. One warm-up, then ``--reps`` timed generations
(``grpo_fast.benchmarking.time_calls``); the median. The trainer uses the repacked layout for bf16 runs only: in a
float32 run the repacked kernel would compute in bf16 (its float32 row is here to show what that would gain).
Needs a CPU with AVX512-BF16 (the repacked kernel's instruction); elsewhere it says so and exits.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from bench import harness
from grpo_fast.benchmarking import time_calls

RESULT = "bench/results/qlora_generation_cpu.csv"
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=20),
    "50m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=32000),
}


def save_model(name: str, directory: str) -> int:
    """A random Qwen2 of ``MODELS[name]``, tied embeddings, saved to ``directory``; returns its vocabulary size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**MODELS[name], max_position_embeddings=512, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return config.vocab_size


def time_generation(model, vocab: int, args, prompts: int, group_size: int, repacked: bool) -> float:
    """Median ms of one generation of ``prompts`` x ``group_size`` rows (after one warm-up)."""
    from grpo_fast.bnb_layout import inference_layout
    from grpo_fast.train.rollout import SamplingParams, generate

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prompts, args.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    params = SamplingParams(args.new_tokens, 1.0, 1.0, 0)

    def one():
        with torch.no_grad(), inference_layout(model, repacked):
            out = generate(model, ids, mask, group_size, params, eos_token_id=vocab,  # never sampled
                           pad_token_id=0, generator=gen)
        assert out.completion_ids.shape == (prompts * group_size, args.new_tokens)

    return statistics.median(time_calls(one, device="cpu", reps=args.reps, warmup=1))


def time_switch(model, reps: int) -> float:
    """Median ms of repacking every 4-bit layer and restoring it."""
    from grpo_fast.bnb_layout import inference_layout

    def switch():
        with inference_layout(model):
            pass

    return statistics.median(time_calls(switch, device="cpu", reps=reps))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--batches", nargs="+", default=["1x8", "8x8", "16x8"],
                   help="prompts x group size of each generation measured (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=RESULT)
    args = p.parse_args(argv)

    from grpo_fast.bnb_layout import cpu_has_avx512bf16
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.model import load_4bit

    if not cpu_has_avx512bf16():
        raise SystemExit("bench_4bit_generation: this CPU has no AVX512-BF16, so bitsandbytes has no repacked "
                         "layout to compare with here")
    rows = harness.CsvRows(args.out)
    config = TrainConfig(load_in_4bit=True, lora_r=8)
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="grpo_fast_bench_") as tmp:
            vocab = save_model(name, tmp)
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                model = load_4bit(tmp, config, torch.device("cpu"), dtype).eval()
                switch = time_switch(model, args.reps)
                for batch in args.batches:
                    prompts, group_size = map(int, batch.split("x"))
                    env = harness.env_fields(torch.device("cpu"))
                    tokens = prompts * group_size * args.new_tokens
                    plain = time_generation(model, vocab, args, prompts, group_size, repacked=False)
                    repacked = time_generation(model, vocab, args, prompts, group_size, repacked=True)
                    row = rows.add({
                        "model": name, "dtype": dtype_name, "prompts": prompts, "group_size": group_size,
                        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                        "training_layout_ms": round(plain, 1), "repacked_ms": round(repacked, 1),
                        "switch_ms": round(switch, 1),
                        "training_layout_tok_s": round(tokens / plain * 1e3, 1),
                        "repacked_tok_s": round(tokens / repacked * 1e3, 1),
                        "speedup": round(plain / repacked, 2),
                        "trainer_uses_repacked": dtype == torch.bfloat16, **env,
                    })
                    print(f"{name} {dtype_name} {batch}: training layout {row['training_layout_tok_s']} tok/s, "
                          f"repacked {row['repacked_tok_s']} tok/s (x{row['speedup']}, switch {row['switch_ms']} "
                          "ms)", flush=True)
    print(f"wrote {rows.path}")


if __name__ == "__main__":
    main()
