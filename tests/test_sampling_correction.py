"""The off-policy correction of engine samples against a hand computation of TRL 1.16's formula, every mode."""

import math

import pytest
import torch

from grpo_fast.train.sampling_correction import MODES, importance_sampling_ratio

# two sequences of 3 columns; the second has one padding column (whose garbage log-probs must not count) and a
# token the engine could not score (NaN: ratio 1, left out of the difference metric)
OLD = [[-0.5, -1.0, -2.0], [-0.1, -0.7, -9.0]]
SAMPLED = [[-0.4, -1.5, -1.0], [float("nan"), -0.2, 3.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _hand(mode, clip_min, clip_max):
    """TRL's computation in plain Python floats: delta = (old - sampled) * mask, NaN -> 0; sequence modes sum it."""
    deltas = [[0.0 if math.isnan((o - s) * m) else (o - s) * m for o, s, m in zip(ro, rs, rm)]
              for ro, rs, rm in zip(OLD, SAMPLED, MASK)]
    if mode.startswith("sequence"):
        raw = [[math.exp(sum(row))] for row in deltas]
    else:
        raw = [[math.exp(d) for d in row] for row in deltas]
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return [[min(max(r, lo), hi) for r in row] for row in raw]
    return [[0.0 if (r < lo or r > hi) else r for r in row] for row in raw]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_min,clip_max", [(None, 3.0), (0.5, 1.2), (None, None), (0.9, None)])
def test_ratio_matches_trl_formula(mode, clip_min, clip_max):
    ratio, metrics = importance_sampling_ratio(torch.tensor(OLD), torch.tensor(SAMPLED), torch.tensor(MASK), mode,
                                               clip_min, clip_max)
    expected = torch.tensor(_hand(mode, clip_min, clip_max))
    assert ratio.shape == expected.shape
    torch.testing.assert_close(ratio, expected, rtol=1e-6, atol=0.0)
    # metrics: |old - sampled| over scored completion tokens; the ratio over tokens (token modes) or sequences
    deltas = [abs(o - s) for ro, rs, rm in zip(OLD, SAMPLED, MASK) for o, s, m in zip(ro, rs, rm)
              if m and not math.isnan(o - s)]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(deltas) / len(deltas), rel=1e-6)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(max(deltas), rel=1e-6)
    if mode.startswith("sequence"):
        flat = [r[0] for r in _hand(mode, clip_min, clip_max)]
    else:
        flat = [r for row, rm in zip(_hand(mode, clip_min, clip_max), MASK) for r, m in zip(row, rm) if m]
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(min(flat), rel=1e-6)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(flat) / len(flat), rel=1e-6)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(max(flat), rel=1e-6)


def test_default_mode_masks_a_sequence_past_clip_max():
    # exp(0.1 + 0.5 - 1.0) = 0.67 stays; the second sequence: exp(0 + (-0.5)) = 0.61 stays; push it over 3.0
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    sampled = torch.tensor([[-0.1, -0.2], [-0.6, -0.6]])  # exp(0.3) = 1.35, exp(1.2) = 3.32 > 3.0
    ratio, _ = importance_sampling_ratio(old, sampled, torch.ones(2, 2))
    torch.testing.assert_close(ratio, torch.tensor([[math.exp(0.3)], [0.0]]))


def test_identical_logps_give_ratio_one():
    lp = torch.tensor([[-0.3, -1.2, -0.01]])
    for mode in MODES:
        ratio, metrics = importance_sampling_ratio(lp, lp.clone(), torch.ones(1, 3), mode)
        assert torch.equal(ratio, torch.ones_like(ratio))
        assert metrics["sampling/sampling_logp_difference/max"] == 0.0


def test_bad_mode_and_shapes_name_the_argument():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of .* got 'sequence'"):
        importance_sampling_ratio(lp, lp, torch.ones(2, 3), "sequence")
    with pytest.raises(ValueError, match=r"sampling_logps \(2, 2\)"):
        importance_sampling_ratio(lp, torch.zeros(2, 2), torch.ones(2, 3))
