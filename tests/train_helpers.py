"""Shared pieces of the trainer tests: a small, fast TrainConfig and reward functions loaded by ``path:function``."""

from __future__ import annotations

from pathlib import Path

from grpo_fast.train import TrainConfig, build_config

HERE = Path(__file__).parent


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
