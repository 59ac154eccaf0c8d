"""Shared pieces of the trainer tests: a small, fast TrainConfig and reward functions loaded by ``path:function``."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_fast.train import TrainConfig, build_config

HERE = Path(__file__).parent
REPO = HERE.parent


def small_config(tmp_path, **overrides) -> TrainConfig:
    """The default task at a size that runs a step in well under a second on one CPU core."""
    values = dict(steps=4, prompts_per_step=4, group_size=4, micro_batch_size=8, eval_size=16, max_new_tokens=3,
                  output_dir=str(tmp_path / "run"), progress=False, plot=False, save_every=0, warmup_steps=0,
                  **{"loss.beta": "0.0"})
    values.update(overrides)
    return build_config(overrides={k: v if isinstance(v, str) else _flag(v) for k, v in values.items()})


def _flag(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def unwritable_path(tmp_path) -> str:
    """A directory path nothing can be created at: under a read-only directory, or (root writes through
    permissions) under /proc, which takes no new directories."""
    import os

    if os.geteuid() != 0:
        ro = Path(tmp_path) / "read-only"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        return str(ro / "run")
    return "/proc/grpo-fast-no-such-dir"


def starts_with_seven(prompts, completions, **kwargs):
    """1 when the completion starts with the digit 7: a task whose optimum is known (always answer 7)."""
    return [1.0 if c.startswith("7") else 0.0 for c in completions]


def constant_reward(prompts, completions, **kwargs):
    return [0.5 for _ in completions]


def half_scored(prompts, completions, **kwargs):
    """Scores only every other completion (None: not scored)."""
    return [float(len(c)) if i % 2 == 0 else None for i, c in enumerate(completions)]


# the seeded run whose per-step values tests/golden/train_tiny.json pins (scripts/make_golden.py writes it)
GOLDEN_PATH = HERE / "golden" / "train_tiny.json"
GOLDEN_OVERRIDES = dict(steps=5, prompts_per_step=4, group_size=8, mu=2, seed=7, **{"loss.beta": "0.04",
                        "loss.loss_type": "grpo"})
GOLDEN_KEYS = ("loss", "reward", "kl", "entropy", "grad_norm", "clip_ratio_region", "completion_length")


def save_local_model(directory, arch: str, chat_template: str | None, weights: bool = True):
    """A tiny model of ``arch`` saved as a transformers directory (what a user passes as --model PATH)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    if arch == "llama":
        config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    else:
        model = tiny_model(tok, seed=0)
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)
