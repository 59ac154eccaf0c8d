"""Group reward normalisation over arbitrary group ids (TRL 1.16 semantics; docs/design.md §3-§4).

The torch path is segmented (``index_add_`` / ``scatter_reduce_`` over group indices): no ``view(-1, G)``, so uneven
and singleton groups and any ordering of ``group_ids`` are handled; it is what the Triton kernel implements.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from grpo_fast import checks
from grpo_fast.dispatch import resolve_impl
from grpo_fast.outputs import AdvantageOutput
from grpo_fast.reference import group_advantages_reference, pow2_scale, zscore

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class SegmentStats(NamedTuple):
    """Per-group statistics, each ``[G, C]``. ``std_scaled = std / scale`` where ``scale`` is the power of two the
    sums ran in (``pow2_scale`` of the group's largest |value|): z-scores use it, so they never overflow."""

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_scaled: torch.Tensor
    scale: torch.Tensor
    gmin: torch.Tensor
    gmax: torch.Tensor


def segment_stats(x: torch.Tensor, index: torch.Tensor, num_groups: int) -> SegmentStats:
    """NaN-aware per-group count, mean, unbiased std, min and max of ``x [N, C]`` over ``index [N]``.

    Mean is NaN for a group with no value, std NaN with fewer than two (TRL ``nanstd``). The sums run on
    ``x / scale`` (``grpo_fast.reference.pow2_scale``), so no finite input overflows the squared deviations; ``std``
    is inf only where the true std exceeds the dtype's range.
    """
    valid = ~torch.isnan(x)
    zeros = x.new_zeros((num_groups, x.shape[1]))
    rows = index[:, None].expand_as(x)
    scale = pow2_scale(zeros.scatter_reduce(0, rows, torch.where(valid, x.abs(), 0.0), "amax"))
    xs = x / scale[index]
    count = zeros.index_add(0, index, valid.to(x.dtype))
    mean = zeros.index_add(0, index, torch.where(valid, xs, 0.0)) / count  # 0/0 -> NaN for empty groups
    dev = torch.where(valid, xs - mean[index], 0.0)
    var = zeros.index_add(0, index, dev * dev) / (count - 1)
    std_scaled = torch.where(count > 1, var.sqrt(), float("nan"))
    inf = torch.full_like(zeros, float("inf"))
    gmin = inf.scatter_reduce(0, rows, torch.where(valid, x, float("inf")), "amin")
    gmax = (-inf).scatter_reduce(0, rows, torch.where(valid, x, -float("inf")), "amax")
    return SegmentStats(count, mean * scale, std_scaled * scale, std_scaled, scale, gmin, gmax)


def group_advantages_torch(rewards, index, num_groups, scale, eps, weights, aggregation) -> AdvantageOutput:
    """rewards ``[N, K]`` float, index ``[N]`` in ``[0, num_groups)``, weights ``[K]``."""
    unscorable = torch.isnan(rewards).all(dim=1)
    if aggregation == "normalize_then_sum":
        st = segment_stats(rewards, index, num_groups)
        z = zscore(rewards, st.mean[index], st.std_scaled[index], st.scale[index], eps)
        total = torch.where(unscorable, float("nan"), (z * weights).nansum(dim=1))
    else:
        total = torch.where(unscorable, float("nan"), (rewards * weights).nansum(dim=1))

    n = total.shape[0]
    st = SegmentStats(*(t[:, 0] for t in segment_stats(total[:, None], index, num_groups)))
    zero_std = ((st.count < 2) | (st.gmax == st.gmin))[index]
    batch = None
    if aggregation == "normalize_then_sum" or scale == "batch":
        batch = SegmentStats(*(t[0, 0] for t in segment_stats(total[:, None], torch.zeros_like(index), 1)))
    if aggregation == "normalize_then_sum":
        adv = torch.nan_to_num(zscore(total, batch.mean, batch.std_scaled, batch.scale, eps), nan=0.0)
        return AdvantageOutput(adv, batch.mean.expand(n).clone(), batch.std.expand(n).clone(), zero_std)

    group_mean, group_std = st.mean[index], st.std[index]
    if scale == "group":
        adv = zscore(total, group_mean, st.std_scaled[index], st.scale[index], eps)
    elif scale == "batch":
        adv = zscore(total, group_mean, batch.std_scaled, batch.scale, eps)
        group_std = batch.std.expand(n).clone()
    else:
        adv = total - group_mean
    adv = torch.nan_to_num(adv, nan=0.0).masked_fill(zero_std, 0.0)
    return AdvantageOutput(adv, group_mean, group_std, zero_std)


def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-4,
    reward_weights=None,
    aggregation: str = "sum_then_normalize",
    impl: str = "auto",
) -> AdvantageOutput:
    """GRPO advantages ``A = (r - mean_group) / (std_group + eps)`` the way TRL computes them.

    rewards: ``[N]`` or ``[N, K]`` (K reward functions; NaN = that function gave no score). Groups are either
    contiguous blocks of ``group_size`` or given by ``group_ids [N]`` (any integers, any order, uneven sizes).
    ``r = nansum_k(w_k r_k)``; a row where every function returned NaN stays NaN and is left out of its group's
    statistics. ``scale``: "group" (divide by the group's unbiased std), "batch" (by the whole batch's), "none".
    ``aggregation="normalize_then_sum"`` is GDPO: per-function group z-scores, weighted sum, batch z-score.
    Unscorable rows, singleton groups and groups whose scores are all equal (``zero_std``) get advantage exactly 0
    (except under GDPO's batch z-score, where TRL gives them the batch-normalised value). Returns
    ``AdvantageOutput(advantages, group_mean, group_std, zero_std)``, each ``[N]``; float32 (float64 for float64).
    """
    fn = "group_advantages"
    checks.check_tensor(fn, "rewards", rewards, ndim=(1, 2), dtypes="float")
    n = rewards.shape[0]
    r = rewards if rewards.dim() == 2 else rewards[:, None]
    k = r.shape[1]
    if scale not in SCALES:
        raise ValueError(f"{fn}: scale must be one of {', '.join(map(repr, SCALES))}, got {scale!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{fn}: aggregation must be one of {', '.join(map(repr, AGGREGATIONS))}, got {aggregation!r}")
    eps = checks.real_value(f"{fn}: eps", eps, low=0.0)
    if (group_size is None) == (group_ids is None):
        raise ValueError(f"{fn}: pass exactly one of group_size or group_ids, got group_size={group_size!r} and "
                         f"group_ids={'None' if group_ids is None else checks.describe(group_ids)}")
    if n == 0:
        raise ValueError(f"{fn}: rewards must hold at least one row, got {checks.describe(rewards)}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or not 1 <= group_size <= n \
                or n % group_size:
            raise ValueError(f"{fn}: group_size must be a positive int dividing the {n} rows of rewards, "
                             f"got {group_size!r}")
        group_size = int(group_size)  # numpy ints too
        index = torch.arange(n, device=rewards.device) // group_size
        num_groups = n // group_size
    else:
        checks.check_tensor(fn, "group_ids", group_ids, shape=(n,), dtypes="int", device=rewards.device)
        _, index = torch.unique(group_ids, return_inverse=True)
        num_groups = int(index.max()) + 1
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    if reward_weights is None:
        weights = torch.ones(k, dtype=dtype, device=rewards.device)
    else:
        weights = checks.real_vector(fn, "reward_weights", reward_weights, k, dtype=dtype, device=rewards.device,
                                     what="one per reward column")
    if bool(torch.isinf(r).any()):
        raise ValueError(f"{fn}: rewards must be finite or NaN (no score), got inf in {checks.describe(rewards)}")

    impl = resolve_impl(impl, rewards.device, fn, rewards.dtype)
    if impl == "reference":
        return group_advantages_reference(rewards, group_ids=index, scale=scale, eps=eps, reward_weights=weights,
                                          aggregation=aggregation)
    if impl == "triton":
        from grpo_fast.kernels.group_advantages import group_advantages_triton

        return group_advantages_triton(r.to(dtype), index, num_groups, scale, eps, weights, aggregation)
    return group_advantages_torch(r.to(dtype), index, num_groups, scale, eps, weights, aggregation)
