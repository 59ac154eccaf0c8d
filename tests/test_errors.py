"""Bad input raises errors that name the argument, what was expected and what came (docs/design.md §9)."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch
from helpers import make_batch, to_float64

from grpo_fast import GRPOLoss, GRPOLossConfig, fused_logprobs, grpo_loss, grpo_loss_from_logps
from grpo_fast.checks import LOGPROB_SLACK
from grpo_fast.dispatch import resolve_impl
from grpo_fast.testing import assert_close_rule


@pytest.fixture
def batch():
    return make_batch(B=2, T=5, H=8, V=13, seed=0)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("loss_type", "ppo", "loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', "
                             "'vespo', 'dppo_tv', 'dppo_kl', 'gpg', 'dro', got 'ppo'"),
        ("importance_sampling_level", "tok", "importance_sampling_level must be one of 'token', 'sequence'"),
        ("beta", -0.1, "beta must be >= 0.0, got -0.1"),
        ("epsilon", float("nan"), "epsilon must be a finite number"),
        ("temperature", 0.0, "temperature must be in [0.01, 3.4e+38], got 0.0: the logits are divided by it"),
        ("temperature", 1e-38, "temperature must be in [0.01, 3.4e+38], got 1e-38"),
        ("temperature", 1e300, "temperature must be in [0.01, 3.4e+38], got 1e+300: the ops take it as a float32"),
        ("softcap", -1.0, "softcap must be in [1.18e-38, 3.4e+38] (a normal float32: the logits are divided by it), "
                          "got -1.0"),
        ("delta", 0.0, "delta must be > 0.0"),
        ("max_completion_length", 0, "max_completion_length must be a positive int"),
        ("top_entropy_quantile", 1.5, "top_entropy_quantile must be <= 1.0"),
        ("use_bias_correction_kl", 1, "use_bias_correction_kl must be True or False, got int 1"),
        ("use_bias_correction_kl", "no", "use_bias_correction_kl must be True or False, got str 'no'"),
        ("sapo_temperature_neg", 0, "sapo_temperature_neg must be in [0.01, 3.4e+38], got 0: the loss holds 4 / tau"),
        ("sapo_temperature_pos", 1e-300, "sapo_temperature_pos must be in [0.01, 3.4e+38], got 1e-300"),
        ("sapo_temperature_pos", 1e300, "sapo_temperature_pos must be in [0.01, 3.4e+38], got 1e+300"),
        ("softcap", 1e-300, "softcap must be in [1.18e-38, 3.4e+38] (a normal float32"),
        ("epsilon", 1e300, "epsilon must be within float32's range (|x| <= 3.4e+38: the ops take it as a float32 "
                           "scalar), got 1e+300"),
        ("vespo_k_neg", -1e39, "vespo_k_neg must be within float32's range"),
        ("beta", "0.1", "GRPOLossConfig.beta must be a finite number, got str '0.1'"),
        ("epsilon", np.float32("nan"), "GRPOLossConfig.epsilon must be a finite number, got np.float32(nan)"),
        ("temperature", np.float64(-1.0), "GRPOLossConfig.temperature must be in [0.01, 3.4e+38], got "
                                          "np.float64(-1.0)"),
        ("max_completion_length", np.float64(8), "max_completion_length must be a positive int"),
    ],
)
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises((ValueError, TypeError), match=re.escape(match)):
        GRPOLossConfig(**{field: value})


def test_config_takes_numpy_scalars_as_numbers():
    """np.float32(0.7) is a number: stored as the Python float it equals, so the config serialises and compares."""
    kw = dict(beta=0.25, epsilon=0.125, temperature=0.75, softcap=30.0, top_entropy_quantile=0.5, entropy_coef=0.0)
    config = GRPOLossConfig(**{k: np.float32(v) for k, v in kw.items()}, max_completion_length=np.int64(64))
    assert config == GRPOLossConfig(**kw, max_completion_length=64)
    assert type(config.beta) is float and type(config.max_completion_length) is int
    assert GRPOLossConfig(**json.loads(config.to_json())) == config


def test_config_accepts_strings_and_enum():
    assert GRPOLossConfig(loss_type="GRPO".lower()).loss_type.value == "grpo"
    assert GRPOLossConfig().eps_high == 0.2 and GRPOLossConfig(epsilon_high=0.28).eps_high == 0.28


def _call(batch, **changes):
    kw = dict(batch)
    config = changes.pop("config", GRPOLossConfig())
    kw.update(changes)
    return grpo_loss(**kw, config=config, impl="torch")


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(hidden=torch.randn(2, 5)), r"hidden must be \[B, T, H\]"),
        (dict(weight=torch.randn(13, 9)), r"weight must have shape \[\*, 8\], got tensor of shape \(13, 9\)"),
        (dict(weight=torch.randn(13, 8, dtype=torch.float64)), "weight must have the dtype of hidden"),
        (dict(target_ids=torch.zeros(2, 6, dtype=torch.long)), r"target_ids must have shape \[2, 5\]"),
        (dict(target_ids=torch.zeros(2, 5)), "target_ids must be an integer tensor"),
        (dict(target_ids=torch.full((2, 5), 13)), r"target_ids must hold ids in \[0, 13\).*got values in \[13, 13\]"),
        (dict(target_ids=torch.full((2, 5), -1)), r"target_ids must hold ids in \[0, 13\)"),
        (dict(advantages=torch.randn(3)), r"advantages must have shape \[2\] or \[2, 5\], got tensor of shape \(3,\)"),
        (dict(advantages=torch.tensor([0.0, float("nan")])), "advantages must be finite, got 1 NaN/inf"),
        (dict(completion_mask=torch.ones(2, 4)), r"completion_mask must have shape \[2, 5\]"),
        (dict(completion_mask=torch.full((2, 5), 2)), "completion_mask must hold only 0 and 1"),
        (dict(old_logps=torch.randn(2, 4)), r"old_logps must have shape \[2, 5\]"),
        (dict(old_logps=torch.full((2, 5), float("nan"))),
         r"grpo_loss: old_logps must be log-probabilities \(finite and <= 0.001\) where completion_mask is 1, got 9 "
         r"value\(s\) outside that \(nan, nan, nan\)"),
        (dict(sampling_ratio=-torch.ones(2, 5)),
         r"sampling_ratio must be importance-sampling weights p_old / p_sampler \(finite and >= 0\), got 10 value\(s\) "
         r"outside that \(-1, -1, -1\) in tensor of shape \(2, 5\)"),
        (dict(sampling_ratio=torch.tensor([[1.0], [float("inf")]])), r"sampling_ratio .* got 1 value\(s\) .* \(inf\)"),
        (dict(sampling_ratio=torch.tensor([[1.0], [float("nan")]])), r"sampling_ratio .* got 1 value\(s\) .* \(nan\)"),
        (dict(sampling_ratio=torch.ones(2, 3)), r"sampling_ratio must have shape \[2, 5\] or \[2, 1\]"),
        (dict(bias=torch.zeros(12)), r"bias must have shape \[13\]"),
        (dict(hidden=torch.full((2, 5, 8), float("inf"))), "hidden must be finite"),
        (dict(num_items_in_batch=torch.ones(2)),
         r"num_items_in_batch must be a finite number > 0 or a one-element real tensor, got tensor of shape \(2,\)"),
        (dict(num_items_in_batch=-3), "grpo_loss: num_items_in_batch must be a finite number > 0, got -3"),
        (dict(num_items_in_batch=0), "num_items_in_batch must be a finite number > 0, got 0"),
        (dict(num_items_in_batch=float("nan")), "num_items_in_batch must be a finite number, got nan"),
        (dict(num_items_in_batch=float("inf")), "num_items_in_batch must be a finite number, got inf"),
        (dict(num_items_in_batch=10**400), "num_items_in_batch must be a finite number, got 1000"),
        (dict(num_items_in_batch=np.float64("nan")), "num_items_in_batch must be a finite number, got np.float64"),
        (dict(num_items_in_batch=torch.tensor(-5.0)), r"num_items_in_batch must be finite and > 0, got -5.0 \(tensor"),
        (dict(num_items_in_batch=torch.tensor([float("inf")])), "num_items_in_batch must be finite and > 0, got inf"),
        (dict(num_items_in_batch=torch.tensor(True)), "num_items_in_batch must be .* one-element real tensor"),
        (dict(num_items_in_batch=True), "num_items_in_batch must be a finite number > 0 or a one-element tensor, got "
                                        "bool True"),
        (dict(num_items_in_batch="12"), "num_items_in_batch must be a finite number > 0 .* got str '12'"),
        (dict(hidden=torch.randn(2, 5, 0), weight=torch.randn(13, 0)), r"hidden must have a hidden size H >= 1"),
        (dict(weight=torch.randn(0, 8)), r"weight must have at least one row \(a vocabulary V >= 1\)"),
        (dict(weight=torch.randn(13, 8, device="meta")), "weight must hold data, got a meta tensor"),
        (dict(hidden=torch.randn(2, 5, 8, device="meta")), "hidden must hold data, got a meta tensor"),
        (dict(config=GRPOLossConfig(beta=0.1), ref_logps=None), "config.beta=0.1 needs ref_logps"),
        (dict(config="dapo"), "config must be a GRPOLossConfig, got str"),
        (dict(hidden=torch.randn(2, 5, 8).to(torch.int64)), "hidden must be float32, bfloat16, float16 or float64"),
    ],
)
def test_grpo_loss_bad_input(batch, changes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(batch, **changes)


@pytest.mark.parametrize("old_fill,ref_fill", [(float("nan"), -float("inf")), (0.7, 1e30)])
def test_padding_values_are_not_checked(batch, old_fill, ref_fill):
    """-inf/NaN or positive old or ref log-probs at masked positions are padding, not an error, and change nothing
    (the reference, TRL's formulas verbatim, would turn NaN into a NaN loss: 0 * NaN)."""
    mask = batch["completion_mask"]
    assert not mask.all()
    old = torch.where(mask, batch["old_logps"], old_fill)
    ref = torch.where(mask, batch["ref_logps"], ref_fill)
    config = GRPOLossConfig(beta=0.1)
    out = _call(batch, old_logps=old, ref_logps=ref, config=config)
    clean = _call(batch, config=config)
    for name, value in out._asdict().items():
        if value is not None:
            assert torch.equal(value, getattr(clean, name)), name


def _policy_logps(batch):
    return grpo_loss(**batch, impl="reference").per_token_logps


def _either(fn, batch, **changes):
    """``fn`` ("grpo_loss" or "grpo_loss_from_logps") on ``batch`` with ``changes``; the latter gets the policy's
    log-probs ``_policy_logps(batch)`` unless ``changes`` has ``logps``."""
    config = changes.pop("config", GRPOLossConfig(beta=0.1))
    kw = {**batch, **changes}
    if fn == "grpo_loss":
        return grpo_loss(**kw, config=config, impl="torch")
    logps = kw.pop("logps", None)
    logps = _policy_logps(batch) if logps is None else logps
    kw = {k: kw[k] for k in ("advantages", "completion_mask", "old_logps", "ref_logps", "sampling_ratio")}
    return grpo_loss_from_logps(logps, **kw, config=config, impl="torch")


@pytest.mark.parametrize("bad", ["probabilities", "positive", "nan", "-inf"])
@pytest.mark.parametrize("fn,name", [("grpo_loss", "old_logps"), ("grpo_loss", "ref_logps"),
                                     ("grpo_loss_from_logps", "old_logps"), ("grpo_loss_from_logps", "ref_logps"),
                                     ("grpo_loss_from_logps", "logps")])
def test_log_probs_that_are_not_log_probs_are_refused(batch, fn, name, bad):
    """Probabilities passed as log-probs (``old_logps = logps.exp()`` makes the gradient exactly 0), positive values,
    NaN and -inf at a counted position: refused, naming the argument."""
    x = _policy_logps(batch) if name == "logps" else batch[name]
    assert batch["completion_mask"][0].all()  # row 0 counts every position
    if bad == "probabilities":
        x = x.exp()
    else:
        x = x.clone()
        x[0, 2] = {"positive": 0.25, "nan": float("nan"), "-inf": -float("inf")}[bad]
    shown = {"positive": "0.25", "nan": "nan", "-inf": "-inf"}.get(bad, r"0\.\d+")
    count = int(batch["completion_mask"].sum()) if bad == "probabilities" else 1
    with pytest.raises(ValueError, match=rf"{fn}: {name} must be log-probabilities \(finite and <= 0.001\) where "
                                         rf"completion_mask is 1, got {count} value\(s\) outside that \({shown}"):
        _either(fn, batch, **{name: x})


@pytest.mark.parametrize("fn", ["grpo_loss", "grpo_loss_from_logps"])
def test_the_log_prob_slack_is_the_one_constant(batch, fn):
    """Up to LOGPROB_SLACK above 0 is rounding and accepted (the loss is the reference's on the same values); twice
    that is refused."""
    for name in ("old_logps", "ref_logps"):
        x = batch[name].clone()
        x[0, 1] = LOGPROB_SLACK / 2
        out = _either(fn, batch, **{name: x})
        ref = grpo_loss(**to_float64({**batch, name: x}), config=GRPOLossConfig(beta=0.1), impl="reference")
        pt = grpo_loss(**{**batch, name: x}, config=GRPOLossConfig(beta=0.1), impl="reference")
        assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, name)
        x[0, 1] = 2 * LOGPROB_SLACK
        with pytest.raises(ValueError, match=f"{name} must be log-probabilities"):
            _either(fn, batch, **{name: x})


