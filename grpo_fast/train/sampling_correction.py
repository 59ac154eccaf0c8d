"""The off-policy correction for an inference engine's samples (TRL 1.16's ``vllm_importance_sampling_*``).

An engine such as vLLM samples from its own kernels: its log-probs of the sampled tokens differ from the trainer's
(other matmul orders, bf16 caches, top-k / top-p renormalised over the kept tokens). The trainer recomputes the
old log-probs itself and weights each token's loss by ``exp(old - sampling)``, as TRL's GRPOTrainer does:

- ``token_truncate`` / ``token_mask``: one ratio per token, ``exp(old_t - sampling_t)``;
- ``sequence_truncate`` / ``sequence_mask``: one ratio per sequence, ``exp(sum_t (old_t - sampling_t))`` over the
  completion's tokens, broadcast to all of them;
- ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]`` (``None``: no bound on that side); ``*_mask`` sets it
  to 0 outside that interval (the token or sequence drops out of the loss).

Padding positions count 0 in the difference; a sampling log-prob of NaN (a token the engine could not score)
counts 0 too, so its ratio is exactly 1. The metrics are TRL's: ``sampling/sampling_logp_difference/{mean,max}``
(``|old - sampling|`` over the completion tokens, NaNs left out) and
``sampling/importance_sampling_ratio/{min,mean,max}`` (over tokens for token modes, over sequences for sequence
modes).

With top-k or top-p the ratio is biased: the engine's log-probs are renormalised over the kept tokens, the
trainer's are over the whole vocabulary, so ``old - sampling <= 0`` on every token and the ratio shrinks with the
number of filtered steps even when the weights agree exactly.
"""

from __future__ import annotations

import math

import torch

from grpo_fast.train import distributed as dist_
from grpo_fast.train.config import IMPORTANCE_SAMPLING_MODES

MODES = IMPORTANCE_SAMPLING_MODES


def check_mode(mode: str, name: str = "vllm_importance_sampling_mode") -> str:
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


def importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                              mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> tuple[torch.Tensor, dict[str, float]]:
    """``(ratio, metrics)``: ``ratio`` is ``[B, T]`` for token modes and ``[B, 1]`` for sequence modes (the loss
    multiplies each token's term by it, broadcasting a sequence's ratio); ``old_logps``, ``sampling_logps`` and
    ``mask`` are ``[B, T]``."""
    check_mode(mode)
    if old_logps.shape != sampling_logps.shape or old_logps.shape != mask.shape:
        raise ValueError(f"importance_sampling_ratio: old_logps {tuple(old_logps.shape)}, sampling_logps "
                         f"{tuple(sampling_logps.shape)} and mask {tuple(mask.shape)} must have one shape")
    old, sampled = old_logps.float(), sampling_logps.float()
    keep = mask.bool()
    diff = torch.nan_to_num((old - sampled) * keep, nan=0.0)
    sequence = mode.startswith("sequence")
    log_ratio = diff.sum(dim=-1, keepdim=True) if sequence else diff
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        if clip_min is not None or clip_max is not None:  # torch.clamp refuses two Nones (TRL's call would raise)
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    delta = (old - sampled).abs()[keep]
    delta = delta[~torch.isnan(delta)]
    flat = ratio.flatten() if sequence else ratio[keep]
    metrics = {
        "sampling/sampling_logp_difference/mean": float(delta.mean()) if delta.numel() else 0.0,
        "sampling/sampling_logp_difference/max": float(delta.max()) if delta.numel() else 0.0,
        "sampling/importance_sampling_ratio/min": float(flat.min()) if flat.numel() else 0.0,
        "sampling/importance_sampling_ratio/mean": float(flat.mean()) if flat.numel() else 0.0,
        "sampling/importance_sampling_ratio/max": float(flat.max()) if flat.numel() else 0.0,
    }
    return ratio, metrics


def run_correction(run, ro, old_logps) -> tuple[torch.Tensor, dict]:
    """The trainer's correction of a rollout (``run``: the trainer's ``Run``): :func:`importance_sampling_ratio` with
    ``run.config``'s options, and TRL's five metrics over every rank's completions (means averaged over the ranks, as
    TRL does; min and max over all of them)."""
    cfg = run.config
    ratio, metrics = importance_sampling_ratio(old_logps, ro.sampling_logps, ro.trained_mask,
                                               cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_min,
                                               cfg.vllm_importance_sampling_clip_max)
    if run.world.distributed:
        names = list(metrics)
        rows = dist_.gather_rows(torch.tensor([[metrics[k] for k in names]], device=run.device), run.world)
        reduce = {"mean": torch.mean, "max": torch.max, "min": torch.min}
        metrics = {k: float(reduce[k.rsplit("/", 1)[1]](rows[:, i])) for i, k in enumerate(names)}
    return ratio, metrics
