"""The GPU-shaped log-prob launchers (kernels/linear_logprobs.py) at small temporaries budgets, where every layout
the backward can take is reached at test sizes: vocabulary chunks in grad_weight's free rows, budget-sized chunks,
the fp32 d-hidden accumulator split between grad_hidden's bytes and grad_weight's tail (recomputed at the end),
gathered active rows, column splits in the forward. Numerics follow the reference rule; on CPU the kernels run
under TRITON_INTERPRET=1 (no tl.dot in them: bf16 is exact in the interpreter). The layouts' own invariants, as pure
functions of sizes: tests/test_logprob_layout.py."""

from __future__ import annotations

import pytest
import torch

from grpo_fast import fused_logprobs
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.kernels import linear_logprobs as ll
from grpo_fast.kernels.launch import Target, capture
from grpo_fast.kernels.logprob_layout import DEFAULT_SCRATCH_BYTES, AccHome, backward_layout
from grpo_fast.kernels.plan import Plan
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats
from grpo_fast.testing import assert_close_rule, head_inputs, upstream_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(),
                                   reason="Triton needs CUDA or TRITON_INTERPRET=1")
N, H, V = 61, 48, 1151
TIGHT_KIB = 12  # the fp32 accumulator is over half of it at these sizes: it goes to the gradients' storage


