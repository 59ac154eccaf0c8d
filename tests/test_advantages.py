"""group_advantages: the segmented torch path against the per-group reference loop and hand-computed values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from grpo_fast import group_advantages
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.testing import ATOL, assert_close_rule, max_abs_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", "reference",
         pytest.param("triton", marks=pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(),
                                                         reason="Triton needs CUDA or TRITON_INTERPRET=1"))]


def _rewards(n, k, seed, nan_frac=0.2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(n, k, generator=gen, dtype=torch.float64)
    r[torch.rand(n, k, generator=gen) < nan_frac] = float("nan")
    return r.to(dtype)


def _assert_matches(out, ref, dtype=torch.float64):
    for name in ("advantages", "group_mean", "group_std"):
        assert_close_rule(getattr(out, name), getattr(ref, name), getattr(ref, name), dtype, name)
    assert torch.equal(out.zero_std, ref.zero_std)


@pytest.mark.parametrize(
    "scale,aggregation,k,weights",
    list(itertools.product(["group", "batch", "none"], ["sum_then_normalize", "normalize_then_sum"], [1, 3],
                           [None, "random"])),
)
def test_torch_matches_reference_uneven_groups(scale, aggregation, k, weights):
    """Arbitrary, shuffled group ids with uneven sizes, singletons and NaN scores."""
    gen = torch.Generator().manual_seed(11)
    sizes = [1, 4, 7, 2, 5, 1, 3]
    ids = torch.cat([torch.full((s,), 100 + 7 * g) for g, s in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    rewards = _rewards(len(ids), k, seed=12)
    rewards[ids == 100 + 7 * 2] = 0.5  # a zero-std group
    w = torch.rand(k, generator=gen, dtype=torch.float64) + 0.5 if weights == "random" else None
    kw = dict(group_ids=ids, scale=scale, aggregation=aggregation, reward_weights=w)
    _assert_matches(group_advantages(rewards, impl="torch", **kw), group_advantages(rewards, impl="reference", **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contiguous_groups_equal_group_ids(dtype):
    rewards = _rewards(24, 2, seed=13, dtype=dtype)
    a = group_advantages(rewards, group_size=6)
    b = group_advantages(rewards, group_ids=torch.arange(24) // 6)
    assert torch.equal(a.advantages, b.advantages) and a.advantages.dtype == dtype


def test_hand_computed_group():
    """(r - mean) / (unbiased std + eps), TRL's eps 1e-4 and the textbook eps."""
    r = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    mean, std = 3.0, (((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 3) ** 0.5
    for eps in (1e-4, 1e-6, 0.0):
        out = group_advantages(r, group_size=4, eps=eps)
        want = (r - mean) / (std + eps)
        assert max_abs_err(out.advantages, want) <= ATOL[torch.float64]
        assert max_abs_err(out.group_std, torch.full((4,), std, dtype=torch.float64)) <= ATOL[torch.float64]
    assert not out.zero_std.any()


def test_zero_std_singleton_and_unscorable_rows_get_exactly_zero():
    r = torch.tensor([[0.1], [0.1], [0.1], [1.0], [float("nan")], [2.0], [5.0]], dtype=torch.float32)
    ids = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    out = group_advantages(r, group_ids=ids)
    assert out.advantages[:3].eq(0).all() and out.zero_std[:3].all()  # identical rewards: no signal, exactly 0
    assert out.advantages[3] == 0 and out.zero_std[3]  # singleton
    assert out.advantages[4] == 0  # unscorable row: NaN -> 0, excluded from its group's statistics
    std = (2 * 1.5**2) ** 0.5  # the scores 2 and 5 of the last group: mean 3.5, unbiased std
    assert max_abs_err(out.group_mean[4:], torch.full((3,), 3.5)) <= ATOL[torch.float32]
    assert max_abs_err(out.group_std[4:], torch.full((3,), std)) <= ATOL[torch.float32]
    want = torch.tensor([0.0, -1.5 / (std + 1e-4), 1.5 / (std + 1e-4)])
    assert max_abs_err(out.advantages[4:], want) <= ATOL[torch.float32]


def test_nan_scores_are_left_out_of_the_statistics():
    """A NaN in one of K functions is skipped by nansum; a row NaN in every function is unscorable."""
    r = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [3.0, 1.0], [0.0, 0.0]])
    out = group_advantages(r, group_size=4, scale="none")
    totals = torch.tensor([1.0, float("nan"), 4.0, 0.0])
    mean = (1.0 + 4.0 + 0.0) / 3
    want = torch.nan_to_num(totals - mean, nan=0.0)
    assert max_abs_err(out.advantages, want) <= ATOL[torch.float32]


