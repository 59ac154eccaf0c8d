"""Seeded random GRPO batches shared by the loss tests and benchmarks' correctness checks."""

from __future__ import annotations

import torch


def make_mask(B: int, T: int, gen: torch.Generator, all_masked_row: bool = True) -> torch.Tensor:
    """Right-padded completion mask with uneven lengths, one full row and (optionally) one all-masked row."""
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    if all_masked_row and B > 2:
        lengths[B // 2] = 0
    return torch.arange(T)[None, :] < lengths[:, None]


def make_batch(B=4, T=123, H=96, V=1151, dtype=torch.float32, seed=0, adv_per_token=False, sampling=None,
               with_bias=False, logit_scale=1.0):
    """Leaf tensors for grpo_loss: hidden [B, T, H], weight [V, H], targets, advantages, mask, old/ref logps."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64) * logit_scale
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) / H**0.5
    bias = torch.randn(V, generator=gen, dtype=torch.float64) * 0.1 if with_bias else None
    target_ids = torch.randint(0, V, (B, T), generator=gen)
    mask = make_mask(B, T, gen)
    adv_shape = (B, T) if adv_per_token else (B,)
    advantages = torch.randn(adv_shape, generator=gen, dtype=torch.float64)
    # old/ref log-probs: near the current policy so some ratios clip, some don't
    z = (hidden @ weight.t() + (0 if bias is None else bias)).log_softmax(-1).gather(-1, target_ids[..., None])[..., 0]
    old_logps = (z + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    ref_logps = (z + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    sampling_ratio = None
    if sampling == "token":
        sampling_ratio = torch.rand(B, T, generator=gen, dtype=torch.float64).float() + 0.5
    elif sampling == "sequence":
        sampling_ratio = torch.rand(B, 1, generator=gen, dtype=torch.float64).float() + 0.5
    return dict(
        hidden=hidden.to(dtype), weight=weight.to(dtype), bias=None if bias is None else bias.to(dtype),
        target_ids=target_ids, completion_mask=mask, advantages=advantages.float(),
        old_logps=old_logps, ref_logps=ref_logps, sampling_ratio=sampling_ratio,
    )


def as_leaves(batch: dict, dtype: torch.dtype, names=("hidden", "weight", "bias")) -> dict:
    """Copy of ``batch`` with the float inputs in ``names`` cast to ``dtype`` as fresh leaves requiring grad."""
    out = dict(batch)
    for name in names:
        if out.get(name) is not None:
            out[name] = out[name].detach().to(dtype).requires_grad_(True)
    return out


def to_float64(batch: dict) -> dict:
    """Every float tensor of ``batch`` in float64 (the oracle's inputs)."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}
