"""grpo_loss / grpo_loss_from_logps: the torch path against the float64 TRL-exact reference, across the option grid."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from helpers import as_leaves, make_batch, make_mask, to_float64

from grpo_fast import GRPOLoss, GRPOLossConfig, LossType, grpo_loss, grpo_loss_from_logps
from grpo_fast.loss import micro_batch_scale
from grpo_fast.testing import ATOL, assert_close_rule, max_abs_err

METRICS = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")


def _config(loss_type, level="token", beta=0.0, bias_kl=False, **kw):
    # cispo: the cap on the ratio itself; dppo_tv: a bound on p - p_old, low enough to bind at these log-ratios
    eps_high = {LossType.CISPO: 5.0, LossType.DPPO_TV: 0.05}.get(LossType(loss_type), 0.28)
    if LossType(loss_type) == LossType.DRO:
        kw.setdefault("dro_beta", 0.3)
    return GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                          use_bias_correction_kl=bias_kl, epsilon=0.2, epsilon_high=eps_high, **kw)


def _levels(loss_types):
    """(loss type, level) for each type and each importance-sampling level it has."""
    return [(lt, level) for lt in loss_types for level in ("token", "sequence")
            if level == "token" or lt.allows_sequence_level]


def _logps_batch(B, T, dtype, seed, adv_per_token=False, sampling=None):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    old = (logps + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)  # log-probs: <= 0
    ref = (logps + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn((B, T) if adv_per_token else (B,), generator=gen, dtype=torch.float64)
    ratio = None
    if sampling is not None:
        ratio = torch.rand((B, T) if sampling == "token" else (B, 1), generator=gen, dtype=torch.float64) + 0.5
    mask = make_mask(B, T, gen)
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return dict(logps=cast(logps), entropy=cast(entropy), old_logps=cast(old), ref_logps=cast(ref),
                advantages=cast(adv), sampling_ratio=cast(ratio), completion_mask=mask)


def _run_from_logps(batch, config, impl, upstream, old_given=True, nitems=None):
    logps = batch["logps"].detach().clone().requires_grad_(True)
    entropy = batch["entropy"].detach().clone().requires_grad_(True)
    out = grpo_loss_from_logps(
        logps, batch["advantages"], batch["completion_mask"],
        old_logps=batch["old_logps"] if old_given else None, ref_logps=batch["ref_logps"],
        sampling_ratio=batch["sampling_ratio"], num_items_in_batch=nitems, entropy=entropy, config=config, impl=impl,
    )
    (out.loss * upstream).backward()
    return out, logps.grad, entropy.grad


LOSS_GRID = [
    (lt, level, beta_kl, delta)
    for (lt, level), beta_kl, delta in itertools.product(_levels(LossType), [(0.0, False), (0.04, False), (0.04, True)],
                                                        [None, 1.5, 1.05])
    if delta is None or lt.is_clip_family or lt.is_dppo  # delta caps the clip family's ratio and dppo's
]


@pytest.mark.parametrize("loss_type,level,beta_kl,delta", LOSS_GRID)
def test_from_logps_torch_matches_reference_float64(loss_type, level, beta_kl, delta):
    """The analytic-gradient torch path equals autograd through TRL's formulas, for every option combination."""
    beta, bias_kl = beta_kl
    upstream = 1.7
    for sampling, quantile, coef, adv_tok, old_given, nitems in itertools.product(
        [None, "token", "sequence"], [1.0, 0.3], [0.0, 0.01], [False, True], [True, False], [None, 57],
    ):
        config = _config(loss_type, level, beta, bias_kl, delta=delta, top_entropy_quantile=quantile,
                         entropy_coef=coef)
        # a seed that is the same in every process (hash() of a str or None is salted per process)
        seed = zlib.crc32(repr((sampling, quantile, coef, adv_tok)).encode()) % 1000
        batch = _logps_batch(5, 9, torch.float64, seed=seed, adv_per_token=adv_tok, sampling=sampling)
        out, g, ge = _run_from_logps(batch, config, "torch", upstream, old_given, nitems)
        ref, g_ref, ge_ref = _run_from_logps(batch, config, "reference", upstream, old_given, nitems)
        case = f"{config} sampling={sampling} adv_per_token={adv_tok} old={old_given} nitems={nitems}"
        assert_close_rule(out.loss, ref.loss, ref.loss, torch.float64, f"loss [{case}]")
        assert_close_rule(g, g_ref, g_ref, torch.float64, f"d logps [{case}]")
        if coef != 0.0:
            assert_close_rule(ge, ge_ref, ge_ref, torch.float64, f"d entropy [{case}]")
        else:
            assert ge is None and ge_ref is None
        for name in METRICS:
            a, b = getattr(out, name), getattr(ref, name)
            assert_close_rule(a, b, b, torch.float64, f"{name} [{case}]")


