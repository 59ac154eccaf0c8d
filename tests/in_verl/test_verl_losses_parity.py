"""grpo_fast.verl_losses against verl 0.9.1's own POLICY_LOSS_REGISTRY functions (run in verl's venv), float32, by the
reference rule with verl's float32 as "PyTorch at the same dtype"; and the float64 transcription
(grpo_fast.reference.verl_policy_loss_reference) against verl run in float64."""

from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from grpo_fast.reference import verl_policy_loss_reference
from grpo_fast.testing import assert_close_rule, right_padded_mask
from grpo_fast.verl_losses import AGG_MODES, LOSS_NAMES, REFUSED, VerlLossParams, policy_loss

POLICY = dict(clip_cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=5.0, kl_cov_ratio=0.05, ppo_kl_coef=0.1,
              dro_beta=0.05)
GBI = dict(dp_size=2, batch_num_tokens=400, global_batch_size=11, loss_scale_factor=300)


def _config(global_batch_info=None) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, policy_loss=PolicyLossConfig(**POLICY),
                       global_batch_info=dict(global_batch_info or {}))


def _params(config) -> VerlLossParams:
    """The fields verl's losses read, from the config as verl reads them."""
    policy = config.policy_loss
    return VerlLossParams(clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low,
                          clip_ratio_high=config.clip_ratio_high, clip_ratio_c=config.get("clip_ratio_c", None),
                          tau_pos=config.get("tau_pos", None), tau_neg=config.get("tau_neg", None),
                          **{k: policy.get(k, None) for k in POLICY})


def _batch(B=6, T=123, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    logp = -torch.rand(B, T, **f64) * 3
    old = (logp + 0.3 * torch.randn(B, 1, **f64) + 0.5 * torch.randn(B, T, **f64)).clamp(max=0.0)
    adv = torch.randn(B, 1, **f64).expand(B, T).clone()
    adv[::2] += 0.3 * torch.randn(adv[::2].shape, **f64)
    weights = torch.rand(B, T, **f64) + 0.5
    mask = right_padded_mask(B, T, gen, full_first_row=True, empty_middle_row=True)
    return dict(old=old, logp=logp, adv=adv, mask=mask, weights=weights,
                upstream=float(torch.randn((), **f64)))


def _run(fn, name, batch, mode, dtype, config, params, weights):
    """``(loss, d loss / d log_prob, metrics)``; ``fn`` is verl's (config) or grpo-fast's (params) signature."""
    cast = lambda x: x.detach().to(dtype)  # noqa: E731
    logp = cast(batch["logp"]).requires_grad_(True)
    args = (cast(batch["old"]), logp, cast(batch["adv"]), batch["mask"], mode)
    w = cast(batch["weights"]) if weights else None
    torch.manual_seed(1234)  # clip_cov draws torch.randperm from the global generator
    if fn is policy_loss or fn is verl_policy_loss_reference:
        loss, metrics = fn(name, *args, params, w, dict(config.global_batch_info))
    else:
        loss, metrics = fn(*args, config, w)
    (loss * batch["upstream"]).backward()
    return loss.detach(), logp.grad, metrics


def _assert_rule(out, out_pt, out_ref, dtype, what):
    assert_close_rule(out[0], out_pt[0], out_ref[0], dtype, f"{what} loss")
    assert_close_rule(out[1], out_pt[1], out_ref[1], dtype, f"{what} d loss / d log_prob")
    assert out[2].keys() == out_pt[2].keys() == out_ref[2].keys(), (out[2].keys(), out_pt[2].keys())
    for key in out[2]:
        as_t = lambda m: torch.tensor(float(m[key]), dtype=torch.float64)  # noqa: E731
        assert_close_rule(as_t(out[2]), as_t(out_pt[2]), as_t(out_ref[2]), dtype, f"{what} {key}")


@pytest.mark.parametrize("name,mode,weights,global_info",
                         list(itertools.product(LOSS_NAMES, AGG_MODES, [False, True], [False, True])))
def test_matches_verl(name, mode, weights, global_info):
    config = _config(GBI if global_info else None)
    params = _params(config)
    batch = _batch(seed=len(name) * 7 + AGG_MODES.index(mode))
    verl_fn = get_policy_loss_fn(name)
    out = _run(policy_loss, name, batch, mode, torch.float32, config, params, weights)
    out_verl = _run(verl_fn, name, batch, mode, torch.float32, config, params, weights)
    out_ref = _run(verl_policy_loss_reference, name, batch, mode, torch.float64, config, params, weights)
    _assert_rule(out, out_verl, out_ref, torch.float32, f"{name} {mode}")
    assert out[1].abs().sum() > 0  # the case has a gradient to compare
    # the float64 transcription is verl: verl run in float64 agrees to float64's tolerance
    verl64 = _run(verl_fn, name, batch, mode, torch.float64, config, params, weights)
    _assert_rule(out_ref, verl64, verl64, torch.float64, f"reference {name} {mode}")


@pytest.mark.parametrize("name", ["vanilla", "dppo_tv", "dppo_kl"])
def test_clip_ratio_c_from_a_config_without_it(name):
    """A DictConfig without clip_ratio_c gets verl's per-loss default (3.0 vanilla, 20.0 dppo); params None does too.
    (An ActorConfig always has the field, 3.0 by default, so dppo under ActorConfig truncates at 3.0, not 20.)"""
    batch = _batch(4, 17, seed=3)
    batch["old"][:, :4] = batch["logp"][:, :4] - 3.5  # ratio e^3.5 = 33, above both caps
    config = OmegaConf.create(dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, global_batch_info={}))
    params = VerlLossParams(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    out = _run(policy_loss, name, batch, "token-mean", torch.float32, config, params, False)
    out_verl = _run(get_policy_loss_fn(name), name, batch, "token-mean", torch.float32, config, params, False)
    out_ref = _run(verl_policy_loss_reference, name, batch, "token-mean", torch.float64, config, params, False)
    _assert_rule(out, out_verl, out_ref, torch.float32, name)
    under_actor = _run(get_policy_loss_fn(name), name, batch, "token-mean", torch.float32, _config(), params, False)
    assert (not torch.equal(under_actor[1], out_verl[1])) == name.startswith("dppo")


def test_every_verl_loss_is_offered_or_refused():
    own = {n for n in POLICY_LOSS_REGISTRY if "." not in n}  # without grpo-fast's own registrations
    assert own == set(LOSS_NAMES) | set(REFUSED), own ^ (set(LOSS_NAMES) | set(REFUSED))
    assert set(LOSS_NAMES).isdisjoint(REFUSED)
    for name, reason in REFUSED.items():
        assert name in POLICY_LOSS_REGISTRY and reason
        with pytest.raises(ValueError, match=f"'{name}' is not offered"):
            b = _batch(2, 3)
            policy_loss(name, b["old"].float(), b["logp"].float(), b["adv"].float(), b["mask"], "token-mean",
                        VerlLossParams())
