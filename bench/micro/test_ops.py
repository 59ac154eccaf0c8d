"""Microbenchmarks of the three ops, with pytest-benchmark: every implementation of one op side by side.

    pytest bench/micro --benchmark-only --benchmark-group-by=group          # time them (docs/benchmarks.md)
    pytest bench/micro --benchmark-disable -k small                        # only the correctness checks, fast

Ops (one benchmark group per op, loss variant and size): ``fused_logprobs`` forward (under ``no_grad``, as the old
and reference passes run) and forward + backward (a random upstream gradient into hidden and weight), ``grpo_loss``
forward + backward for DAPO with beta 0.04 against reference log-probs and for GRPO with beta 0, and
``group_advantages`` (two reward functions, some NaN scores). Implementations: ``reference`` (materialised logits),
``torch`` (the chunked path), ``liger`` (Liger-Kernel: ``LigerFusedLinearGRPOLoss``, eager, for the loss; its fused
linear cross-entropy with ``reduction="none"`` for the log-probs, which is Triton-only and so CUDA-only) and
``triton``; an implementation that cannot run here (no CUDA, liger-kernel not installed) is skipped with the reason.

Every benchmark first checks the implementation's outputs (and gradients) against the float64 reference with the
rule of ``grpo_fast.testing`` (``err <= 2 * err(reference at the same dtype) + atol``); that call is also the
warm-up. Shapes are registry models' (``bench.models``) H and V, scaled down on CPU (float32) so that the whole file
takes under a minute of CPU time; on CUDA, in bf16, the real widths.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.models import get_model
from grpo_fast import GRPOLossConfig, fused_logprobs, group_advantages, grpo_loss
from grpo_fast.benchmarking import synchronize
from grpo_fast.dtypes import SHORT_DTYPES
from grpo_fast.testing import assert_close_rule, loss_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = {"cpu": "fp32", "cuda": "bf16"}[DEVICE]
# size -> (registry model, divisor of its H and V, sequences, completion tokens per sequence)
SIZES = {
    "cpu": {"small": ("qwen2.5-0.5b", 16, 4, 32), "large": ("qwen2.5-7b", 16, 8, 128)},
    "cuda": {"small": ("qwen2.5-0.5b", 1, 8, 256), "large": ("qwen2.5-1.5b", 1, 8, 1024)},
}[DEVICE]
# size -> (prompts, group size) for group_advantages
ADVANTAGE_SIZES = {"small": (64, 8), "large": (512, 16)}
LOSSES = {
    "dapo_beta": GRPOLossConfig(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28),
    "grpo": GRPOLossConfig(loss_type="grpo", beta=0.0, epsilon=0.2),
}
IMPLS = ("reference", "torch", "liger", "triton")
SEED = 0


def _runnable(impl: str, op: str) -> None:
    """Skip, with the reason, an implementation that cannot run on this machine."""
    if impl == "triton" and DEVICE != "cuda":
        pytest.skip("triton: needs a CUDA device")
    if impl == "liger":
        if op == "group_advantages":
            pytest.skip("liger: Liger-Kernel has no group-advantage op")
        pytest.importorskip("liger_kernel", reason="liger: pip install 'grpo-fast[bench]'")
        if op == "fused_logprobs" and DEVICE != "cuda":
            pytest.skip("liger: its fused linear cross-entropy is Triton-only (CUDA)")


def _sync(fn):
    """``fn`` followed by a device synchronisation, so the timer sees the kernels' time, not their launch."""
    if DEVICE != "cuda":
        return fn

    def synced():
        out = fn()
        synchronize(DEVICE)
        return out

    return synced


@pytest.fixture(scope="module", params=("small", "large"))
def size(request):
    return request.param


@pytest.fixture(scope="module")
def inputs(size):
    """Seeded loss-head inputs of ``size`` (``grpo_fast.testing.loss_inputs``, as ``bench.bench_loss`` draws them,
    completions at least half of T): hidden ``[B, T, H]``, weight ``[V, H]`` (requires_grad), target_ids,
    completion_mask, advantages ``[B]``, ref_logps ``[B, T]``, plus ``grad_logps``: an upstream gradient ``[B, T]``,
    and the size's name."""
    model, div, batch, seq = SIZES[size]
    shape = get_model(model)
    x = loss_inputs(batch, seq, shape.hidden_size // div, shape.vocab_size // div, seed=SEED, device=DEVICE,
                    dtype=SHORT_DTYPES[DTYPE], min_length=math.ceil(0.5 * seq), mask_dtype=torch.int64,
                    requires_grad=True)
    g = torch.Generator(device=DEVICE).manual_seed(SEED + 1)
    x["grad_logps"] = torch.randn(batch, seq, generator=g, device=DEVICE)
    x["size"] = size
    return x


