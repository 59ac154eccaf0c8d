"""GPU-only behaviour checked on the CPU (docs/design.md §10): which path ``auto`` picks, the device guard, launches
as data, no all-zero entropy gradient, CUDA-graph tags, and the log-prob kernel with scalars rounded as hardware
passes them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers import as_leaves, make_batch

import grpo_fast.ops as ops
from grpo_fast import GRPOLossConfig, fused_logprobs, grpo_loss
from grpo_fast.dispatch import auto_impl, resolve_impl, triton_interpreting
from grpo_fast.testing import assert_close_rule

CUDA = torch.device("cuda")
interpreted = pytest.mark.skipif(not triton_interpreting(), reason="runs the Triton kernels in the interpreter")


@pytest.fixture(autouse=True)
def an_h100(monkeypatch):
    """``cuda`` devices in these tests are an sm_90 GPU (there is none here: resolve_impl only reads its kind)."""
    import grpo_fast.dispatch as dispatch

    monkeypatch.setattr(dispatch, "device_target", lambda index: ("cuda", 90, "NVIDIA H100"))
    monkeypatch.setattr(dispatch, "fp32_accumulating_gemm", lambda index: True)  # a torch >= 2.8 there


@pytest.fixture
def strict_fp32():
    """PyTorch's default: no TF32 for float32 matmuls (set and restored through torch's own setter)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize("op", ["fused_logprobs", "grpo_loss"])
