"""grpo_fast.verl_losses: verl 0.9.1's policy losses on the one-pass loss path against the float64 transcription of
verl (grpo_fast.reference.verl_policy_loss_reference), by the reference rule. verl itself is compared in
tests/in_verl/test_verl_losses_parity.py (verl's venv)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import make_mask

from grpo_fast.reference import verl_policy_loss_reference
from grpo_fast.testing import ATOL, assert_close_rule
from grpo_fast.verl_losses import AGG_MODES, LOSS_NAMES, REFUSED, VerlLossParams, policy_loss

# ratios large enough that kl_cov and clip_cov pick several tokens of a small batch; clip_cov's window admits many
PARAMS = VerlLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
                        clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=5.0, kl_cov_ratio=0.05, ppo_kl_coef=0.1,
                        dro_beta=0.05)
GBI = dict(dp_size=2, batch_num_tokens=400, global_batch_size=11, loss_scale_factor=300)


def _batch(B=6, T=123, seed=0, spread=0.5):
    """float64 ``[B, T]`` log-probs (<= 0), old log-probs near them (row shifts and token noise), per-sequence
    advantages with per-token noise on half the rows (verl passes [B, T]), a mask with a full and an empty row, IS
    weights in [0.5, 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    shift = 0.3 * torch.randn(B, 1, generator=gen, dtype=torch.float64)  # whole rows drift: gspo's ratio clips
    old = (logp + shift + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
    adv[::2] += 0.3 * torch.randn(adv[::2].shape, generator=gen, dtype=torch.float64)
    weights = torch.rand(B, T, generator=gen, dtype=torch.float64) + 0.5
    mask = make_mask(B, T, gen)
    upstream = float(torch.randn((), generator=gen, dtype=torch.float64))
    return dict(old=old, logp=logp, adv=adv, mask=mask, weights=weights, upstream=upstream)


def _run(fn, name, batch, mode, dtype, *, weights=False, gbi=None, params=PARAMS):
    """``(loss, d loss / d log_prob, metrics)`` of ``fn`` in ``dtype``, the loss times the batch's upstream
    gradient; the global generator reseeded first (clip_cov draws from it, as verl does)."""
    cast = lambda x: x.detach().to(dtype)  # noqa: E731
    logp = cast(batch["logp"]).requires_grad_(True)
    torch.manual_seed(1234)
    loss, metrics = fn(name, cast(batch["old"]), logp, cast(batch["adv"]), batch["mask"], mode, params,
                       cast(batch["weights"]) if weights else None, None if gbi is None else dict(gbi))
    (loss * batch["upstream"]).backward()
    return loss.detach(), logp.grad, metrics


def _assert_rule(batch, name, mode, dtype=torch.float32, **kw):
    out = _run(policy_loss, name, batch, mode, dtype, **kw)
    out_pt = _run(verl_policy_loss_reference, name, batch, mode, dtype, **kw)
    out_ref = _run(verl_policy_loss_reference, name, batch, mode, torch.float64, **kw)
    assert_close_rule(out[0], out_pt[0], out_ref[0], dtype, f"{name} {mode} loss")
    assert_close_rule(out[1], out_pt[1], out_ref[1], dtype, f"{name} {mode} d loss / d log_prob")
    assert out[2].keys() == out_ref[2].keys(), (out[2].keys(), out_ref[2].keys())
    for key in out[2]:
        assert isinstance(out[2][key], float), (key, type(out[2][key]))
        as_t = lambda m: torch.tensor(m[key], dtype=torch.float64)  # noqa: E731
        assert_close_rule(as_t(out[2]), as_t(out_pt[2]), as_t(out_ref[2]), dtype, f"{name} {mode} {key}")
    return out


GRID = list(itertools.product(LOSS_NAMES, AGG_MODES, [False, True], [False, True], [torch.float32, torch.float64]))


@pytest.mark.parametrize("name,mode,weights,global_info,dtype", GRID)
def test_matches_the_float64_reference(name, mode, weights, global_info, dtype):
    batch = _batch(seed=len(name) * 7 + AGG_MODES.index(mode))
    loss, grad, _ = _assert_rule(batch, name, mode, dtype, weights=weights, gbi=GBI if global_info else None)
    assert torch.isfinite(loss) and grad.abs().sum() > 0  # the batch exercises the loss (a test that can fail)
    assert (grad[~batch["mask"]] == 0).all()  # padding gets no gradient


def test_the_grid_exercises_clipping_and_selection():
    """The grid's batch clips, dual-clips and selects tokens, so the comparisons above cover those branches."""
    batch = _batch()
    _, _, m = _run(policy_loss, "vanilla", batch, "token-mean", torch.float64)
    assert m["actor/pg_clipfrac"] > 0 and m["actor/pg_clipfrac_lower"] > 0
    for name in ("clip_cov", "dppo_tv", "dppo_kl", "geo_mean", "cispo", "gspo"):
        assert _run(policy_loss, name, batch, "token-mean", torch.float64)[2]["actor/pg_clipfrac"] > 0, name
    # kl_cov's chosen tokens carry coef * |log ratio|: the loss differs from the same loss with coef 0
    no_kl = dataclass_replace(PARAMS, ppo_kl_coef=0.0)
    assert _run(policy_loss, "kl_cov", batch, "token-sum", torch.float64)[0] != \
        _run(policy_loss, "kl_cov", batch, "token-sum", torch.float64, params=no_kl)[0]


def dataclass_replace(params, **kw):
    import dataclasses

    return dataclasses.replace(params, **kw)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 7), (5, 2)])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_odd_shapes(name, shape, mode):
    B, T = shape
    batch = _batch(B, T, seed=B * 10 + T)
    _assert_rule(batch, name, mode, weights=True)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_batch_is_what_verl_gives(name, mode):
    """No token at all: verl's token-mean and seq-mean modes divide 0 by 0 (NaN loss), token-sum gives 0, geo_mean
    a mean of zeros; the gradient is 0 everywhere and the metrics are 0 (verl's masked_mean adds 1e-8)."""
    batch = _batch(4, 9, seed=3)
    batch["mask"] = torch.zeros_like(batch["mask"])
    for dtype in (torch.float32, torch.float64):
        loss, grad, metrics = _assert_rule(batch, name, mode, dtype, weights=True)
        nan_expected = name != "geo_mean" and (mode != "token-sum" or name == "sapo")
        assert bool(torch.isnan(loss)) == nan_expected, (name, mode, loss)
        assert (grad == 0).all()
        assert all(v == 0.0 for v in metrics.values())


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_extreme_log_ratios(name, mode):
    """|log_prob - old_log_prob| of 25 (past verl's +-20 clamp) on some tokens, and a row whose mean log-ratio passes
    gspo's cap of 10."""
    batch = _batch(4, 31, seed=11)
    logp, old = batch["logp"], batch["old"]
    logp[0, :6], old[0, :6] = -1.0, -26.0  # +25
    logp[1, :6], old[1, :6] = -26.0, -1.0  # -25
    logp[3], old[3] = -0.5, -12.5  # +12 on every token: gspo's log ratio clamps at 10
    batch["mask"][3, :5] = True
    # float32 only: kl_cov's e^25 gradients are ~1e9, past what float64's absolute 1e-10 can hold across op orders
    _assert_rule(batch, name, mode, torch.float32, weights=True)


