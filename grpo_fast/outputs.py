"""Result types of the public API."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LossOutput(NamedTuple):
    """What ``grpo_loss`` and ``grpo_loss_from_logps`` return.

    loss: scalar, differentiable. per_token_logps: ``[B, T]``, detached. The rest are detached 0-dim tensors, masked
    means as TRL logs them, or None where the loss type does not define them: ``kl`` (beta > 0), ``entropy`` (when
    entropies exist), ``clip_ratio_*`` (clip family; for cispo ``clip_ratio_high`` is TRL's ``cispo_clip_ratio``).
    """

    loss: torch.Tensor
    per_token_logps: torch.Tensor
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    clip_ratio_low: torch.Tensor | None = None
    clip_ratio_high: torch.Tensor | None = None
    clip_ratio_region: torch.Tensor | None = None


class AdvantageOutput(NamedTuple):
    """What ``group_advantages`` returns; every field is ``[N]``, one value per completion.

    advantages: normalised, NaN-free (unscorable rows and singleton groups get 0). group_mean / group_std: the
    statistics of each row's group (the batch std with ``scale="batch"``; NaN where undefined). zero_std: True where
    that std is zero (or undefined), i.e. the row carries no policy-gradient signal.
    """

    advantages: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    zero_std: torch.Tensor