def test_auto_keeps_fp32_matmul_ops_on_the_kernels_whose_gemms_follow_tf32(monkeypatch, strict_fp32, op):
    """The log-prob path's matmuls are cuBLAS GEMMs (exact fp32 unless the user allowed TF32, like any of their
    float32 matmuls): float32 stays on it; float64 goes to the torch path (statistics in float32 there)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_impl("auto", CUDA, op, dtype) == "triton"
    assert resolve_impl("auto", CUDA, op, torch.float64) == "torch"
    assert "float64" in auto_impl(CUDA, op, torch.float64)[1]
    with pytest.raises(ValueError, match="float64"):
        resolve_impl("triton", CUDA, op, torch.float64)


def test_a_torch_without_fp32_accumulating_gemms_keeps_16bit_matmul_ops_off_the_kernels(monkeypatch):
    """The Triton log-prob path accumulates d hidden with torch.addmm(..., out_dtype=torch.float32) (torch >= 2.8):
    where the probe finds it missing, auto says why and runs the torch path, and an explicit impl='triton' refuses
    (no silent fallback that would copy operands to fp32)."""
    import grpo_fast.dispatch as dispatch

    monkeypatch.setattr(dispatch, "fp32_accumulating_gemm", lambda index: False)
    for op in ("fused_logprobs", "grpo_loss"):
        impl, why = auto_impl(CUDA, op, torch.bfloat16)
        assert impl == "torch" and "out_dtype" in why
        with pytest.raises(RuntimeError, match="impl='torch'"):
            resolve_impl("triton", CUDA, op, torch.bfloat16)
        assert resolve_impl("auto", CUDA, op, torch.float32) == "triton"  # fp32 GEMMs need no out_dtype
    assert resolve_impl("auto", CUDA, "grpo_loss_from_logps", torch.bfloat16) == "triton"  # no matmul


@pytest.mark.gpu
def test_fp32_accumulating_gemm_into_an_aliased_accumulator_on_gpu():
    """The d-hidden GEMM as the Plan issues it: bf16 operands accumulated into an fp32 matrix that is also the
    output (and a view into another tensor's bytes, as the split accumulator is), against float64."""
    from grpo_fast.dispatch import fp32_accumulating_gemm
    from grpo_fast.kernels.plan import Plan

    assert fp32_accumulating_gemm(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(96, 320, device="cuda", generator=gen).bfloat16()
    b = torch.randn(320, 48, device="cuda", generator=gen).bfloat16()
    host = torch.zeros(2 * 96 * 48 + 8, dtype=torch.bfloat16, device="cuda")
    acc = host[8:].view(torch.float32).view(96, 48)  # fp32 rows inside bf16 storage, 16-byte aligned
    acc.fill_(0.5)
    plan = Plan()
    plan.gemm("d hidden", a, b, acc, accumulate=True)
    plan.gemm("d hidden", a, b, acc, accumulate=True)
    want = 0.5 + 2 * (a.double() @ b.double())
    assert (acc.double() - want).abs().max() < 1e-3 * want.abs().max()


def test_auto_keeps_elementwise_ops_on_triton_in_fp32(strict_fp32):
    """The loss on given log-probs and the advantages have no matmul: fp32 and fp64 stay on their kernels, which
    compute in the inputs' dtype."""
    for op in ("grpo_loss_from_logps", "group_advantages"):
        for dtype in (torch.float32, torch.float64):
            assert resolve_impl("auto", CUDA, op, dtype) == "triton"
    assert resolve_impl("auto", torch.device("cpu"), "grpo_loss", torch.bfloat16) == "torch"


@pytest.mark.parametrize("backend,arch,family", [("cuda", 80, "sm80"), ("cuda", 87, "sm86"), ("cuda", 103, "sm100"),
                                                  ("cuda", 121, "sm120"), ("hip", "gfx942", "cdna"),
                                                  ("cuda", 75, None), ("cuda", 70, None), ("hip", "gfx1100", None),
                                                  ("hip", "gfx950", None)])
def test_auto_uses_the_kernels_only_on_gated_gpus(monkeypatch, backend, arch, family):
    """sm_70/75 (no bf16 tensor-core MMA, 64 KiB shared) and AMD other than CDNA2/3 were never compiled by the
    static gate: auto runs the torch path there and says why."""
    import grpo_fast.dispatch as dispatch

    monkeypatch.setattr(dispatch, "device_target", lambda index: (backend, arch, "some GPU"))
    assert dispatch.family_of(backend, arch) == family
    impl, why = auto_impl(CUDA, "grpo_loss", torch.bfloat16)
    assert impl == ("triton" if family else "torch")
    if family is None:
        assert "not a target the kernels are compiled and gated for" in why


def test_tf32_switches_old_and_new(monkeypatch):
    """torch >= 2.9's fp32_precision API and the legacy flags: reading the legacy flag after the new API was used
    raises in torch, so tf32_allowed reads the new one first (and never raises)."""
    from grpo_fast.dispatch import tf32_allowed

    matmul = torch.backends.cuda.matmul
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert tf32_allowed() is True
        matmul.fp32_precision = "ieee"
        assert tf32_allowed() is False
        matmul.fp32_precision = "tf32"
        assert resolve_impl("auto", CUDA, "fused_logprobs", torch.float32) == "triton"
    finally:
        matmul.fp32_precision = saved


def test_launch_runs_on_the_device_of_its_tensors(monkeypatch):
    """A tensor on cuda:1 launches on cuda:1 whatever the current device (the guard wraps the launch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo_fast.kernels import launch as launch_mod

    entered, launched = [], []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(torch.device(device))
        yield

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, entered[-1] if entered else None, kw))

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    with FakeTensorMode():
        x = torch.empty(4, device="cuda:1")
    launch_mod.launch(Kernel(), (3,), x, 1.0, num_warps=8, num_stages=3, BLOCK=64)
    assert entered == [torch.device("cuda:1")]
    assert launched == [((3,), torch.device("cuda:1"), dict(num_warps=8, num_stages=3, BLOCK=64))]


def test_launchers_are_data_under_capture():
    """Inside ``capture`` the log-prob launchers record their launches (nothing runs) with the configuration the
    target's table gives and the column split the target's SM count asks for, so the static gate compiles what a
    launch would run and the cost model prices it."""
    from grpo_fast.kernels.launch import Target, capture
    from grpo_fast.kernels.linear_logprobs import CONFIGS, forward
    from grpo_fast.kernels.plan import Plan
    from grpo_fast.logprob_contract import LogprobParams

    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    for target, family, sms in ((Target("cuda", 90, 32), "sm90", 132), (Target("hip", "gfx942", 64), "cdna", 304)):
        plan = Plan()
        with capture(target, sms=sms) as launches:
            forward(meta(1000, 4096), meta(32000, 4096), meta(1000, dtype=torch.int64), None,
                    LogprobParams(return_entropy=True), plan=plan)
        stats, final = launches  # one vocabulary chunk (32000 x 1000 bf16 fits 64 MiB) and the merge
        cfg = CONFIGS[(family, "small")]
        row_blocks = -(-1000 // cfg.block_n)
        assert stats.grid == (row_blocks, -(-2 * sms // row_blocks)) and stats.num_warps == cfg.num_warps
        assert stats.constexprs["BLOCK_C"] == cfg.block_c and stats.name.endswith(":_chunk_stats")
        assert final.grid == (row_blocks,) and final.name.endswith(":_stats_finalize")
        assert [s.kind for s in plan.steps] == ["gemm", "triton", "triton"]
        assert plan.steps[0].flops == 2 * 1000 * 4096 * 32000


def _record_logprob_backward(monkeypatch):
    calls = []
    real = ops.logprobs_bwd

    def spy(*args):
        calls.append(dict(g=args[7], ge=args[8]))
        return real(*args)

    monkeypatch.setattr(ops, "logprobs_bwd", spy)
    return calls


def test_unused_entropy_sends_no_entropy_gradient(monkeypatch):
    """An entropy that was returned but not differentiated reaches the backward as None, not as zeros (which would
    select the entropy-gradient kernel variant and its extra work for nothing)."""
    calls = _record_logprob_backward(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(33, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 33, (7,), generator=gen)
    logps, ent = fused_logprobs(hidden, weight, targets, return_entropy=True, impl="torch")
    logps.sum().backward()
    assert calls[-1]["ge"] is None and calls[-1]["g"] is not None

    batch = make_batch(B=2, T=9, H=16, V=33, seed=1)
    for coef, want_ge in ((0.0, False), (0.01, True)):
        leaves = as_leaves({k: v for k, v in batch.items() if k not in ("bias", "sampling_ratio")}, torch.float32)
        config = GRPOLossConfig(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=coef)
        grpo_loss(**leaves, config=config, impl="torch").loss.backward()
        assert (calls[-1]["ge"] is not None) == want_ge, coef
        if want_ge:
            assert calls[-1]["ge"].abs().sum() > 0


def test_host_syncing_ops_are_kept_out_of_cuda_graphs():
    """The ops with host syncs carry ``cudagraph_unsafe``, which Inductor reads to run them outside the graphs that
    ``mode="reduce-overhead"`` captures; the forward op has no sync and no tag."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    graph = torch.fx.Graph()
    for op, unsafe in ((torch.ops.grpo_fast.logprobs_bwd.default, True),
                       (torch.ops.grpo_fast.loss_terms.default, True),
                       (torch.ops.grpo_fast.logprobs_fwd.default, False)):
        assert (torch.Tag.cudagraph_unsafe in op.tags) == unsafe, op
        node = graph.call_function(op, ())
        assert is_cudagraph_unsafe_fx_node(node) == unsafe, op


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logprob_kernels_with_scalars_rounded_as_hardware_passes_them(monkeypatch, dtype):
    """On a GPU a Python float argument reaches the kernel as fp32 (the interpreter passes a double): rerun the
    forward and backward kernels with every float argument rounded through float32 and hold the result to the rule."""
    import grpo_fast.kernels.plan as plan_module

    real = plan_module.launch
    rounded = []

    def fp32_scalars(kernel, grid, *args, **kw):
        args = tuple(float(np.float32(a)) if isinstance(a, float) else a for a in args)
        rounded.extend(a for a in args if isinstance(a, float))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(plan_module, "launch", fp32_scalars)
    gen = torch.Generator().manual_seed(5)
    n, h, v = 29, 48, 1151
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=gen)
    g, ge = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))

    def run(impl, dtype_):
        h_, w_, b_ = (x.to(dtype_).requires_grad_(True) for x in (hidden, weight, bias))
        logps, ent = fused_logprobs(h_, w_, targets, bias=b_, temperature=0.7, softcap=3.3, return_entropy=True,
                                    impl=impl)
        ((logps * g.to(logps.dtype)).sum() + (ent * ge.to(ent.dtype)).sum()).backward()
        return logps, ent, h_.grad, w_.grad, b_.grad

    out = run("triton", dtype)
    assert float(np.float32(1 / 0.7)) in rounded and float(np.float32(1 / 0.7)) != 1 / 0.7  # really rounded
    pt, ref = run("reference", dtype), run("reference", torch.float64)
    for name, a, b, c in zip(("logps", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
        assert_close_rule(a, b, c, dtype, name)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_terms_capture_in_a_cuda_graph(loss_type):
    """The loss op on given log-probs captures in a CUDA graph and replays to the eager result (no host sync, no
    host-to-device copy inside): once this has passed on a GPU, loss_terms can drop its cudagraph_unsafe tag."""
    from grpo_fast import grpo_loss_from_logps

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T = 4, 37
    logps = -torch.rand(B, T, device="cuda", generator=gen)
    config = GRPOLossConfig(loss_type=loss_type, beta=0.04, top_entropy_quantile=0.5)
    old, ref, ent = (logps + 0.01).clamp(max=0.0), logps - 0.02, torch.rand(B, T, device="cuda", generator=gen)
    adv = torch.randn(B, device="cuda", generator=gen)
    mask = torch.rand(B, T, device="cuda", generator=gen) > 0.2
    want = grpo_loss_from_logps(logps, adv, mask, old_logps=old, ref_logps=ref, entropy=ent, config=config).loss
    args = (logps, ent, adv.unsqueeze(1), mask, old, ref, None, None, config.to_json(), "triton")
    torch.ops.grpo_fast.loss_terms(*args)  # compile the kernel before capture
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        got = torch.ops.grpo_fast.loss_terms(*args)[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(got, want)