def _tie_batch():
    """Exact ties in float64 at every bound verl takes a max / min / clamp at (checked below)."""
    batch = _batch(4, 8, seed=5)
    logp, old, adv = batch["logp"], batch["old"], batch["adv"]
    batch["mask"][:] = True
    # dyadic log-probs, so that log_prob - old_log_prob is exactly the intended log ratio
    old[0, 0] = logp[0, 0]  # r = 1: the two PPO branches tie (torch.maximum)
    x_hi = 0.1875  # r = exp(x_hi) = 1 + clip_ratio_high exactly (r - 1 is exact for r in [1, 2))
    logp[0, 1], old[0, 1] = -1.0, -1.0 - x_hi
    x_c = 1.25  # r = exp(1.25) = clip_ratio_c exactly, adv < 0: the dual clip ties (torch.min)
    logp[1, :], old[1, :] = -0.5, -0.5 - x_c
    adv[1, :] = -1.0
    logp[2, 0], old[2, 0] = -1.0, -21.0  # log ratio exactly 20: verl's clamp bound
    h = math.exp(x_hi) - 1
    logp[2, 1], old[2, 1] = -h, -2 * h  # log ratio exactly h = clip_ratio_high: geo_mean's clamp bound (high)
    logp[2, 2], old[2, 2] = -0.4, -0.2  # exactly -0.2: geo_mean's low bound
    logp[3, :], old[3, :] = -0.5, -10.5  # gspo's row log ratio exactly 10
    params = dataclass_replace(PARAMS, clip_ratio_high=math.exp(x_hi) - 1, clip_ratio_c=math.exp(x_c),
                               kl_cov_ratio=1.0)  # kl_cov: every token chosen, so |x| at x = 0 is differentiated
    r = torch.exp(logp - old)
    assert r[0, 0] == 1 and r[0, 1] == 1 + params.clip_ratio_high and (r[1] == params.clip_ratio_c).all()
    assert (logp - old)[2, 0] == 20 and (logp - old)[2, 1] == params.clip_ratio_high and (logp - old)[2, 2] == -0.2
    assert ((logp - old)[3] == 10).all()
    return batch, params


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_ties_at_the_bounds_follow_autograd(name):
    """In float64 the inputs tie exactly; the one-pass gradient splits them as autograd does (to 1e-10)."""
    batch, params = _tie_batch()
    for mode in ("token-mean", "seq-mean-token-mean"):
        _assert_rule(batch, name, mode, torch.float64, params=params)