GRID_HIDDEN = [(lt, level, beta) for (lt, level), beta in itertools.product(_levels(LossType), [0.0, 0.04])]


@pytest.mark.parametrize("loss_type,level,beta", GRID_HIDDEN)
def test_grpo_loss_torch_matches_reference_float32(loss_type, level, beta):
    """grpo_loss end to end at T=123, V=1151: loss, metrics, d hidden, d weight, d bias under the rule."""
    config = _config(loss_type, level, beta, bias_kl=beta > 0 and level == "token", temperature=0.7)
    batch = make_batch(B=3, T=123, H=48, V=1151, seed=1, with_bias=True, sampling="token")
    upstream = 0.37

    def run(impl, dtype):
        leaves = as_leaves(batch if dtype == torch.float32 else to_float64(batch), dtype)
        out = grpo_loss(**leaves, config=config, impl=impl)
        (out.loss * upstream).backward()
        return out, leaves["hidden"].grad, leaves["weight"].grad, leaves["bias"].grad

    out, *grads = run("torch", torch.float32)
    pt, *grads_pt = run("reference", torch.float32)
    ref, *grads_ref = run("reference", torch.float64)
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, "loss")
    assert_close_rule(out.per_token_logps, pt.per_token_logps, ref.per_token_logps, torch.float32, "logps")
    for name in METRICS:
        assert_close_rule(getattr(out, name), getattr(pt, name), getattr(ref, name), torch.float32, name)
    for name, a, b, c in zip(("d hidden", "d weight", "d bias"), grads, grads_pt, grads_ref):
        assert_close_rule(a, b, c, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=1.0),
        dict(temperature=0.6, softcap=30.0),
        dict(temperature=1.5, top_entropy_quantile=0.2),
        dict(entropy_coef=0.01, top_entropy_quantile=0.5),
        dict(entropy_coef=-0.02, temperature=0.9),
    ],
    ids=["plain", "temp0.6-softcap30", "temp1.5-top-entropy", "entropy-bonus+mask", "entropy-penalty"],
)
def test_grpo_loss_options_and_dtypes(dtype, options):
    """Sampling ratios, bias, per-token advantages, entropy masking/bonus, temperature and softcap in each dtype."""
    config = GRPOLossConfig(loss_type="grpo", beta=0.02, **options)
    batch = make_batch(B=3, T=37, H=40, V=515, seed=2, with_bias=True, sampling="sequence", adv_per_token=True)
    upstream = 1.3

    def run(impl, dtype_):
        leaves = as_leaves(batch if dtype_ != torch.float64 else to_float64(batch), dtype_)
        out = grpo_loss(**leaves, config=config, impl=impl)
        (out.loss * upstream).backward()
        return out, leaves["hidden"].grad, leaves["weight"].grad, leaves["bias"].grad

    out, *grads = run("torch", dtype)
    pt, *grads_pt = run("reference", dtype)
    ref, *grads_ref = run("reference", torch.float64)
    assert_close_rule(out.loss, pt.loss, ref.loss, dtype, "loss")
    for name in METRICS:
        assert_close_rule(getattr(out, name), getattr(pt, name), getattr(ref, name), dtype, name)
    for name, a, b, c in zip(("d hidden", "d weight", "d bias"), grads, grads_pt, grads_ref):
        assert a.dtype == dtype
        assert_close_rule(a, b, c, dtype, name)


