"""Property-based tests of the public API (hypothesis): every call either raises ValueError/TypeError naming the
argument that is wrong, or returns what the float64 reference (grpo_fast.reference) returns, under the tolerance
rule of grpo_fast.testing.

Each example is a valid call plus at most one fault drawn from a catalogue (argument name, bad value). Without a
fault the call must succeed and match the reference; with one it must raise an error whose message names the
faulty argument. ``derandomize=True`` makes the examples the same on every run, so CI is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_fast import GRPOLossConfig, LossType, fused_logprobs, group_advantages, grpo_loss, grpo_loss_from_logps
from grpo_fast.reference import grpo_loss_reference, logprobs_reference, loss_from_logps_reference
from grpo_fast.testing import assert_close_rule

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class Fault:
    """One wrong argument: ``apply(kwargs)`` breaks it in place; ``name`` must appear in the error message."""

    def __init__(self, name, apply, label):
        self.name, self.apply, self.label = name, apply, label

    def __repr__(self):
        return f"Fault({self.label})"


def _set(key, value):
    return lambda kw: kw.__setitem__(key, value(kw) if callable(value) else value)


def _poison(key, value=float("nan")):
    """``value`` at position [0, 0] of ``kw[key]``; row 0 is always fully masked in, so it counts."""

    def apply(kw):
        x = kw[key].detach().clone()
        x.view(-1)[0] = value
        kw[key] = x

    return apply


def _requiring_grad(key):
    return lambda kw: kw.__setitem__(key, kw[key].detach().clone().requires_grad_(True))


LOSS_FAULTS = [
    *(Fault("num_items_in_batch", _set("num_items_in_batch", v), repr(v))
      for v in (float("nan"), float("inf"), -float("inf"), 0, -5, 0.0, True, "12", np.float32("nan"))),
    Fault("num_items_in_batch", _set("num_items_in_batch", lambda kw: torch.tensor(-5.0)), "tensor(-5.)"),
    Fault("num_items_in_batch", _set("num_items_in_batch", lambda kw: torch.tensor([float("nan")])), "tensor([nan])"),
    Fault("num_items_in_batch", _set("num_items_in_batch", lambda kw: torch.ones(2)), "tensor of 2"),
    Fault("advantages", _set("advantages", lambda kw: torch.zeros(kw["completion_mask"].shape[0] + 1)), "shape"),
    Fault("advantages", _poison("advantages"), "nan"),
    Fault("advantages", _poison("advantages", float("inf")), "inf"),
    Fault("advantages", _set("advantages", lambda kw: kw["advantages"].long()), "int dtype"),
    Fault("advantages", _requiring_grad("advantages"), "requires_grad"),
    Fault("completion_mask", _set("completion_mask", lambda kw: kw["completion_mask"][:, :-1]), "shape"),
    Fault("completion_mask", _set("completion_mask", lambda kw: kw["completion_mask"].long() * 2), "values 2"),
    Fault("old_logps", _poison("old_logps"), "nan"),
    Fault("old_logps", _set("old_logps", lambda kw: kw["old_logps"][:, :-1]), "shape"),
    Fault("old_logps", _requiring_grad("old_logps"), "requires_grad"),
    Fault("ref_logps", _poison("ref_logps", -float("inf")), "-inf"),
    Fault("ref_logps", _requiring_grad("ref_logps"), "requires_grad"),
    Fault("old_logps", _set("old_logps", lambda kw: kw["old_logps"].exp()), "probabilities"),
    Fault("ref_logps", _poison("ref_logps", 0.5), "positive"),
    Fault("sampling_ratio", _poison("sampling_ratio", -1.0), "negative"),
    Fault("sampling_ratio", _set("sampling_ratio", lambda kw: torch.ones(kw["completion_mask"].shape[0], 2, 2)),
          "3-d"),
    Fault("sampling_ratio", _set("sampling_ratio", lambda kw: torch.full(kw["completion_mask"].shape, float("inf"))),
          "inf"),
    Fault("sampling_ratio", _set("sampling_ratio", lambda kw: torch.ones(kw["completion_mask"].shape,
                                                                          requires_grad=True)), "requires_grad"),
    Fault("impl", _set("impl", "cuda"), "cuda"),
    Fault("logps", _poison("logps"), "nan"),
    Fault("logps", _poison("logps", 0.5), "positive"),
    Fault("logps", _set("logps", lambda kw: kw["logps"][None]), "3-d"),
    Fault("entropy", _set("entropy", lambda kw: kw["entropy"][:, :-1]), "shape"),
    # grpo_loss only
    Fault("target_ids", _set("target_ids", lambda kw: kw["target_ids"] + kw["weight"].shape[0]), "ids >= V"),
    Fault("target_ids", _set("target_ids", lambda kw: kw["target_ids"].float()), "float ids"),
    Fault("hidden", _poison("hidden", float("inf")), "inf"),
    Fault("hidden", _set("hidden", lambda kw: kw["hidden"][..., :0]), "H = 0"),
    Fault("weight", _set("weight", lambda kw: kw["weight"].double()), "float64"),
    Fault("weight", _set("weight", lambda kw: kw["weight"].to("meta")), "meta"),
    Fault("bias", _set("bias", lambda kw: kw["bias"][:-1]), "shape"),
]
CONFIG_FAULTS = [
    ("beta", -0.1), ("beta", float("nan")), ("epsilon", -1.0), ("epsilon", "0.2"), ("epsilon_high", float("inf")),
    ("delta", 0.0), ("temperature", 0.0), ("loss_type", "ppo"), ("importance_sampling_level", "seq"),
    ("top_entropy_quantile", 1.5), ("max_completion_length", 0), ("sapo_temperature_pos", np.float64(-1.0)),
    ("use_bias_correction_kl", 1), ("loss_type", "clip_cov"), ("loss_type", "kl_cov"), ("loss_type", "geo_mean"),
    ("dro_beta", 0.0), ("dro_beta", float("inf")),
]


@st.composite
def loss_calls(draw, with_hidden=False):
    """Keyword arguments of a valid grpo_loss_from_logps call (or grpo_loss with ``with_hidden``), a config's
    fields, and at most one fault."""
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[0] = T  # row 0 full (where the faults poison a value); others may be empty
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if draw(st.booleans()):
        mask = mask.to(draw(st.sampled_from([torch.int64, torch.float32, torch.uint8])))
    kw = dict(completion_mask=mask)
    if with_hidden:
        H, V = draw(st.integers(1, 8)), draw(st.integers(1, 11))
        kw["hidden"] = torch.randn(B, T, H, generator=gen)
        kw["weight"] = torch.randn(V, H, generator=gen) / math.sqrt(H)
        kw["target_ids"] = torch.randint(0, V, (B, T), generator=gen)
        if draw(st.booleans()):
            kw["bias"] = torch.randn(V, generator=gen) * 0.1
        logps = torch.zeros(B, T)  # the policy's log-probs are near 0 .. -log V
    else:
        logps = -torch.rand(B, T, generator=gen) * 4
        kw["logps"] = logps
    kw["advantages"] = torch.randn((B, T) if draw(st.booleans()) else (B,), generator=gen)
    # log-ratios within +-2 (exp(2) ~ 7): a float32 loss of a few units, where the rule's atol is meaningful;
    # log-probs are <= 0
    for name in ("old_logps", "ref_logps"):
        if draw(st.booleans()):
            noise = torch.empty(B, T).uniform_(-1, 1, generator=gen) - torch.rand(B, T, generator=gen)
            kw[name] = (logps + noise).clamp(max=0.0)
    shape = draw(st.sampled_from([None, (B, T), (B, 1)]))
    if shape is not None:
        kw["sampling_ratio"] = torch.rand(shape, generator=gen) + 0.5
    kw["num_items_in_batch"] = draw(st.sampled_from(
        [None, 1, 7, 0.5, 123.0, np.float32(9.0), np.int64(40), torch.tensor(9.0), torch.tensor([40.0]),
         torch.tensor(13)]))
    loss_type = draw(st.sampled_from(list(LossType)))
    fields = dict(
        loss_type=loss_type.value,
        beta=draw(st.sampled_from([0.0, 0.04, np.float32(0.5)])),
        epsilon=draw(st.sampled_from([0.2, 0.1])),
        epsilon_high=draw(st.sampled_from([None, 0.28, 5.0])),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"] if loss_type.allows_sequence_level
                                                       else ["token"])),
        use_bias_correction_kl=draw(st.booleans()),
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5])),
        entropy_coef=draw(st.sampled_from([0.0, 0.0, 0.01])),
    )
    if loss_type.is_clip_family or loss_type.is_dppo:
        fields["delta"] = draw(st.sampled_from([None, 1.5]))
    if loss_type == LossType.DRO:
        fields["dro_beta"] = draw(st.sampled_from([0.1, 2.0]))
    if with_hidden:
        fields["temperature"] = draw(st.sampled_from([1.0, 0.7, np.float32(1.3)]))
        fields["softcap"] = draw(st.sampled_from([None, 3.0]))
    if fields["beta"] != 0.0 and "ref_logps" not in kw:
        kw["ref_logps"] = logps - 0.1
    needs_entropy = fields["top_entropy_quantile"] < 1.0 or fields["entropy_coef"] != 0.0
    if not with_hidden and (needs_entropy or draw(st.booleans())):
        kw["entropy"] = torch.rand(B, T, generator=gen) * 2
    kw["impl"] = "torch"

    fault = draw(st.none() | st.sampled_from(LOSS_FAULTS) | st.sampled_from(CONFIG_FAULTS))
    if isinstance(fault, tuple):
        fields[fault[0]] = fault[1]
        fault = Fault(f"GRPOLossConfig.{fault[0]}", None, repr(fault))
    elif fault is not None:
        if fault.name in ("num_items_in_batch", "impl") or fault.name in kw:
            fault.apply(kw)
        else:
            fault = None  # an optional argument this call does not pass
    if fault is None and fields["beta"] != 0.0 and draw(st.integers(0, 9)) == 0:
        del kw["ref_logps"]  # beta > 0 without reference log-probs
        fault = Fault("ref_logps", None, "missing with beta > 0")
    return kw, fields, fault


def _full_call(with_hidden):
    """One valid call with every optional argument given (so that every fault of the catalogue applies)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 4, 5, 7
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    logps = -torch.rand(B, T, generator=gen) * 3
    kw = dict(completion_mask=mask, advantages=torch.randn(B, generator=gen), old_logps=(logps + 0.1).clamp(max=0.0),
              ref_logps=logps - 0.1, sampling_ratio=torch.rand(B, T, generator=gen) + 0.5, num_items_in_batch=9,
              impl="torch")
    if with_hidden:
        kw.update(hidden=torch.randn(B, T, H, generator=gen), weight=torch.randn(V, H, generator=gen),
                  target_ids=torch.randint(0, V, (B, T), generator=gen), bias=torch.zeros(V))
    else:
        kw.update(logps=logps, entropy=torch.rand(B, T, generator=gen))
    return kw