def test_log_probs_computed_in_bfloat16_are_accepted():
    """Near-certain tokens, where a log-prob sits at 0 and rounding could push it up: TRL's selective_log_softmax on
    bfloat16 logits (how TRL computes reference log-probs in a bf16 model) and fused_logprobs on bfloat16 weights
    give values <= 0, which grpo_loss takes; its loss is the reference's on those values."""
    from trl.trainer.utils import selective_log_softmax

    gen = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 16, 61
    hidden = torch.randn(B, T, H, generator=gen) * 4
    weight = torch.randn(V, H, generator=gen)
    targets = (hidden @ weight.T).argmax(-1)  # the most likely token of every position
    ref_logps = selective_log_softmax((hidden @ weight.T).bfloat16(), targets).float()
    old_logps = fused_logprobs(hidden.bfloat16(), weight.bfloat16(), targets)
    for x in (ref_logps, old_logps):
        assert x.max() > -1e-4 and x.max() <= 0.0  # tokens of probability ~1, and no rounding above 0
    kw = dict(advantages=torch.randn(B, generator=gen), completion_mask=torch.ones(B, T, dtype=torch.long),
              old_logps=old_logps, ref_logps=ref_logps, config=GRPOLossConfig(beta=0.04))
    out = grpo_loss(hidden, weight, targets, impl="torch", **kw)
    pt = grpo_loss(hidden, weight, targets, impl="reference", **kw)
    ref = grpo_loss(hidden.double(), weight.double(), targets, impl="reference",
                    **{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                       for k, v in kw.items()})
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, "loss")
    assert_close_rule(out.kl, pt.kl, ref.kl, torch.float32, "kl")


