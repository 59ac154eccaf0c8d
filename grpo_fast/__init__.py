"""grpo-fast: the GRPO loss, per-token log-probs and group advantages straight from hidden states.

Public API (docs/design.md §3)::

    from grpo_fast import grpo_loss, GRPOLossConfig, group_advantages, fused_logprobs
    from grpo_fast import shared_prefix_forward  # one prompt forward per group (imports transformers on first use)
"""

from grpo_fast.advantages import group_advantages
from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.logprobs import fused_logprobs
from grpo_fast.loss import GRPOLoss, grpo_loss, grpo_loss_from_logps
from grpo_fast.outputs import AdvantageOutput, LossOutput

__version__ = "0.1.0"

__all__ = [
    "AdvantageOutput",
    "GRPOLoss",
    "GRPOLossConfig",
    "LossOutput",
    "LossType",
    "fused_logprobs",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_logps",
    "shared_prefix_forward",
]


def __getattr__(name: str):
    # shared_prefix_forward needs the trainer's forward helpers; importing them lazily keeps `import grpo_fast` light
    if name == "shared_prefix_forward":
        from grpo_fast.train.shared_prefix import shared_prefix_forward

        return shared_prefix_forward
    raise AttributeError(f"module 'grpo_fast' has no attribute {name!r}")