@pytest.mark.parametrize("fault", LOSS_FAULTS, ids=lambda f: f"{f.name}-{f.label}")
def test_every_fault_of_the_catalogue_is_named(fault):
    """Each fault on its own, applied to a call that passes every optional argument: hypothesis favours the first
    entries of a catalogue, this runs all of them."""
    fields = dict(beta=0.04, top_entropy_quantile=0.5)
    applied = 0
    for with_hidden, fn in ((False, grpo_loss_from_logps), (True, grpo_loss)):
        kw = _full_call(with_hidden)
        fn(**kw, config=GRPOLossConfig(**fields))  # valid as it is
        if fault.name not in kw:
            continue
        fault.apply(kw)
        with pytest.raises((ValueError, TypeError), match=fault.name):
            fn(**kw, config=GRPOLossConfig(**fields))
        applied += 1
    assert applied


@pytest.mark.parametrize("field,value", CONFIG_FAULTS, ids=lambda v: repr(v))
def test_every_config_fault_is_named(field, value):
    with pytest.raises((ValueError, TypeError), match=f"GRPOLossConfig.{field} "):
        GRPOLossConfig(**{field: value})


def _float64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double()
    return x


def _check_error(error, fault):
    assert fault is not None, f"a valid call raised {error!r}"
    assert fault.name in str(error), f"{fault}: the message does not name {fault.name!r}: {error}"