def _case(seed, inactive):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, bias, targets = head_inputs((N,), H, V, gen, draw_dtype=torch.float64, bias_scale=0.3)
    # inactive: padding, rows with no upstream gradient at all, and rows with only one of the two
    rows = dict(dead=torch.randperm(N, generator=gen)[: N // 3].tolist(), no_logp_grad=[1, 2],
                no_entropy_grad=[3, 4]) if inactive else {}
    g, ge = upstream_grads(N, gen, **rows)
    return hidden, weight, bias, targets, g, ge


def _run(impl, dtype, case, need=("hidden", "weight", "bias")):
    hidden, weight, bias, targets, g, ge = case
    leaves = {k: x.to(dtype).to(DEVICE).requires_grad_(k in need)
              for k, x in (("hidden", hidden), ("weight", weight), ("bias", bias))}
    logps, ent = fused_logprobs(leaves["hidden"], leaves["weight"], targets.to(DEVICE), bias=leaves["bias"],
                                temperature=0.7, softcap=3.3, return_entropy=True, impl=impl)
    if need:
        ((logps * g.to(DEVICE, logps.dtype)).sum() + (ent * ge.to(DEVICE, ent.dtype)).sum()).backward()
    return [logps, ent] + [leaves[k].grad for k in ("hidden", "weight", "bias")]


def _layout(dtype, case, need):
    """The vocabulary walk the launcher takes for ``case`` at the tight budget (targets, m, log s, entropy, g and
    ge: 28 bytes a gathered row)."""
    _, _, _, _, g, ge = case
    a = int(((g != 0) | (ge != 0)).sum())
    elem = torch.tensor([], dtype=dtype).element_size()
    return backward_layout(N, a, H, V, elem, TIGHT_KIB * 1024, gathered=a < N, need_hidden="hidden" in need,
                           need_weight="weight" in need, vector_bytes=28).walk


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inactive", [False, True], ids=["all-rows", "gathered"])
@pytest.mark.parametrize("need", [("hidden", "weight", "bias"), ("hidden",), ("hidden", "bias"), ("weight",)],
                         ids="+".join)
def test_every_layout_against_the_reference(monkeypatch, dtype, inactive, need):
    """Log-probs, entropy and every requested gradient at a 12 KiB budget, held to the reference rule; the case
    really takes the layout it is meant to (checked on the layout itself)."""
    case = _case(7, inactive)
    layout = _layout(dtype, case, need)
    if "weight" in need:  # chunks in grad_weight's rows and budget chunks both occur
        assert {chunk.in_grad_weight for chunk in layout.chunks} == {True, False}, layout
    if "hidden" in need and "weight" in need and not (dtype == torch.float32 and not inactive):
        assert AccHome.GRAD_WEIGHT in {p.home for p in layout.acc} and layout.tail > 0 and layout.recompute, layout
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", str(TIGHT_KIB / 1024))
    out = _run("triton", dtype, case, need)
    pt, ref = _run("reference", dtype, case, need), _run("reference", torch.float64, case, need)
    for name, a, b, c in zip(("logps", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
        assert_close_rule(a, b, c, dtype, name)
    if inactive and "hidden" in need:
        dead = ((case[4] == 0) & (case[5] == 0)).to(DEVICE)
        assert (out[2][dead] == 0).all()  # gathered away: exactly zero, not stale rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inactive", [False, True], ids=["all-rows", "gathered"])
def test_every_layout_on_the_gpu(monkeypatch, dtype, inactive):
    """The same on CUDA, where the accumulation runs as cuBLAS's fp32-output GEMM into views of the gradients' own
    bytes (the CPU runs upcast copies instead): what bench/gpu_check.sh runs of the backward's layouts."""
    test_every_layout_against_the_reference(monkeypatch, dtype, inactive, ("hidden", "weight", "bias"))


@needs_kernels
def test_results_do_not_depend_on_the_budget_and_repeat_bit_for_bit(monkeypatch):
    """The same inputs at a roomy and a tight budget agree to the rule (different chunking, split accumulator); two
    runs at one budget are identical (no atomics, fixed-order merges)."""
    case = _case(11, True)
    runs = {}
    for kib in (64 * 1024, TIGHT_KIB, TIGHT_KIB):
        monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", str(kib / 1024))
        runs.setdefault(kib, []).append(_run("triton", torch.float32, case))
    first, again = runs[TIGHT_KIB]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    pt, ref = _run("reference", torch.float32, case), _run("reference", torch.float64, case)
    for a, b, c in zip(runs[64 * 1024][0], pt, ref):
        assert_close_rule(a, b, c, torch.float32)


@needs_kernels
def test_forward_column_split_merges_to_the_unsplit_result(monkeypatch):
    """Few row blocks: the forward splits each chunk's columns over several programs and merges their statistics;
    the result equals the single-program one to the rule, whatever the number of SMs the launcher assumes."""
    from grpo_fast.kernels import launch

    case = _case(3, False)
    outs = {}
    for sms in (1, 4, 64):
        monkeypatch.setattr(launch, "INTERPRETER_SMS", sms)
        cfg = ll.tile_config(torch.device(DEVICE), N)
        outs[ll.column_splits(N, V, cfg, sms)] = _run("triton", torch.float32, case, need=())[:2]
    assert len(outs) == 3 and 1 in outs  # one, some and many splits
    pt, ref = _run("reference", torch.float32, case, need=()), _run("reference", torch.float64, case, need=())
    for out in outs.values():
        for a, b, c in zip(out, pt, ref):
            assert_close_rule(a, b, c, torch.float32)


@pytest.mark.parametrize("n,h,v", [(16384, 4096, 151936), (65536, 8192, 128256), (1000, 4096, 32000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_temporaries_stay_within_the_budget_at_gpu_sizes(n, h, v, dtype):
    """The plan of a forward and backward on meta tensors (nothing runs) keeps its temporaries within the default
    64 MiB at GPU sizes, the fp32 d-hidden accumulator included; launches come per vocabulary chunk, never per row
    block."""
    meta = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    budget = DEFAULT_SCRATCH_BYTES
    fwd, bwd = Plan(), Plan()
    with capture(Target("cuda", 90, 32), sms=132):
        block_n = ll.tile_config(torch.device("meta"), n).block_n
        params = LogprobParams(budget=budget)
        _, _, m, log_s = ll.forward(meta(n, h), meta(v, h), meta(n, dt=torch.int64), None, params, plan=fwd)
        ll.backward(meta(n, h), meta(v, h), meta(n, dt=torch.int64), None, params,
                    BackwardInputs(SavedStats(m, log_s), meta(n, dt=torch.float32)), every_row=True, plan=bwd)
    assert fwd.peak_bytes <= budget and bwd.peak_bytes <= budget
    stats = [s for s in fwd.steps if s.name == "chunk_stats"]
    assert len(stats) == len([s for s in fwd.steps if s.name == "logits"]) and len(fwd.steps) == 2 * len(stats) + 1
    assert all(s.shape[0] == -(-n // block_n) for s in stats)


def _frozen_head(g):
    """A d-hidden-only backward's inputs (a frozen lm_head) for upstream gradient ``g``, with meta statistics."""
    stats = SavedStats(torch.empty_like(g), torch.empty_like(g))
    return BackwardInputs(stats, g, need_hidden=True, need_weight=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_frozen_lm_head_backward_stays_within_the_budget(dtype):
    """A frozen lm_head (LoRA): d hidden only, by row stripes each over the whole vocabulary; temporaries within the
    default 64 MiB at N=16384, H=4096, V=151936, and 4 N H V FLOPs for the backward (recompute + d hidden)."""
    n, h, v = 16384, 4096, 151936
    meta = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    bwd = Plan()
    with capture(Target("cuda", 90, 32), sms=132):
        ll.backward(meta(n, h), meta(v, h), meta(n, dt=torch.int64), None,
                    LogprobParams(budget=DEFAULT_SCRATCH_BYTES), _frozen_head(meta(n, dt=torch.float32)),
                    every_row=True, plan=bwd)
    assert bwd.peak_bytes <= DEFAULT_SCRATCH_BYTES
    assert bwd.flops == 4 * n * h * v


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inactive", [False, True], ids=["all-rows", "gathered"])
def test_frozen_head_stripes_against_the_reference(monkeypatch, dtype, inactive):
    """d hidden alone at a 4 KiB budget: halving stripes whose accumulators live in grad_hidden's free bytes, then
    stripes with the accumulator at the end of the buffer; held to the reference rule."""
    case = _case(5, inactive)
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", str(4 / 1024))
    need = ("hidden", "bias")
    out = _run("triton", dtype, case, need)
    pt, ref = _run("reference", dtype, case, need), _run("reference", torch.float64, case, need)
    for name, a, b, c in zip(("logps", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
        assert_close_rule(a, b, c, dtype, name)


def test_frozen_head_stripes_halve_in_grad_hidden():
    """The plan of a d-hidden-only backward (bf16, every row active): stripes of N/2, N/4, ... rows while their
    accumulators fit grad_hidden's free bytes, then budget-sized ones; the buffer takes the whole budget."""
    n, h, v = 16384, 4096, 151936
    meta = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    bwd = Plan()
    with capture(Target("cuda", 90, 32), sms=132):
        ll.backward(meta(n, h), meta(v, h), meta(n, dt=torch.int64), None, LogprobParams(budget=64 * 2**20),
                    _frozen_head(meta(n, dt=torch.float32)), every_row=True, plan=bwd)
    stripes = [s.shape[0] // h for s in bwd.steps if s.name == "zero"]  # each stripe zeroes its accumulator
    assert stripes == [8192, 4096, 2048, 2048] and sum(stripes) == n
    widths = [s.shape[1] for s in bwd.steps if s.name == "logits (recomputed)"]
    assert widths[0] == 64 * 2**20 // (8192 * 2)  # the 8192-row stripe's buffer is the whole budget
    assert bwd.peak_bytes <= 64 * 2**20


@needs_kernels
def test_an_accumulator_wholly_in_grad_hidden_with_odd_sizes(monkeypatch):
    """Few active rows, 16-bit inputs, odd H and V: the fp32 accumulator fits grad_hidden's bytes past the gathered
    rows, so grad_weight's tail holds none of it (the empty piece is never made: its view would start at an odd
    element of grad_weight, which cannot be viewed as fp32)."""
    n, h, v, kib = 61, 47, 1151, 4
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) / h**0.5
    bias, targets = torch.randn(v, generator=gen) * 0.3, torch.randint(0, v, (n,), generator=gen)
    g = torch.zeros(n).index_fill_(0, torch.arange(0, n, 4), 1.0)  # 16 active rows
    walk = backward_layout(n, 16, h, v, 2, kib * 1024, gathered=True, need_hidden=True, need_weight=True,
                           vector_bytes=16).walk
    assert [p.home for p in walk.acc] == [AccHome.GRAD_HIDDEN] and walk.tail == 0 and v * h % 2
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", str(kib / 1024))

    def run(impl, dtype):
        leaves = [x.to(dtype).to(DEVICE).requires_grad_() for x in (hidden, weight, bias)]
        logps = fused_logprobs(leaves[0], leaves[1], targets.to(DEVICE), bias=leaves[2], impl=impl)
        (logps * g.to(DEVICE, logps.dtype)).sum().backward()
        return [logps] + [x.grad for x in leaves]

    out, pt, ref = run("triton", torch.bfloat16), run("reference", torch.bfloat16), run("reference", torch.float64)
    for name, a, b, c in zip(("logps", "d hidden", "d weight", "d bias"), out, pt, ref):
        assert_close_rule(a, b, c, torch.bfloat16, name)
