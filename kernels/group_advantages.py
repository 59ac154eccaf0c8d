"""Segmented group statistics and normalised advantages over group ids (TRL 1.16 semantics, docs/design.md §3-§4).

One program per group walks its rows (the host sorts rows by group once: ``order``, ``offsets``) in BLOCK rows at a
time: pass 1 counts the scored (non-NaN) values and takes min, max and the largest |value|, from which the group's
scale ``s = 2 ** floor(log2(max |x|))`` (1 below the smallest normal float32; ``grpo_fast.reference.pow2_scale``);
pass 2 sums ``x / s``; pass 3 sums squared deviations of ``x / s`` from the mean (two-pass, so no catastrophic
cancellation). Working in units of s keeps the squares finite for any finite rewards (1e30 overflows float32 squares)
and, s being a power of two, changes nothing wherever the unscaled sums would not overflow or underflow. It writes
the group's mean, unbiased std in units of s (NaN with fewer than two scores), s and the zero-spread flag, and each
row's advantage ``(r - mean) / (std + eps)`` (SCALE_GROUP), ``r - mean`` (SCALE_NONE) or
``(r - mean) / (divisor + eps)`` (SCALE_GIVEN: the batch std, given in its own units), all formed in scaled units.
NaN advantages become 0; with ZERO_FLAT rows of zero-spread groups get exactly 0. Traffic: the values are read four
times and written once. Limits: any number of groups (grid axis 0) and any group size (looped). No float64 inside:
it runs in the dtype of the values.

Specialisations: one per value dtype (and pointer alignment). The scale mode and the zero-spread rule are runtime
ints and BLOCK is fixed, so a new option or group size never compiles again; eps travels in ``params`` in the values'
dtype, since a Python float reaches a kernel as fp32 on hardware (float64 rewards keep a float64 eps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import launch
from grpo_fast.outputs import AdvantageOutput

SCALE_NONE, SCALE_GROUP, SCALE_GIVEN = 0, 1, 2
BLOCK = 128  # rows per step of a group's loops; groups of any size loop


@triton.jit
def _segment_block(x_ptr, order_ptr, i0, end, BLOCK: tl.constexpr):
    """Rows ``order[i0 : i0 + BLOCK]`` of one group (clipped at ``end``), their values and which are scored."""
    i = i0 + tl.arange(0, BLOCK)
    inb = i < end
    rows = tl.load(order_ptr + i, mask=inb, other=0)
    x = tl.load(x_ptr + rows, mask=inb, other=0.0)
    return rows, x, inb, inb & (x == x)


@triton.jit(do_not_specialize=["SCALE", "ZERO_FLAT"])
def _group_advantages_kernel(
    x_ptr,  # [N] values (NaN = no score)
    order_ptr,  # [N] int64 row indices sorted by group
    offsets_ptr,  # [G + 1] int64 start of each group in order
    params_ptr,  # [3] in the values' dtype: the batch's std in its units and its scale (SCALE_GIVEN), eps
    adv_ptr,  # [N] out: advantages, in original row order
    mean_ptr,  # [G] out
    std_ptr,  # [G] out: unbiased std / scale
    scale_ptr,  # [G] out: the power-of-two scale the statistics were taken in
    flat_ptr,  # [G] out: int8 zero-spread flag
    SCALE,  # int: SCALE_NONE, SCALE_GROUP or SCALE_GIVEN
    ZERO_FLAT,  # int 0/1
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + g)
    end = tl.load(offsets_ptr + g + 1)
    dtype = x_ptr.dtype.element_ty
    cnt = tl.zeros((BLOCK,), dtype)
    big = tl.zeros((BLOCK,), dtype)
    lo = tl.full((BLOCK,), float("inf"), dtype)
    hi = tl.full((BLOCK,), float("-inf"), dtype)
    for i0 in range(start, end, BLOCK):
        rows, x, inb, valid = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        cnt += valid.to(dtype)
        big = tl.maximum(big, tl.where(valid, tl.abs(x), 0.0))
        lo = tl.minimum(lo, tl.where(valid, x, float("inf")))
        hi = tl.maximum(hi, tl.where(valid, x, float("-inf")))
    count = tl.sum(cnt, 0)
    big = tl.max(big, 0)
    s = tl.exp2(tl.floor(tl.log2(tl.where(big >= 1.1754943508222875e-38, big, 1.0))))  # 1 for tiny or no values
    tot = tl.zeros((BLOCK,), dtype)
    for i0 in range(start, end, BLOCK):
        rows, x, inb, valid = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        tot += tl.where(valid, x / s, 0.0)
    mean = tl.sum(tot, 0) / count  # in units of s; 0 / 0 -> NaN for a group with no score
    m2 = tl.zeros((BLOCK,), dtype)
    for i0 in range(start, end, BLOCK):
        rows, x, inb, valid = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        d = tl.where(valid, x / s - mean, 0.0)
        m2 += d * d
    std = tl.sqrt(tl.sum(m2, 0) / (count - 1.0))
    std = tl.where(count > 1.0, std, float("nan"))
    flat = (count < 2.0) | (tl.max(hi, 0) == tl.min(lo, 0))
    tl.store(mean_ptr + g, mean * s)
    tl.store(std_ptr + g, std)
    tl.store(scale_ptr + g, s)
    tl.store(flat_ptr + g, flat.to(tl.int8))
    eps = tl.load(params_ptr + 2).to(dtype)
    u = s
    shift = mean
    div = std + eps / s
    if SCALE == 2:  # z-scores in the batch's units u: (x / u - mean * (s / u)) / (batch std / u + eps / u)
        u = tl.load(params_ptr + 1).to(dtype)
        shift = mean * (s / u)
        div = tl.load(params_ptr).to(dtype) + eps / u
    for i0 in range(start, end, BLOCK):
        rows, x, inb, _ = _segment_block(x_ptr, order_ptr, i0, end, BLOCK)
        if SCALE == 0:
            a = x - mean * s
        else:
            a = (x / u - shift) / div
        a = tl.where(a == a, a, 0.0)
        if ZERO_FLAT != 0:
            a = tl.where(flat, 0.0, a)
        tl.store(adv_ptr + rows, a, mask=inb)


def segment_normalize(x, order, offsets, scale, eps, divisor=None, zero_flat=True):
    """x ``[N]`` -> (advantages ``[N]``, mean ``[G]``, std ``[G]``, flat ``[G]`` bool, std / scale ``[G]``, scale
    ``[G]``) for groups given by the sorted ``order`` and ``offsets [G + 1]``; ``scale`` one of SCALE_*; ``divisor``
    a ``[2]`` tensor (std / scale, scale) for SCALE_GIVEN."""
    g = offsets.shape[0] - 1
    x = x.contiguous()
    adv = torch.empty_like(x)
    mean = torch.empty(g, dtype=x.dtype, device=x.device)
    std_scaled = torch.empty_like(mean)
    group_scale = torch.empty_like(mean)
    flat = torch.empty(g, dtype=torch.int8, device=x.device)
    given = divisor.to(x.dtype).reshape(2) if divisor is not None else torch.ones(2, dtype=x.dtype, device=x.device)
    params = torch.cat([given, torch.full((1,), eps, dtype=x.dtype, device=x.device)])  # fills: no H2D copy
    launch(_group_advantages_kernel, (g,), x, order, offsets, params, adv, mean, std_scaled, group_scale, flat,
           int(scale), int(zero_flat), BLOCK=BLOCK, num_warps=4, num_stages=1)
    # the std itself is inf only where it exceeds the dtype's range; the advantages above never needed it
    return adv, mean, std_scaled * group_scale, flat.bool(), std_scaled, group_scale


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

    adv, mean, std, flat, _, _ = segment_normalize(
        total, order, offsets, SCALE_GROUP if scale == "group" else SCALE_NONE, eps)
    zero_std = flat[index]
    n = total.shape[0]
    if aggregation == "normalize_then_sum" or scale == "batch":
        batch_order = torch.arange(n, device=total.device)
        batch_offsets = torch.tensor([0, n], device=total.device)
        badv, bmean, bstd, _, bstd_scaled, bscale = segment_normalize(
            total, batch_order, batch_offsets, SCALE_GROUP, eps, zero_flat=False)
    if aggregation == "normalize_then_sum":
        return AdvantageOutput(badv, bmean.expand(n).clone(), bstd.expand(n).clone(), zero_std)
    if scale == "batch":
        divisor = torch.cat([bstd_scaled, bscale])
        adv = segment_normalize(total, order, offsets, SCALE_GIVEN, eps, divisor=divisor)[0]
        return AdvantageOutput(adv, mean[index], bstd.expand_as(total).clone(), zero_std)
    return AdvantageOutput(adv, mean[index], std[index], zero_std)