def test_tie_gradients_are_autograds_values():
    """The tie rule itself on vanilla, by hand: r = 1 + eps_high with A > 0 ties the two branches (0.5 * -A r each,
    the clamp passes its bound); r = clip_ratio_c with A < 0 ties the dual clip (half of -A r)."""
    batch, params = _tie_batch()
    _, grad, _ = _run(policy_loss, "vanilla", batch, "token-sum", torch.float64, params=params)
    r = torch.exp(batch["logp"] - batch["old"])
    adv, up = batch["adv"], batch["upstream"]
    assert torch.allclose(grad[0, :2], up * -adv[0, :2] * r[0, :2], rtol=1e-12, atol=0)
    assert torch.allclose(grad[1], up * 0.5 * -adv[1] * r[1], rtol=1e-12, atol=0)


def test_saves_only_the_gradient():
    """The autograd graph of policy_loss holds one [B, T] tensor (the gradient); verl's holds several."""
    batch = _batch(5, 41, seed=2)
    for name in LOSS_NAMES:
        for fn, one in ((policy_loss, True), (verl_policy_loss_reference, False)):
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                _run(fn, name, batch, "seq-mean-token-mean", torch.float32, weights=True)
            if one:
                assert saved == [(5, 41)], (name, saved)
            else:
                assert len(saved) >= 2, (name, saved)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_no_grad_gives_the_same_loss_and_metrics(name):
    batch = _batch(seed=4)
    loss, _, metrics = _run(policy_loss, name, batch, "token-mean", torch.float32, weights=True, gbi=GBI)
    torch.manual_seed(1234)
    with torch.no_grad():
        loss2, metrics2 = policy_loss(name, batch["old"].float(), batch["logp"].float(), batch["adv"].float(),
                                      batch["mask"], "token-mean", PARAMS, batch["weights"].float(), GBI)
    assert torch.equal(loss, loss2) and metrics == metrics2


