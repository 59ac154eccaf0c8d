"""The thin GRPO trainer behind ``grpo-fast train``: rollout -> rewards -> advantages -> fused loss -> step."""

from grpo_fast.train.config import TrainConfig, build_config
from grpo_fast.train.lifecycle import Summary, fit, prepare, train

__all__ = ["Summary", "TrainConfig", "build_config", "fit", "prepare", "train"]
