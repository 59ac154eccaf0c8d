"""grpo-fast: the GRPO loss, per-token log-probs and group advantages straight from hidden states.

Public API (DESIGN.md §3)::

    from grpo_fast import grpo_loss, GRPOLossConfig, group_advantages, fused_logprobs
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
]