@pytest.mark.parametrize("name", [n for n in LOSS_NAMES if n not in ("geo_mean", "kl_cov", "clip_cov")])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_global_batch(name, mode):
    """With verl's global batch info, the micro-batch losses and gradients add up to the whole batch's (geo_mean
    ignores the info; kl_cov and clip_cov choose tokens per micro-batch, as verl does)."""
    batch = _batch(6, 37, seed=9)
    mask = batch["mask"]
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
    whole = _run(policy_loss, name, batch, mode, torch.float64, weights=True, gbi=info)
    parts = [_run(policy_loss, name, {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
                  mode, torch.float64, weights=True, gbi=info) for rows in (slice(0, 2), slice(2, 6))]
    tol = 1e-12 + ATOL[torch.float64]
    assert abs(float(whole[0] - parts[0][0] - parts[1][0])) < tol
    assert (whole[1] - torch.cat([parts[0][1], parts[1][1]])).abs().max() < tol


def _call(name="vanilla", mode="token-mean", params=PARAMS, **over):
    batch = _batch(3, 5, seed=1)
    kw = dict(old_log_prob=batch["old"].float(), log_prob=batch["logp"].float(), advantages=batch["adv"].float(),
              response_mask=batch["mask"], loss_agg_mode=mode, params=params, rollout_is_weights=None,
              global_batch_info=None)
    kw.update(over)
    return policy_loss(name, **kw)


@pytest.mark.parametrize("make,err,words", [
    (lambda: _call("nope"), ValueError, ["name must be one of", "'nope'"]),
    (lambda: _call("bypass_mode"), ValueError, ["'bypass_mode' is not offered", "rollout"]),
    (lambda: _call(mode="mean"), ValueError, ["loss_agg_mode must be one of", "'mean'"]),
    (lambda: _call(params={"clip_ratio": 0.2}), TypeError, ["params must be a VerlLossParams", "dict"]),
    (lambda: VerlLossParams(clip_ratio="0.2"), ValueError, ["VerlLossParams.clip_ratio", "finite number", "'0.2'"]),
    (lambda: VerlLossParams(dro_beta=math.inf), ValueError, ["VerlLossParams.dro_beta", "finite", "inf"]),
    (lambda: _call(params=VerlLossParams(clip_ratio_c=1.0)), ValueError,
     ["VerlLossParams.clip_ratio_c", "dual-clip", "> 1.0", "got 1.0"]),
    (lambda: _call("dro", params=VerlLossParams()), ValueError, ["VerlLossParams.dro_beta", "> 0", "got None"]),
    (lambda: _call("kl_cov", params=VerlLossParams(kl_cov_ratio=0.0)), ValueError,
     ["VerlLossParams.kl_cov_ratio", "> 0.0", "got 0.0"]),
    (lambda: _call("clip_cov", params=VerlLossParams(clip_cov_ratio=-1.0)), ValueError,
     ["VerlLossParams.clip_cov_ratio", "> 0.0"]),
    (lambda: _call("sapo", params=VerlLossParams(tau_neg=0.0)), ValueError, ["VerlLossParams.tau_neg"]),
    (lambda: _call(params=VerlLossParams(clip_ratio=None, clip_ratio_low=None)), ValueError,
     ["VerlLossParams.clip_ratio ", "clip_ratio_low is None", "got None"]),
    (lambda: _call(params=VerlLossParams(clip_ratio_high=-0.1)), ValueError,
     ["VerlLossParams.clip_ratio_high", ">= 0.0", "-0.1"]),
    (lambda: _call(log_prob=torch.zeros(3, 5, dtype=torch.bfloat16)), TypeError, ["log_prob", "float32 or float64"]),
    (lambda: _call(advantages=torch.zeros(3)), ValueError, ["advantages must have shape [3, 5]"]),
    (lambda: _call(response_mask=torch.full((3, 5), 2.0)), ValueError, ["response_mask", "only 0 and 1"]),
    (lambda: _call(rollout_is_weights=torch.ones(3, 2)), ValueError, ["rollout_is_weights", "[3, 5] or [3, 1]"]),
    (lambda: _call(advantages=torch.zeros(3, 5, requires_grad=True)), ValueError,
     ["advantages must not require grad"]),
    (lambda: _call(old_log_prob=torch.zeros(3, 5, requires_grad=True)), ValueError,
     ["old_log_prob must not require grad"]),
    (lambda: _call(global_batch_info={"dp": 2}), ValueError, ["global_batch_info may hold only", "'dp'"]),
    (lambda: _call(global_batch_info={"dp_size": 2}), ValueError, ["batch_num_tokens is required"]),
    (lambda: _call(mode="seq-mean-token-mean", global_batch_info={"dp_size": 2}), ValueError,
     ["global_batch_size is required"]),
])
def test_validation_errors_name_the_argument(make, err, words):
    with pytest.raises(err) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_refused_and_supported_names():
    assert set(LOSS_NAMES).isdisjoint(REFUSED) and list(REFUSED) == ["bypass_mode"]
    assert all(isinstance(v, str) and v for v in REFUSED.values())


def test_clip_ratio_c_defaults_per_loss():
    """None: vanilla's dual clip at 3.0, dppo's truncation at 20.0 (verl's config.get defaults)."""
    batch = _batch(4, 9, seed=6)
    batch["old"][:, :3] = batch["logp"][:, :3] - 3.5  # ratio e^3.5 = 33: above both caps
    for name, c in (("vanilla", 3.0), ("dppo_tv", 20.0), ("dppo_kl", 20.0)):
        got = _run(policy_loss, name, batch, "token-mean", torch.float64, params=VerlLossParams())
        want = _run(policy_loss, name, batch, "token-mean", torch.float64, params=VerlLossParams(clip_ratio_c=c))
        other = _run(policy_loss, name, batch, "token-mean", torch.float64,
                     params=VerlLossParams(clip_ratio_c=23.0 - c))
        assert torch.equal(got[1], want[1]) and not torch.equal(got[1], other[1]), name