def test_negative_sampling_ratios_are_refused_at_padding_too(batch):
    """sampling_ratio is checked at every position: vespo sums log(ratio) over every column, as TRL does (whose
    ratio there is exp(0) = 1)."""
    mask = batch["completion_mask"]
    assert int((~mask).sum()) == 1
    ratio = torch.where(mask, 1.0, -1.0)
    with pytest.raises(ValueError, match=r"sampling_ratio must be importance-sampling weights .* got 1 value\(s\) "
                                         r"outside that \(-1\)"):
        _call(batch, sampling_ratio=ratio)


@pytest.mark.parametrize("value", [0.0, 3.0, 5.0, 1e6])
def test_sampling_ratios_from_zero_past_trls_cap_are_accepted(batch, value):
    """0 (TRL's masked-out tokens) and ratios above TRL's default cap of 3 (the cap is the user's to choose) are
    ratios of probabilities: accepted, and a constant ratio scales the policy loss by itself."""
    ratio = torch.full((2, 1), value)
    base = _call(batch, sampling_ratio=torch.ones(2, 1))
    out = _call(batch, sampling_ratio=ratio)
    torch.testing.assert_close(out.loss, value * base.loss)


@pytest.mark.parametrize("fn", ["grpo_loss", "grpo_loss_from_logps"])
def test_dr_grpo_refuses_completions_longer_than_max_completion_length(batch, fn):
    """dr_grpo divides by B * max_completion_length; a counted token past it means a length the loss was not scaled
    for (T = 5, row 0 full)."""
    config = GRPOLossConfig(loss_type="dr_grpo", max_completion_length=4)
    with pytest.raises(ValueError, match=rf"{fn}: config.max_completion_length must be at least the longest "
                                         r"completion, got 4 while completion_mask counts tokens past its first 4 "
                                         r"columns \(T=5\)"):
        _either(fn, batch, config=config)