@pytest.mark.parametrize("loss_type", [lt for lt in LossType if lt.divides_by_num_items])
def test_micro_batches_with_num_items_give_the_large_batch_gradient(loss_type):
    """dapo and the other types divided by num_items_in_batch: k micro-batches normalised by the global token count
    sum to the gradient of one large batch (micro_batch_scale 1)."""
    assert micro_batch_scale(loss_type, 0.25, 0.5) == 1.0
    config = _config(loss_type, beta=0.04)
    batch = make_batch(B=6, T=31, H=24, V=211, seed=3, dtype=torch.float64)
    leaves = as_leaves(batch, torch.float64, names=("weight",))
    whole = grpo_loss(**leaves, config=config, impl="torch")
    whole.loss.backward()
    g_whole = leaves["weight"].grad.clone()
    leaves["weight"].grad = None
    n_items = batch["completion_mask"].sum()
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 and k not in ("weight", "bias") else v)
                for k, v in leaves.items()}
        out = grpo_loss(**part, config=config, num_items_in_batch=n_items, impl="torch")
        out.loss.backward()
        total = total + out.loss.detach()
    assert_close_rule(total, whole.loss, whole.loss, torch.float64, "summed micro-batch loss")
    assert_close_rule(leaves["weight"].grad, g_whole, g_whole, torch.float64, "accumulated d weight")


@pytest.mark.parametrize("extreme", ["policy_ratio", "ref_ratio"])
@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("grpo", "sequence")]
                         + [(lt.value, "token") for lt in LossType if not lt.in_trl])
def test_extreme_log_ratios_and_padding_garbage(extreme, loss_type, level):
    """log-ratios of +-50 (policy/old or ref/policy), garbage at padding, all-masked rows: the loss, metrics and
    gradients equal the reference's on the same batch with clean padding (exp(50) ~ 5e21 is finite in float32)."""
    config = _config(loss_type, level, beta=0.1, bias_kl=True)
    batch = make_batch(B=4, T=17, H=16, V=97, seed=4)
    # a sink token of bias 60 (never a target) puts every target's log-prob near -60: logp + 50 is still a log-prob
    batch["weight"] = torch.cat([batch["weight"], torch.zeros(1, 16)])
    batch["bias"] = torch.cat([torch.zeros(97), torch.tensor([60.0])])
    mask = batch["completion_mask"]
    logps = grpo_loss(**batch, config=GRPOLossConfig(), impl="reference").per_token_logps
    assert logps.max() < -50.1
    sign = torch.where(torch.arange(17) % 2 == 1, 1.0, -1.0)
    far = logps + 50.0 * sign
    near = logps + 0.1 * sign
    old, ref = (far, near) if extreme == "policy_ratio" else (near, far)
    batch["old_logps"], batch["ref_logps"] = old, ref
    garbage = dict(batch, old_logps=torch.where(mask, old, 1e30),  # exp(logp - old) underflows at padding
                   ref_logps=torch.where(mask, ref, 1e30))  # exp(ref - logp) overflows at padding

    def run(inputs, impl, dtype):
        leaves = as_leaves(inputs if dtype == torch.float32 else to_float64(inputs), dtype)
        out = grpo_loss(**leaves, config=config, impl=impl)
        (out.loss * 0.37).backward()
        return out, leaves["hidden"].grad, leaves["weight"].grad

    out, *grads = run(garbage, "torch", torch.float32)
    pt, *grads_pt = run(batch, "reference", torch.float32)
    ref, *grads_ref = run(batch, "reference", torch.float64)
    assert_close_rule(out.loss, pt.loss, ref.loss, torch.float32, "loss")
    for name in METRICS:
        assert_close_rule(getattr(out, name), getattr(pt, name), getattr(ref, name), torch.float32, name)
    for name, a, b, c in zip(("d hidden", "d weight"), grads, grads_pt, grads_ref):
        assert_close_rule(a, b, c, torch.float32, name)


