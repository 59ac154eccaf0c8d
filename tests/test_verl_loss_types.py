"""verl's per-token losses in GRPOLossConfig (dppo_tv, dppo_kl, gpg, dro): each held to verl's own formula through
``grpo_fast.verl_losses.policy_loss`` (token-mean), their trust-region thresholds, the ratio cap, ``dro_beta`` and the
refusals (clip_cov, kl_cov, geo_mean; sequence level; TRL's drop-in). The reference / torch / Triton parity over the
option grid is in tests/test_loss.py, tests/test_kernels.py and tests/test_properties.py, which iterate LossType."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_fast import GRPOLossConfig, LossType, grpo_loss_from_logps
from grpo_fast.config import DPPO_DEFAULT_CAP, REFUSED_LOSS_TYPES
from grpo_fast.testing import assert_close_rule, right_padded_mask
from grpo_fast.verl_losses import VerlLossParams, policy_loss

NEW_TYPES = [lt for lt in LossType if not lt.in_trl]
IMPLS = ("reference", "torch", "triton")
F64 = torch.float64


def _inputs(B=5, T=13, seed=0, dtype=F64):
    """Log-probs, old log-probs within +-1 of them (some tokens leave dppo's trust regions, a few ratios pass the
    cap of 2), per-token advantages of both signs and exact zeros (a zero-std group's row, and one token in five:
    verl sends A = 0 through the A < 0 rule), a ragged mask with a full row."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 2 - 0.05
    old = (logp + torch.empty(B, T, dtype=F64).uniform_(-1.0, 1.0, generator=gen)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    adv[B - 1] = 0.0
    adv[:, ::5] = 0.0
    weights = torch.rand(B, T, generator=gen, dtype=F64) + 0.5
    mask = right_padded_mask(B, T, gen, min_length=2, full_first_row=True)
    return dict(logp=logp.to(dtype), old=old.to(dtype), adv=adv.to(dtype), weights=weights.to(dtype), mask=mask)


def _ours(x, config, impl, weights=None):
    logp = x["logp"].detach().clone().requires_grad_(True)
    out = grpo_loss_from_logps(logp, x["adv"], x["mask"], old_logps=x["old"], sampling_ratio=weights, config=config,
                               impl=impl)
    out.loss.backward()
    return out, logp.grad


def _verl(name, x, params, weights=None):
    logp = x["logp"].detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(name, x["old"], logp, x["adv"], x["mask"], "token-mean", params,
                                rollout_is_weights=weights)
    loss.backward()
    return loss, logp.grad, metrics


CASES = {  # grpo-fast's options, verl's for the same loss
    "dppo_tv": (dict(epsilon=0.1, epsilon_high=0.15, delta=2.0),
                VerlLossParams(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=2.0)),
    "dppo_tv default cap": (dict(epsilon=0.1, epsilon_high=0.15),
                            VerlLossParams(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=None)),
    "dppo_kl": (dict(epsilon=0.05, epsilon_high=0.08, delta=2.0),
                VerlLossParams(clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=2.0)),
    "gpg": (dict(), VerlLossParams()),
    "dro": (dict(dro_beta=0.7), VerlLossParams(dro_beta=0.7)),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "is-weights"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_verl_policy_loss_token_mean(case, weighted, impl):
    """grpo-fast's type with num_items_in_batch=None (the micro-batch's token count) is verl's loss with
    loss_agg_mode "token-mean": same loss, same d loss / d logp, and for dppo verl's pg_clipfrac as
    clip_ratio_region. sampling_ratio is verl's rollout_is_weights (both multiply the policy term)."""
    options, params = CASES[case]
    name = case.split()[0]
    x = _inputs(seed=len(case))
    weights = x["weights"] if weighted else None
    out, grad = _ours(x, GRPOLossConfig(loss_type=name, **options), impl, weights)
    loss_v, grad_v, metrics = _verl(name, x, params, weights)
    assert_close_rule(out.loss, loss_v, loss_v, F64, f"{case} loss")
    assert_close_rule(grad, grad_v, grad_v, F64, f"{case} d logp")
    if LossType(name).is_dppo:
        # verl's masked_mean of a float32 flag over a bool mask is a float32 quotient: compare the token counts
        n = int(x["mask"].sum())
        assert round(metrics["actor/pg_clipfrac"] * n) == round(float(out.clip_ratio_region) * n), case
        assert 0 < out.clip_ratio_low and 0 < out.clip_ratio_high  # both sides leave the trust region here
        # region counts the A = 0 tokens outside too (verl's pg_clipfrac); low and high only A < 0 and A > 0
        assert out.clip_ratio_low + out.clip_ratio_high < out.clip_ratio_region, case
    else:
        assert out.clip_ratio_low is None and out.clip_ratio_high is None and out.clip_ratio_region is None


@pytest.mark.parametrize("impl", ("torch", "triton"))
@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_verl_float64(case, impl):
    """In float32 under the rule: verl's loss in float32 is the same-dtype baseline, in float64 the oracle."""
    options, params = CASES[case]
    name = case.split()[0]
    x64 = _inputs(seed=7)
    x32 = {k: (v.float() if v.is_floating_point() else v) for k, v in x64.items()}
    out, grad = _ours(x32, GRPOLossConfig(loss_type=name, **options), impl)
    loss_pt, grad_pt, _ = _verl(name, x32, params)
    loss_ref, grad_ref, _ = _verl(name, x64, params)
    assert_close_rule(out.loss, loss_pt, loss_ref, torch.float32, f"{case} loss")
    assert_close_rule(grad, grad_pt, grad_ref, torch.float32, f"{case} d logp")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("impl", IMPLS)
def test_zero_advantage_takes_the_negative_rule(impl, name, dtype):
    """A = 0 (a zero-std group) takes verl's A < 0 side: where(A > 0, pos, neg). A token whose probability fell far
    (p - p_old < -epsilon, and a binary KL past epsilon) is outside for A = 0 and counted in clip_ratio_region,
    though in neither clip_ratio_low (A < 0) nor clip_ratio_high (A > 0); on the A > 0 side it would be inside."""
    logp = torch.tensor([[-3.0, -0.2]], dtype=dtype)
    x = dict(logp=logp, old=torch.tensor([[-0.1, -0.2]], dtype=dtype), adv=torch.tensor([[0.0, 1.0]], dtype=dtype),
             mask=torch.ones(1, 2, dtype=torch.bool))
    out, _ = _ours(x, GRPOLossConfig(loss_type=name, epsilon=0.2, epsilon_high=0.2), impl)
    assert (float(out.clip_ratio_region), float(out.clip_ratio_low), float(out.clip_ratio_high)) == (0.5, 0.0, 0.0)
    _, _, metrics = _verl(name, {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()},
                          VerlLossParams(clip_ratio_low=0.2, clip_ratio_high=0.2))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


@pytest.mark.parametrize("name", [t.value for t in NEW_TYPES])
def test_float64_kernel_over_several_tiles(name):
    """T = 600 spans three of the float64 kernel's 256-wide tiles (two full, one ragged): verl's loss and gradient."""
    options, params = CASES[name]
    x = _inputs(B=3, T=600, seed=11)
    out, grad = _ours(x, GRPOLossConfig(loss_type=name, **options), "triton", x["weights"])
    loss_v, grad_v, metrics = _verl(name, x, params, x["weights"])
    assert_close_rule(out.loss, loss_v, loss_v, F64, f"{name} loss")
    assert_close_rule(grad, grad_v, grad_v, F64, f"{name} d logp")
    if LossType(name).is_dppo:
        n = int(x["mask"].sum())
        assert round(metrics["actor/pg_clipfrac"] * n) == round(float(out.clip_ratio_region) * n)


def _one_token(logp, old, adv, dtype):
    """A [1, 2] batch whose second position is padding: only (logp, old, adv) counts."""
    t = lambda v: torch.tensor([[v, -1.0]], dtype=dtype)  # noqa: E731
    return dict(logp=t(logp), old=t(old), adv=t(adv), mask=torch.tensor([[True, False]]))


JUST_BELOW_1 = 1.0 - 2.0 ** -24  # the float32 number below 1: the same threshold in float32 and float64


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("impl", IMPLS)
def test_dppo_tv_thresholds_are_inclusive(impl, dtype):
    """p - p_old exactly at +epsilon_high (A > 0) or -epsilon (A < 0) is inside the trust region (verl's <= / >=),
    one step beyond it is outside: exp(0) = 1 and exp(-800) = 0 exactly, so p - p_old = +-1 on every path."""
    for logp, old, adv, side in ((0.0, -800.0, 1.0, "high"), (-800.0, 0.0, -1.0, "low")):
        x = _one_token(logp, old, adv, dtype)
        for eps, inside in ((1.0, True), (JUST_BELOW_1, False)):
            bounds = dict(epsilon_high=eps, epsilon=0.2) if side == "high" else dict(epsilon=eps, epsilon_high=0.2)
            out, grad = _ours(x, GRPOLossConfig(loss_type="dppo_tv", **bounds), impl)
            flagged = getattr(out, f"clip_ratio_{side}")
            assert float(flagged) == (0.0 if inside else 1.0), (side, eps)
            assert float(out.clip_ratio_region) == float(flagged)
            # inside: -A * min(r, cap) with the log-ratio clamped to +-20, so r is exp(+-20): the cap 20 or exp(-20)
            expected = -adv * min(torch.exp(torch.tensor(20.0 if logp > old else -20.0, dtype=F64)).item(),
                                  DPPO_DEFAULT_CAP) if inside else 0.0
            assert_close_rule(grad[0, 0], torch.tensor(expected, dtype=F64), torch.tensor(expected, dtype=F64),
                              dtype, f"{side} d logp")
            assert float(grad[0, 1]) == 0.0


def _binary_kl(logp, old):
    """verl's binary KL of one token, in float64."""
    p, q = torch.exp(torch.tensor(logp, dtype=F64)), torch.exp(torch.tensor(old, dtype=F64))
    return float(q * (old - logp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8)))


@pytest.mark.parametrize("impl", IMPLS)
def test_dppo_kl_thresholds_and_directions(impl):
    """The binary KL against epsilon_high (A > 0) / epsilon (A < 0), just above and below it, and verl's free
    directions: with A > 0 a token whose probability fell is always inside, with A < 0 one whose rose."""
    for logp, old, adv, side in ((-0.3, -0.9, 1.0, "high"), (-0.9, -0.3, -1.0, "low")):
        x = _one_token(logp, old, adv, F64)
        kl = _binary_kl(logp, old)
        for eps, inside in ((kl * (1 + 1e-6), True), (kl * (1 - 1e-6), False)):
            bounds = dict(epsilon_high=eps) if side == "high" else dict(epsilon=eps)
            out, grad = _ours(x, GRPOLossConfig(loss_type="dppo_kl", **bounds), impl)
            assert float(getattr(out, f"clip_ratio_{side}")) == (0.0 if inside else 1.0), (side, eps)
            assert (float(grad[0, 0]) != 0.0) == inside
        # the other sign of A moves the probability the way the region lets through: inside at any threshold
        flipped = dict(x, adv=-x["adv"])
        out, grad = _ours(flipped, GRPOLossConfig(loss_type="dppo_kl", epsilon=0.0, epsilon_high=0.0), impl)
        assert float(out.clip_ratio_region) == 0.0 and float(grad[0, 0]) != 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_dppo_cap_and_log_ratio_clamp(impl):
    """The detached ratio is exp(clamp(logp - old, -20, 20)) truncated at delta (None: verl's 20.0); the gradient of
    a token inside the region is -A * that ratio / tokens."""
    cases = ((0.0, -2.0, 1.5, 1.5),  # r = e^2 ~ 7.4 capped at delta 1.5
             (0.0, -2.0, None, float(torch.exp(torch.tensor(2.0, dtype=F64)))),  # below the default cap 20
             (0.0, -5.0, None, DPPO_DEFAULT_CAP),  # e^5 ~ 148: the default cap 20
             (0.0, -30.0, 1e30, float(torch.exp(torch.tensor(20.0, dtype=F64)))))  # log-ratio 30 clamped to 20
    for logp, old, delta, ratio in cases:
        x = _one_token(logp, old, 0.5, F64)
        config = GRPOLossConfig(loss_type="dppo_tv", epsilon_high=1.0, delta=delta)  # p - p_old < 1: inside
        assert config.dppo_cap == (DPPO_DEFAULT_CAP if delta is None else delta)
        out, grad = _ours(x, config, impl)
        expected = torch.tensor(-0.5 * ratio, dtype=F64)
        assert_close_rule(grad[0, 0], expected, expected, F64, f"delta={delta} log-ratio={logp - old}")
        assert_close_rule(out.loss, expected * logp, expected * logp, F64, "loss")


@pytest.mark.parametrize("impl", IMPLS)
def test_dro_and_gpg_formulas(impl):
    """dro: -(A logp - 0.5 dro_beta (logp - old)^2), gradient -(A - dro_beta (logp - old)); gpg: -A logp, -A;
    one token, by hand."""
    logp, old, adv, beta = -0.4, -1.1, 0.8, 0.6
    x = _one_token(logp, old, adv, F64)
    for config, loss, grad_expected in (
            (GRPOLossConfig(loss_type="dro", dro_beta=beta), -(adv * logp - 0.5 * beta * (logp - old) ** 2),
             -(adv - beta * (logp - old))),
            (GRPOLossConfig(loss_type="gpg"), -adv * logp, -adv)):
        out, grad = _ours(x, config, impl)
        for name, a, b in (("loss", out.loss, loss), ("d logp", grad[0, 0], grad_expected)):
            b = torch.tensor(b, dtype=F64)
            assert_close_rule(a, b, b, F64, f"{config.loss_type.value} {name}")


def test_dro_beta_is_required_and_validated():
    with pytest.raises(ValueError, match=r"GRPOLossConfig\.dro_beta must be a number > 0 for loss_type='dro'"):
        GRPOLossConfig(loss_type="dro")
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, "0.5", True):
        with pytest.raises(ValueError, match=r"GRPOLossConfig\.dro_beta "):
            GRPOLossConfig(loss_type="dro", dro_beta=bad)
    for other in ("dapo", "gpg", "dppo_tv"):  # another loss type would ignore it: a mistake, refused
        with pytest.raises(ValueError, match=rf"dro_beta .* loss_type='{other}': expected None, got 0\.5"):
            GRPOLossConfig(loss_type=other, dro_beta=0.5)
    import numpy as np

    config = GRPOLossConfig(loss_type="dro", dro_beta=np.float64(0.25))
    assert type(config.dro_beta) is float and config == GRPOLossConfig(loss_type="dro", dro_beta=0.25)
    assert GRPOLossConfig(**dataclasses.asdict(config)) == config  # round trip (the ops' JSON form)