def test_dr_grpo_takes_padding_columns_past_max_completion_length(batch):
    """TRL's pad_to_multiple_of: T = 8 columns for completions of at most 5 tokens. max_completion_length=5 is then
    true, and the loss is the unpadded batch's."""
    config = GRPOLossConfig(loss_type="dr_grpo", max_completion_length=5)
    padded = dict(batch)
    for name in ("hidden", "target_ids", "completion_mask", "old_logps", "ref_logps"):
        x = batch[name]
        padded[name] = torch.cat([x, x.new_zeros((2, 3, *x.shape[2:]))], dim=1)
    out = _call(padded, config=config)
    pt = _call(batch, config=config)
    ref = grpo_loss(**to_float64(batch), config=config, impl="reference")
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, "loss")
    assert out.loss != 0


@pytest.mark.parametrize("n", [57, 57.0, np.float32(57), np.int64(57), torch.tensor(57), torch.tensor([57.0]),
                               torch.tensor(57.0, dtype=torch.float64)], ids=repr)
def test_num_items_in_batch_any_type(batch, n):
    """Every spelling of the number 57 gives the loss of the Python int 57, a 0-dim loss."""
    want = _call(batch, num_items_in_batch=57).loss
    got = _call(batch, num_items_in_batch=n).loss
    assert got.shape == () and torch.equal(got, want)
    ref = grpo_loss(**batch, num_items_in_batch=n, impl="reference").loss
    assert ref.shape == () and torch.allclose(ref, want)


