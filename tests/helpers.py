"""Seeded random GRPO batches shared by the loss tests and benchmarks' correctness checks."""

from __future__ import annotations

import torch

from grpo_fast.testing import loss_inputs, right_padded_mask


def make_mask(B: int, T: int, gen: torch.Generator, all_masked_row: bool = True) -> torch.Tensor:
    """Right-padded completion mask with uneven lengths, one full row and (optionally) one all-masked row."""
    return right_padded_mask(B, T, gen, full_first_row=True, empty_middle_row=all_masked_row)


def _policy_logps(hidden, weight, target_ids, bias):
    z = hidden @ weight.t() + (0 if bias is None else bias)
    return z.log_softmax(-1).gather(-1, target_ids[..., None])[..., 0]


def make_batch(B=4, T=123, H=96, V=1151, dtype=torch.float32, seed=0, adv_per_token=False, sampling=None,
               with_bias=False, logit_scale=1.0):
    """Leaf tensors for grpo_loss (``grpo_fast.testing.loss_inputs`` drawn in float64 at the loss tests' sizes):
    hidden [B, T, H], weight [V, H], bias [V] (0.1 scale) or None, targets, advantages, a mask with one full and one
    empty row, old/ref logps near the current policy (so some ratios clip, some don't), a sampling ratio or None."""
    x = loss_inputs(B, T, H, V, seed=seed, dtype=dtype, draw_dtype=torch.float64, full_first_row=True,
                    empty_middle_row=True, logit_scale=logit_scale, bias_scale=0.1 if with_bias else None,
                    advantages_per_token=adv_per_token, logps_center=_policy_logps, logps_noise=0.3, old_logps=True,
                    sampling=sampling)
    return dict(bias=None, sampling_ratio=None) | x


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


def cpu_flags_note(*flags: str) -> str:
    """Which of ``flags`` (``/proc/cpuinfo`` names) this CPU has, for a skip reason that says which flag decided:
    ``"avx512_bf16: yes, amx_bf16: no"`` ("unknown" where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            have = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return ", ".join(f"{flag}: unknown" for flag in flags)
    return ", ".join(f"{flag}: {'yes' if flag in have else 'no'}" for flag in flags)