def test_result_does_not_depend_on_chunk_size(monkeypatch):
    """The loss and gradients from the chunked path are the same for any vocab/token chunking."""
    import grpo_fast.logprobs as lp

    config = GRPOLossConfig(loss_type="bnpo", beta=0.04, temperature=0.8)
    batch = make_batch(B=2, T=45, H=32, V=1151, seed=5, dtype=torch.float64)
    results = []
    original = lp.LogprobParams
    for vocab_chunk, token_chunk in ((1151, 90), (128, 7), (1000, 1), (37, 45)):
        monkeypatch.setattr(lp, "LogprobParams",
                            lambda **kw: original(vocab_chunk=vocab_chunk, token_chunk=token_chunk, **kw))
        leaves = as_leaves(batch, torch.float64)
        out = grpo_loss(**leaves, config=config, impl="torch")
        out.loss.backward()
        results.append((out.loss.detach(), leaves["hidden"].grad, leaves["weight"].grad))
    for loss, gh, gw in results[1:]:
        assert max_abs_err(loss, results[0][0]) <= ATOL[torch.float64]
        assert max_abs_err(gh, results[0][1]) <= ATOL[torch.float64]
        assert max_abs_err(gw, results[0][2]) <= ATOL[torch.float64]


def test_module_matches_functional():
    config = GRPOLossConfig(loss_type="sapo")
    batch = make_batch(B=2, T=11, H=16, V=53, seed=6)
    module = GRPOLoss(config, impl="torch")
    a = module(**batch)
    b = grpo_loss(**batch, config=config, impl="torch")
    assert torch.equal(a.loss, b.loss)
    assert "sapo" in repr(module)


def test_metrics_none_where_undefined():
    batch = make_batch(B=2, T=11, H=16, V=53, seed=7)
    config = GRPOLossConfig(loss_type="sapo")
    out = grpo_loss(**batch, config=config)
    assert out.kl is None and out.clip_ratio_low is None and out.clip_ratio_high is None
    pt = grpo_loss(**batch, config=config, impl="reference")
    ref = grpo_loss(**to_float64(batch), config=config, impl="reference")
    assert_close_rule(out.entropy, pt.entropy, ref.entropy, torch.float32, "entropy")
    out = grpo_loss(**batch, config=GRPOLossConfig(loss_type="cispo", beta=0.1))
    assert out.kl is not None and out.clip_ratio_high is not None and out.clip_ratio_low is None
    for loss_type in LossType:  # what each type defines, on every path
        for impl in ("torch", "reference"):
            out = grpo_loss(**batch, config=_config(loss_type), impl=impl)
            present = tuple(getattr(out, f"clip_ratio_{k}") is not None for k in ("low", "high", "region"))
            assert present == loss_type.clip_metrics, (loss_type, impl)
    assert LossType.DPPO_TV.clip_metrics == (True, True, True) and LossType.GPG.clip_metrics == (False,) * 3


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_metrics_and_logps_are_detached(impl):
    """LossOutput's contract: only ``loss`` carries autograd history (a caller may float() the rest freely)."""
    batch = as_leaves(make_batch(B=2, T=5, H=8, V=17, seed=8), torch.float32)
    out = grpo_loss(**batch, config=GRPOLossConfig(loss_type="dapo", beta=0.1, entropy_coef=0.01), impl=impl)
    assert out.loss.requires_grad
    for name, value in out._asdict().items():
        if name != "loss" and value is not None:
            assert not value.requires_grad, name