def _leaf(x, dtype):
    return x.detach().to(dtype).requires_grad_(True)


@settings(max_examples=200, **SETTINGS)
@given(loss_calls())
def test_grpo_loss_from_logps_raises_naming_the_argument_or_matches_the_reference(call):
    kw, fields, fault = call
    kw = dict(kw)
    try:
        config = GRPOLossConfig(**fields)
        logps = _leaf(kw.pop("logps"), torch.float32)
        out = grpo_loss_from_logps(logps, kw.pop("advantages"), kw.pop("completion_mask"), config=config, **kw)
    except (ValueError, TypeError) as error:
        _check_error(error, fault)
        return
    assert fault is None, f"{fault} was accepted"
    upstream = 0.7
    (out.loss * upstream).backward()

    def reference(dtype):
        args = {k: (_float64(v).to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in call[0].items() if k not in ("impl", "logps")}
        leaf = _leaf(call[0]["logps"], dtype)
        ref = loss_from_logps_reference(leaf, args.pop("advantages"), args.pop("completion_mask"), config=config,
                                        **args)
        (ref.loss * upstream).backward()
        return ref, leaf.grad

    (pt, g_pt), (ref, g_ref) = reference(torch.float32), reference(torch.float64)
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, f"loss {fields}")
    assert_close_rule(logps.grad, g_pt, g_ref, torch.float32, f"d logps {fields}")
    for name in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
        assert_close_rule(getattr(out, name), getattr(pt, name), getattr(ref, name), torch.float32, name)