@pytest.mark.parametrize("name", list(REFUSED_LOSS_TYPES))
def test_refused_verl_losses_say_why_and_where(name):
    """clip_cov, kl_cov and geo_mean are not per-token functions of the batch: refused, naming the argument, the
    reason and the function that has them."""
    with pytest.raises(ValueError, match=rf"GRPOLossConfig\.loss_type '{name}' .*not offered") as info:
        GRPOLossConfig(loss_type=name)
    assert REFUSED_LOSS_TYPES[name] in str(info.value)
    assert f"grpo_fast.verl_losses.policy_loss('{name}'" in str(info.value)
    with pytest.raises(ValueError, match=rf"loss_type='{name}'.*grpo_fast\.verl_losses\.policy_loss"):
        LossType(name)
    help_text = next(f for f in dataclasses.fields(GRPOLossConfig) if f.name == "loss_type").metadata["help"]
    assert name in help_text and all(t.value in help_text for t in LossType)


@pytest.mark.parametrize("loss_type", NEW_TYPES, ids=lambda t: t.value)
def test_sequence_level_is_refused_naming_both_fields(loss_type):
    extra = dict(dro_beta=0.1) if loss_type == LossType.DRO else {}
    with pytest.raises(ValueError, match=r"GRPOLossConfig\.importance_sampling_level 'sequence' with "
                                         rf"GRPOLossConfig\.loss_type '{loss_type.value}'"):
        GRPOLossConfig(loss_type=loss_type, importance_sampling_level="sequence", **extra)
    assert not loss_type.allows_sequence_level and not loss_type.in_trl and loss_type.divides_by_num_items


@pytest.mark.parametrize("loss_type", [t.value for t in NEW_TYPES] + ["clip_cov"])
def test_trl_drop_in_refuses_loss_types_trl_lacks(tmp_path, loss_type):
    """TRL 1.16's GRPOTrainer has no such loss (its _compute_loss raises 'Unknown loss type'): FastGRPOTrainer
    refuses the config before loading the model."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    from grpo_fast.integrations.trl import FastGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, loss_type=loss_type)
    with pytest.raises(ValueError, match=rf"FastGRPOTrainer cannot reproduce(.|\n)*loss_type='{loss_type}': verl's "
                                         r"policy loss, which TRL 1\.16's GRPOTrainer does not have"):
        FastGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=[lambda completions, **kw: [0.0]],
                        args=args)
