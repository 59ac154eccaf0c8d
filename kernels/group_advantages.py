"""Segmented group statistics and normalised advantages over group ids (TRL 1.16 semantics, DESIGN.md §3-§4).

One program per group walks its rows (the host sorts rows by group once: ``order``, ``offsets``) in BLOCK rows at a
time, twice: pass 1 counts the scored (non-NaN) values and sums them, pass 2 sums squared deviations from the mean
(two-pass, so no catastrophic cancellation) and takes min and max. It writes the group's mean, unbiased std (NaN with
fewer than two scores) and zero-spread flag, and each row's advantage ``(r - mean) / (std + eps)`` (SCALE_GROUP),
``r - mean`` (SCALE_NONE) or ``(r - mean) / (divisor + eps)`` (SCALE_GIVEN: the batch std). NaN advantages become 0;
with ZERO_FLAT rows of zero-spread groups get exactly 0. Traffic: the values are read twice and written once.
Limits: any number of groups (grid axis 0) and any group size (looped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_fast.outputs import AdvantageOutput

SCALE_NONE, SCALE_GROUP, SCALE_GIVEN = 0, 1, 2


@triton.jit
def _segment_block(x_ptr, order_ptr, i0, end, BLOCK: tl.constexpr):
    """Rows ``order[i0 : i0 + BLOCK]`` of one group (clipped at ``end``), their values and which are scored."""
    i = i0 + tl.arange(0, BLOCK)
    inb = i < end
    rows = tl.load(order_ptr + i, mask=inb, other=0)
    x = tl.load(x_ptr + rows, mask=inb, other=0.0)
    return rows, x, inb, inb & (x == x)


@triton.jit
def _group_advantages_kernel(
    x_ptr,  # [N] values (NaN = no score)
    order_ptr,  # [N] int64 row indices sorted by group
    offsets_ptr,  # [G + 1] int64 start of each group in order
    divisor_ptr,  # [] the batch std (SCALE_GIVEN)
    adv_ptr,  # [N] out: advantages, in original row order
    mean_ptr,  # [G] out
    std_ptr,  # [G] out
    flat_ptr,  # [G] out: int8 zero-spread flag
    eps,
    SCALE: tl.constexpr,
    ZERO_FLAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    dtype = x_ptr.dtype.element_ty
    cnt = tl.zeros((BLOCK,), dtype)
    tot = tl.zeros((BLOCK,), dtype)
    for i0 in range(start, end, BLOCK):
        rows, x, inb, valid = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        cnt += valid.to(dtype)
        tot += tl.where(valid, x, 0.0)
    count = tl.sum(cnt, 0)
    mean = tl.sum(tot, 0) / count  # 0 / 0 -> NaN for a group with no score
    m2 = tl.zeros((BLOCK,), dtype)
    lo = tl.full((BLOCK,), float("inf"), dtype)
    hi = tl.full((BLOCK,), float("-inf"), dtype)
    for i0 in range(start, end, BLOCK):
        rows, x, inb, valid = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        d = tl.where(valid, x - mean, 0.0)
        m2 += d * d
        lo = tl.minimum(lo, tl.where(valid, x, float("inf")))
        hi = tl.maximum(hi, tl.where(valid, x, float("-inf")))
    std = tl.sqrt(tl.sum(m2, 0) / (count - 1.0))
    std = tl.where(count > 1.0, std, float("nan"))
    flat = (count < 2.0) | (tl.max(hi, 0) == tl.min(lo, 0))
    tl.store(mean_ptr + g, mean)
    tl.store(std_ptr + g, std)
    tl.store(flat_ptr + g, flat.to(tl.int8))
    if SCALE == 1:
        div = std + eps
    elif SCALE == 2:
        div = tl.load(divisor_ptr).to(dtype) + eps
    for i0 in range(start, end, BLOCK):
        rows, x, inb, _ = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        a = x - mean
        if SCALE != 0:
            a = a / div
        a = tl.where(a == a, a, 0.0)
        if ZERO_FLAT:
            a = tl.where(flat, 0.0, a)
        tl.store(adv_ptr + rows, a, mask=inb)


def segment_normalize(x, order, offsets, scale, eps, divisor=None, zero_flat=True):
    """x ``[N]`` -> (advantages ``[N]``, mean ``[G]``, std ``[G]``, flat ``[G]`` bool) for groups given by the sorted
    ``order`` and ``offsets [G + 1]``; ``scale`` one of SCALE_*; ``divisor`` a 0-dim tensor for SCALE_GIVEN."""
    n = x.shape[0]
    g = offsets.shape[0] - 1
    x = x.contiguous()
    adv = torch.empty_like(x)
    mean = torch.empty(g, dtype=x.dtype, device=x.device)
    std = torch.empty_like(mean)
    flat = torch.empty(g, dtype=torch.int8, device=x.device)
    block = min(1024, triton.next_power_of_2(max(1, min(n, 1024))))
    _group_advantages_kernel[(g,)](
        x, order, offsets, x if divisor is None else divisor.reshape(()), adv, mean, std, flat, eps,
        SCALE=scale, ZERO_FLAT=zero_flat, BLOCK=block,
    )
    return adv, mean, std, flat.bool()


def group_advantages_triton(rewards, index, num_groups, scale, eps, weights, aggregation):
    """The launcher behind ``group_advantages(impl="triton")``; same contract as
    ``grpo_fast.advantages.group_advantages_torch`` (rewards ``[N, K]``, index ``[N]`` in ``[0, num_groups)``)."""
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=num_groups)
    offsets = torch.zeros(num_groups + 1, dtype=torch.int64, device=index.device)
    offsets[1:] = torch.cumsum(counts, 0)
    unscorable = torch.isnan(rewards).all(dim=1)
    if aggregation == "normalize_then_sum":
        z = torch.stack(
            [segment_normalize(rewards[:, k], order, offsets, SCALE_GROUP, eps, zero_flat=False)[0]
             for k in range(rewards.shape[1])], dim=1)
        z = torch.where(torch.isnan(rewards), float("nan"), z)  # keep "no score" as NaN for the nansum
        total = torch.where(unscorable, float("nan"), (z * weights).nansum(dim=1))
    else:
        total = torch.where(unscorable, float("nan"), (rewards * weights).nansum(dim=1))

    _, mean, std, flat = segment_normalize(total, order, offsets, SCALE_NONE, eps)
    zero_std = flat[index]
    if aggregation == "normalize_then_sum":
        batch_order = torch.arange(total.shape[0], device=total.device)
        batch_offsets = torch.tensor([0, total.shape[0]], device=total.device)
        adv, bmean, bstd, _ = segment_normalize(total, batch_order, batch_offsets, SCALE_GROUP, eps, zero_flat=False)
        n = total.shape[0]
        return AdvantageOutput(adv, bmean.expand(n).clone(), bstd.expand(n).clone(), zero_std)
    if scale == "group":
        adv = segment_normalize(total, order, offsets, SCALE_GROUP, eps)[0]
        return AdvantageOutput(adv, mean[index], std[index], zero_std)
    if scale == "batch":
        batch_order = torch.arange(total.shape[0], device=total.device)
        batch_offsets = torch.tensor([0, total.shape[0]], device=total.device)
        bstd = segment_normalize(total, batch_order, batch_offsets, SCALE_NONE, eps)[2]
        adv = segment_normalize(total, order, offsets, SCALE_GIVEN, eps, divisor=bstd)[0]
        return AdvantageOutput(adv, mean[index], bstd.expand_as(total).clone(), zero_std)
    adv = segment_normalize(total, order, offsets, SCALE_NONE, eps)[0]
    return AdvantageOutput(adv, mean[index], std[index], zero_std)