@settings(max_examples=120, **SETTINGS)
@given(loss_calls(with_hidden=True))
def test_grpo_loss_raises_naming_the_argument_or_matches_the_reference(call):
    kw, fields, fault = call
    kw = dict(kw)
    try:
        config = GRPOLossConfig(**fields)
        leaves = {k: _leaf(kw.pop(k), torch.float32) for k in ("hidden", "weight", "bias") if k in kw}
        out = grpo_loss(**leaves, **kw, config=config)
    except (ValueError, TypeError) as error:
        _check_error(error, fault)
        return
    assert fault is None, f"{fault} was accepted"
    out.loss.backward()

    def reference(dtype):
        args = {k: (_float64(v).to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in call[0].items() if k != "impl"}
        ref_leaves = {k: _leaf(args.pop(k), dtype) for k in ("hidden", "weight", "bias") if k in args}
        ref = grpo_loss_reference(**ref_leaves, **args, config=config)
        ref.loss.backward()
        return ref, ref_leaves

    (pt, l_pt), (ref, l_ref) = reference(torch.float32), reference(torch.float64)
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, f"loss {fields}")
    for k, leaf in leaves.items():
        assert_close_rule(leaf.grad, l_pt[k].grad, l_ref[k].grad, torch.float32, f"d {k}")


@settings(max_examples=80, **SETTINGS)
@given(B=st.integers(1, 5), H=st.integers(0, 6), V=st.integers(0, 9), seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from([1.0, 0.5, np.float32(2.0), 0.0, -1.0, float("nan"), "1"]),
       softcap=st.sampled_from([None, 2.0, np.float64(10.0), 0.0, float("inf")]),
       device=st.sampled_from(["cpu", "cpu", "meta"]))
def test_fused_logprobs_raises_naming_the_argument_or_matches_the_reference(B, H, V, seed, temperature, softcap,
                                                                            device):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, H, generator=gen)
    weight = torch.randn(V, H, generator=gen).to(device)
    target_ids = torch.randint(0, max(V, 1), (B,), generator=gen)
    faults = []
    if H == 0:
        faults.append("hidden")
    if V == 0:
        faults.append("weight")
    if device == "meta":
        faults.append("weight")
    if not (isinstance(temperature, (int, float, np.floating)) and 0 < temperature < math.inf):
        faults.append("temperature")
    if softcap is not None and not 0 < softcap < math.inf:
        faults.append("softcap")
    try:
        out = fused_logprobs(hidden, weight, target_ids, temperature=temperature, softcap=softcap, return_entropy=True)
    except (ValueError, TypeError) as error:
        assert faults and any(name in str(error) for name in faults), (faults, error)
        return
    assert not faults, f"{faults} accepted"
    pt = logprobs_reference(hidden, weight, target_ids, None, float(temperature), softcap, True)
    ref = logprobs_reference(hidden.double(), weight.double(), target_ids, None, float(temperature), softcap, True)
    for a, b, c, name in zip(out, pt, ref, ("logps", "entropy")):
        assert_close_rule(a, b, c, torch.float32, name)