def test_near_zero_std_group_is_not_flagged():
    """A spread of 1e-6 is a signal, scaled by 1 / (std + eps): eps, not the tiny std, sets the size."""
    r = torch.tensor([1.0, 1.0 + 1e-6, 1.0, 1.0], dtype=torch.float64)
    out = group_advantages(r, group_size=4)
    assert not out.zero_std.any()
    dev = torch.tensor([-0.25e-6, 0.75e-6, -0.25e-6, -0.25e-6], dtype=torch.float64)
    std = (dev.pow(2).sum() / 3).sqrt()
    assert max_abs_err(out.advantages, dev / (std + 1e-4)) <= ATOL[torch.float64]


def _closed_form(r, scale):
    """Advantages, group means and stds of rewards ``r [groups, G]`` with eps = 0, written out."""
    mean = r.mean(1, keepdim=True).expand_as(r)
    std = (r.flatten().std() if scale == "batch" else r.std(1, keepdim=True)).expand_as(r)
    adv = r - mean if scale == "none" else (r - mean) / std
    return adv.flatten(), mean.flatten(), std.flatten()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,magnitude", [(torch.float32, 1e30), (torch.float32, 1e-30), (torch.float32, 2.0**125),
                                             (torch.float64, 1e200)])
def test_huge_and_tiny_rewards_give_the_scale_free_advantages(impl, dtype, magnitude):
    """Group statistics never overflow: with eps = 0, rewards m * r have the advantages of r (times m for scale
    "none") and m times its means and stds. Rewards of 1e30 used to overflow the float32 squares (std inf, every
    advantage 0), rewards of 1e-30 to underflow them (std 0, advantages inf); at 2**125 (6 * 2**125 ~ 2.6e38) even
    a group's sum overflows float32. The float32 closed form runs on the unscaled r, so the rule's PyTorch error is
    honest (a float32 reference at magnitude m would overflow too and make the bound vacuous)."""
    base = torch.tensor([[1.0, 2.0, 3.0, 6.0], [-2.0, 0.5, 0.5, 4.0]], dtype=torch.float64)
    rewards = (base * magnitude).to(dtype).flatten().to(DEVICE)
    for scale in ("group", "batch", "none"):
        out = group_advantages(rewards, group_size=4, eps=0.0, scale=scale, impl=impl)
        got = (out.advantages.double() / (magnitude if scale == "none" else 1.0), out.group_mean.double() / magnitude,
               out.group_std.double() / magnitude)
        for name, a, b, c in zip(("advantages", "group_mean", "group_std"), got, _closed_form(base.to(dtype), scale),
                                 _closed_form(base, scale)):
            assert_close_rule(a.cpu(), b, c, dtype, f"{name} [{scale}]")


def test_numpy_scalars_are_numbers():
    rewards = _rewards(12, 1, seed=14, nan_frac=0.0)
    plain = group_advantages(rewards, group_size=4, eps=2.0**-10)  # exact in float32, so numpy's equals it
    for group_size, eps in ((np.int64(4), np.float32(2.0**-10)), (np.int32(4), np.float64(2.0**-10))):
        assert torch.equal(group_advantages(rewards, group_size=group_size, eps=eps).advantages, plain.advantages)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=5), "group_size must be a positive int dividing the 12 rows"),
        (dict(group_size=0), "group_size"),
        (dict(), "exactly one of group_size or group_ids"),
        (dict(group_size=4, group_ids=torch.zeros(12, dtype=torch.long)), "exactly one"),
        (dict(group_ids=torch.zeros(11, dtype=torch.long)), r"group_ids must have shape \[12\]"),
        (dict(group_ids=torch.zeros(12)), "group_ids must be an integer tensor"),
        (dict(group_size=4, scale="median"), "scale must be one of 'group', 'batch', 'none'"),
        (dict(group_size=4, aggregation="sum"), "aggregation must be one of"),
        (dict(group_size=4, eps=-1.0), r"group_advantages: eps must be >= 0.0, got -1.0"),
        (dict(group_size=4, eps=float("nan")), "group_advantages: eps must be a finite number, got nan"),
        (dict(group_size=4, eps="0.1"), "group_advantages: eps must be a finite number, got str '0.1'"),
        (dict(group_size=np.float64(4.0)), "group_size must be a positive int"),
        (dict(group_size=24), "group_size must be a positive int dividing the 12 rows"),
        (dict(group_size=4, reward_weights=[1.0, 2.0]), "reward_weights must have 1 entries"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        group_advantages(torch.randn(12), **kwargs)


def test_bad_rewards_are_named():
    with pytest.raises(ValueError, match="rewards must be finite or NaN"):
        group_advantages(torch.tensor([1.0, float("inf")]), group_size=2)
    with pytest.raises(TypeError, match="rewards must be float32"):
        group_advantages(torch.tensor([1, 2]), group_size=2)
    with pytest.raises(ValueError, match="rewards must have"):
        group_advantages(torch.zeros(2, 2, 2), group_size=2)
    with pytest.raises(ValueError, match="rewards must hold data, got a meta tensor"):
        group_advantages(torch.zeros(4, device="meta"), group_size=2)