@pytest.mark.parametrize("name", ["advantages", "old_logps", "ref_logps", "sampling_ratio"])
@pytest.mark.parametrize("fn", ["grpo_loss", "grpo_loss_from_logps"])
def test_constants_that_require_grad_are_refused(batch, name, fn):
    """advantages and the old/ref log-probs and sampling ratios are constants (TRL detaches them): one that requires
    grad would get none, so it is refused while grad mode is on, and accepted under no_grad."""
    batch["sampling_ratio"] = torch.full((2, 1), 0.9)
    batch[name] = batch[name].clone().requires_grad_(True)
    config = GRPOLossConfig(beta=0.1)
    with torch.no_grad():
        logps = grpo_loss(**batch, config=config).per_token_logps

    def call():
        if fn == "grpo_loss":
            return grpo_loss(**batch, config=config)
        kw = {k: batch[k] for k in ("old_logps", "ref_logps", "sampling_ratio")}
        return grpo_loss_from_logps(logps, batch["advantages"], batch["completion_mask"], config=config, **kw)

    with pytest.raises(ValueError, match=f"{fn}: {name} must not require grad .* constants of the GRPO objective "
                                         f".* pass {name}.detach()"):
        call()
    with torch.no_grad():
        assert torch.isfinite(call().loss)