@st.composite
def advantage_calls(draw):
    """rewards ``[N]`` or ``[N, K]``: small integers times 2**e (exact in float32), e in {-100, 0, 100} so that
    the squares overflow or underflow float32 unless the statistics are scaled; NaN = no score."""
    G = draw(st.integers(1, 5))
    groups = draw(st.integers(1, 4))
    N = G * groups
    K = draw(st.sampled_from([None, 1, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    e = draw(st.sampled_from([-100, 0, 0, 100]))
    shape = (N,) if K is None else (N, K)
    r = torch.randint(-8, 9, shape, generator=gen).double() * 2.0**e
    r[torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3]))] = float("nan")
    kw = dict(scale=draw(st.sampled_from(["group", "batch", "none"])),
              eps=draw(st.sampled_from([1e-4, 0.0, np.float32(1e-6), 2.0**-10])),
              aggregation=draw(st.sampled_from(["sum_then_normalize", "normalize_then_sum"])))
    if draw(st.booleans()):
        kw["group_size"] = draw(st.sampled_from([G, np.int64(G)]))
    else:
        ids = torch.arange(N) // G * 7 - 3
        kw["group_ids"] = ids[torch.randperm(N, generator=gen)]
    if K is not None and draw(st.booleans()):
        kw["reward_weights"] = [0.5, 1.0, 2.0][:K]
    fault = draw(st.none() | st.sampled_from([
        ("eps", -1.0), ("eps", float("nan")), ("eps", "0.1"), ("scale", "median"), ("aggregation", "sum"),
        ("group_size", 0), ("group_size", N + 1), ("group_size", 1.5), ("reward_weights", [1.0] * 5),
        ("reward_weights", [float("nan")] * (K or 1)), ("group_ids", torch.zeros(N + 1, dtype=torch.long)),
        ("rewards", float("inf")), ("impl", "cuda")]))
    if fault is not None:
        name, value = fault
        if name in ("group_size", "group_ids"):
            kw.pop("group_size", None), kw.pop("group_ids", None)
        if name == "rewards":
            r = r.clone()
            r.view(-1)[0] = value
        else:
            kw[name] = value
        if name == "group_size" and value == N + 1 and N % (N + 1) == 0:
            fault = None
    return r, kw, fault and fault[0]


@settings(max_examples=200, **SETTINGS)
@given(advantage_calls(), st.sampled_from(["torch", "reference"]))
def test_group_advantages_raise_naming_the_argument_or_match_the_reference(call, impl):
    r, kw, fault = call
    try:
        out = group_advantages(r.float(), **{"impl": impl, **kw})
    except (ValueError, TypeError) as error:
        assert fault is not None and fault in str(error), (fault, error)
        return
    assert fault is None, f"{fault} accepted"
    ref_kw = {k: v for k, v in kw.items() if k != "impl"}
    pt = group_advantages(r.float(), impl="reference", **ref_kw)
    ref = group_advantages(r, impl="reference", **ref_kw)
    # means and stds are compared in units of the rewards' power-of-two magnitude (an exact division), where the
    # rule's absolute atol means what it says; advantages are scale-free already
    unit = 2.0 ** math.floor(math.log2(float(torch.nan_to_num(r.abs(), nan=0.0).max()) or 1.0))
    if kw["aggregation"] == "normalize_then_sum":
        unit = 1.0  # GDPO's statistics are of z-scores
    assert_close_rule(out.advantages, pt.advantages, ref.advantages, torch.float32, "advantages")
    for name in ("group_mean", "group_std"):
        assert_close_rule(getattr(out, name) / unit, getattr(pt, name) / unit, getattr(ref, name) / unit,
                          torch.float32, name)
    assert torch.equal(out.zero_std, ref.zero_std)