def _double(x: dict) -> dict:
    """The same inputs in float64 (hidden and weight as leaves that require grad), for the oracle."""
    out = {k: (v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
    for name in ("hidden", "weight"):
        if name in out:
            out[name].requires_grad_(True)
    return out


def _grads(out: torch.Tensor, x: dict, grad_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.autograd.grad(out, (x["hidden"], x["weight"]), grad_out)


_REFERENCES: dict = {}  # (benchmark, size) -> the reference's outputs at the dtype and in float64


def _check(impl: str, run, names: tuple[str, ...], x: dict, dtype: torch.dtype, key: str) -> None:
    """``run(x, impl)`` -> a tuple of tensors named ``names``; ``impl``'s tuple at ``dtype`` against the float64
    reference's, under the one tolerance rule (the reference at ``dtype`` sets the bound). ``key`` names the benchmark
    (and its options) so that the two reference runs are made once for all implementations."""
    if (key, x["size"]) not in _REFERENCES:
        _REFERENCES[key, x["size"]] = run(x, "reference"), run(_double(x), "reference")
    out_pt, out_ref = _REFERENCES[key, x["size"]]
    out = run(x, impl)
    for name, o, o_pt, o_ref in zip(names, out, out_pt, out_ref, strict=True):
        assert_close_rule(o, o_pt, o_ref, dtype, name=f"{key}, {impl}: {name}")


# ------------------------------------------------------------------------------------------------- fused_logprobs
def _liger_logprobs(x: dict) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = x["hidden"].reshape(-1, x["hidden"].shape[-1])
    nll = liger_fused_linear_cross_entropy(h, x["weight"], x["target_ids"].reshape(-1), reduction="none")
    return -nll.float().reshape(x["target_ids"].shape)


def _logprobs(x: dict, impl: str) -> torch.Tensor:
    if impl == "liger":
        return _liger_logprobs(x)
    return fused_logprobs(x["hidden"], x["weight"], x["target_ids"], impl=impl)


def _logprobs_forward(x: dict, impl: str) -> tuple[torch.Tensor]:
    with torch.no_grad():
        return (_logprobs(x, impl),)


def _logprobs_forward_backward(x: dict, impl: str) -> tuple[torch.Tensor, ...]:
    logps = _logprobs(x, impl)
    return (logps.detach(), *_grads(logps, x, x["grad_logps"].to(logps.dtype)))


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_logprobs_forward(benchmark, impl, size, inputs):
    _runnable(impl, "fused_logprobs")
    benchmark.group = f"fused_logprobs forward, {size}"
    benchmark.extra_info.update(_shape_info(inputs))
    _check(impl, _logprobs_forward, ("logps",), inputs, inputs["hidden"].dtype, "fused_logprobs forward")
    benchmark(_sync(lambda: _logprobs_forward(inputs, impl)))


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_logprobs_forward_backward(benchmark, impl, size, inputs):
    _runnable(impl, "fused_logprobs")
    benchmark.group = f"fused_logprobs forward+backward, {size}"
    benchmark.extra_info.update(_shape_info(inputs))
    _check(impl, _logprobs_forward_backward, ("logps", "d_hidden", "d_weight"), inputs, inputs["hidden"].dtype,
           "fused_logprobs forward+backward")
    benchmark(_sync(lambda: _logprobs_forward_backward(inputs, impl)))


# ------------------------------------------------------------------------------------------------------ grpo_loss
def _liger_loss(x: dict, config: GRPOLossConfig) -> torch.Tensor:
    from grpo_fast.benchmarking import liger_loss

    liger = liger_loss(config)
    loss, _metrics = liger(x["hidden"], x["weight"], x["target_ids"], x["completion_mask"], x["advantages"],
                           ref_per_token_logps=x["ref_logps"] if config.beta != 0.0 else None)
    return loss


def _loss_runner(config: GRPOLossConfig):
    def run(x: dict, impl: str) -> tuple[torch.Tensor, ...]:
        if impl == "liger":
            loss = _liger_loss(x, config)
        else:
            ref = x["ref_logps"] if config.beta != 0.0 else None
            loss = grpo_loss(x["hidden"], x["weight"], x["target_ids"], x["advantages"], x["completion_mask"],
                             ref_logps=ref, config=config, impl=impl).loss
        return (loss.detach(), *_grads(loss, x))

    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss", tuple(LOSSES))
def test_grpo_loss_forward_backward(benchmark, impl, loss, size, inputs):
    _runnable(impl, "grpo_loss")
    benchmark.group = f"grpo_loss {loss} forward+backward, {size}"
    benchmark.extra_info.update(_shape_info(inputs), loss=LOSSES[loss].to_json())
    run = _loss_runner(LOSSES[loss])
    _check(impl, run, ("loss", "d_hidden", "d_weight"), inputs, inputs["hidden"].dtype, f"grpo_loss {loss}")
    benchmark(_sync(lambda: run(inputs, impl)))


# ----------------------------------------------------------------------------------------------- group_advantages
def _rewards(size: str) -> dict:
    """``[N, 2]`` float32 scores of two reward functions (about 5% NaN: no score) in contiguous groups."""
    prompts, group = ADVANTAGE_SIZES[size]
    g = torch.Generator(device=DEVICE).manual_seed(SEED)
    rewards = torch.rand(prompts * group, 2, generator=g, device=DEVICE).round(decimals=1)
    rewards[torch.rand(prompts * group, generator=g, device=DEVICE) < 0.05, 1] = math.nan
    return {"rewards": rewards, "group_size": group, "size": size}


def _advantages(x: dict, impl: str) -> tuple[torch.Tensor, ...]:
    out = group_advantages(x["rewards"], group_size=x["group_size"], reward_weights=[1.0, 0.5], impl=impl)
    return out.advantages, out.group_mean, out.group_std, out.zero_std.double()


@pytest.mark.parametrize("impl", IMPLS)
def test_group_advantages(benchmark, impl, size):
    _runnable(impl, "group_advantages")
    x = _rewards(size)
    benchmark.group = f"group_advantages, {size}"
    benchmark.extra_info.update(rows=x["rewards"].shape[0], group_size=x["group_size"], device=DEVICE)
    _check(impl, _advantages, ("advantages", "group_mean", "group_std", "zero_std"), x, x["rewards"].dtype,
           "group_advantages")
    benchmark(_sync(lambda: _advantages(x, impl)))


def _shape_info(x: dict) -> dict:
    b, t, h = x["hidden"].shape
    return dict(batch=b, seq=t, hidden=h, vocab=x["weight"].shape[0], dtype=str(x["hidden"].dtype), device=DEVICE)