def test_fused_logprobs_bad_input():
    h, w = torch.randn(4, 8), torch.randn(13, 8)
    with pytest.raises(TypeError, match="target_ids must be an integer tensor"):
        fused_logprobs(h, w, torch.zeros(4))
    with pytest.raises(ValueError, match=r"temperature must be in \[0.01, 3.4e\+38\], got 0: the logits are divided"):
        fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"fused_logprobs: temperature must be in \[0.01, 3.4e\+38\], got 1e-40"):
        fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), temperature=1e-40)
    with pytest.raises(ValueError, match=r"softcap must be in \[1.18e-38, 3.4e\+38\]"):
        fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), softcap=-2.0)
    with pytest.raises(ValueError, match="impl must be one of 'auto', 'triton', 'torch', 'reference', got 'cuda'"):
        fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), impl="cuda")
    with pytest.raises(ValueError, match="hidden must be"):
        fused_logprobs(torch.randn(8), w, torch.zeros((), dtype=torch.long))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got numpy.ndarray"):
        fused_logprobs(h, w.numpy(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"temperature must be in \[0.01, 3.4e\+38\], got np.float32"):
        fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), temperature=np.float32(-0.5))


def test_fused_logprobs_takes_numpy_scalars():
    h, w, y = torch.randn(4, 8), torch.randn(13, 8), torch.arange(4)
    want = fused_logprobs(h, w, y, temperature=0.75, softcap=20.0)
    got = fused_logprobs(h, w, y, temperature=np.float32(0.75), softcap=np.float64(20.0))
    assert torch.equal(got, want)


def test_from_logps_needs_entropy_for_entropy_options():
    logps, adv, mask = -torch.rand(2, 5), torch.randn(2), torch.ones(2, 5)
    with pytest.raises(ValueError, match="need entropy"):
        grpo_loss_from_logps(logps, adv, mask, config=GRPOLossConfig(top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match=r"grpo_loss_from_logps: logps must be log-probabilities \(finite and <= "
                                         r"0.001\)"):
        grpo_loss_from_logps(torch.full((2, 5), float("nan")), adv, mask)


def test_module_rejects_non_config():
    with pytest.raises(TypeError, match="GRPOLoss: config must be a GRPOLossConfig"):
        GRPOLoss({"loss_type": "grpo"})


def test_resolver(caplog, monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, "op") == "torch"
    assert resolve_impl("reference", cpu, "op") == "reference"
    with caplog.at_level(logging.DEBUG, logger="grpo_fast"):
        resolve_impl("torch", cpu, "test_resolver_op")
    assert "grpo_fast.test_resolver_op: using impl='torch' on cpu" in caplog.text
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", cpu, "op") == "triton"  # the interpreter runs the kernels on CPU
    assert resolve_impl("auto", cpu, "op") == "torch"  # but auto never picks it there
    with pytest.raises(ValueError, match="impl='triton' computes in float32 .* got float64"):
        resolve_impl("triton", cpu, "fused_logprobs", torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"impl='triton' needs CUDA tensors \(got device cpu\); set TRITON_INTERPRET=1"):
        resolve_impl("triton", cpu, "op")
