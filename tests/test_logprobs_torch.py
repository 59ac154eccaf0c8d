"""chunked_logprobs (the pure-PyTorch no-logits path) against the float64 reference, under the one tolerance rule."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_fast.logprobs import chunked_logprobs
from grpo_fast.logprob_contract import LogprobParams
from grpo_fast.reference import logprobs_reference
from grpo_fast.testing import assert_close_rule, head_inputs, upstream_grads

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
NAMES = ("logps", "entropy", "d_hidden", "d_weight", "d_bias")
N, V, H = 123, 1151, 96


def _inputs(n=N, v=V, h=H, dtype=torch.float32, seed=0, bias=True, logit_scale=3.0):
    """hidden [n, h], weight [v, h] (logits of std ~logit_scale), bias [v] or None, targets [n]; cast to dtype."""
    hidden, weight, b, targets = head_inputs((n,), h, v, torch.Generator().manual_seed(seed),
                                             draw_dtype=torch.float64, logit_scale=logit_scale,
                                             bias_scale=1.0 if bias else None)
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(b), targets


def _upstream(n, seed=1, zero_rows=()):
    """Random upstream gradients (g for logps, ge for entropy), float32-representable, with exact zeros: rows in
    ``zero_rows`` in both, every fifth row in g only, every seventh (from row 1) in ge only."""
    g, ge = upstream_grads(n, torch.Generator().manual_seed(seed), dead=zero_rows, no_logp_grad=slice(None, None, 5),
                           no_entropy_grad=slice(1, None, 7), dtype=torch.float32)
    return g.double(), ge.double()


def _run(impl, hidden, weight, bias, targets, params, g, ge, cast=None, grad=(True, True, True)):
    """Forward + backward of ``impl`` ('out' or 'ref') on fresh leaves; returns (logps, entropy, dh, dw, db)."""
    cast = cast or (lambda x: x)
    leaves = []
    for x, req in zip((hidden, weight, bias), grad):
        leaves.append(None if x is None else cast(x.detach().clone()).requires_grad_(req))
    h, w, b = leaves
    if impl == "out":
        logps, entropy = chunked_logprobs(h, w, targets, b, params)
    else:
        out = logprobs_reference(h, w, targets, b, params.temperature, params.softcap, params.return_entropy)
        logps, entropy = out if params.return_entropy else (out, None)
    loss = (logps * g.to(logps.dtype)).sum()
    if entropy is not None:
        loss = loss + (entropy * ge.to(entropy.dtype)).sum()
    loss.backward()
    grads = tuple(None if x is None or not x.requires_grad else x.grad for x in (h, w, b))
    return (logps, entropy) + grads


def _check(dtype, hidden, weight, bias, targets, params, g, ge, grad=(True, True, True)):
    """out / out_pt / out_ref on every output and gradient; returns ``out`` for further checks."""
    out = _run("out", hidden, weight, bias, targets, params, g, ge, grad=grad)
    out_pt = _run("ref", hidden, weight, bias, targets, params, g, ge, grad=grad)
    out_ref = _run("ref", hidden, weight, bias, targets, params, g, ge, cast=torch.Tensor.double, grad=grad)
    for name, o, o_pt, o_ref in zip(NAMES, out, out_pt, out_ref):
        assert_close_rule(o, o_pt, o_ref, dtype, name)
        if o is not None:
            assert torch.isfinite(o).all(), name
    return out


GRID = list(itertools.product(DTYPES, (1.0, 0.6, 1.5), (None, 30.0), (False, True), (False, True)))


@pytest.mark.parametrize("dtype,temperature,softcap,with_bias,return_entropy", GRID)
def test_matches_reference(dtype, temperature, softcap, with_bias, return_entropy):
    """N=123, V=1151 with chunks that divide neither; rows 40..79 masked, so one token block is skipped whole."""
    hidden, weight, bias, targets = _inputs(dtype=dtype, bias=with_bias)
    g, ge = _upstream(N, zero_rows=range(40, 80))
    params = LogprobParams(temperature, softcap, return_entropy, vocab_chunk=300, token_chunk=40)
    logps, entropy, dh, *_ = _check(dtype, hidden, weight, bias, targets, params, g, ge)
    assert logps.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (entropy is not None) == return_entropy
    assert dh.dtype == dtype and bool((dh[40:80] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (30.0, 0.6)])
def test_matches_reference_power_of_two_auto_chunks(dtype, softcap, temperature):
    hidden, weight, bias, targets = _inputs(128, 1024, 64, dtype=dtype, seed=3)
    g, ge = _upstream(128, seed=4)
    _check(dtype, hidden, weight, bias, targets, LogprobParams(temperature, softcap, True), g, ge)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("used", ("logps", "entropy"))
def test_one_output_in_the_loss(dtype, used):
    """Only one output gets a gradient (the other's grad arrives as None in the backward)."""
    hidden, weight, bias, targets = _inputs(dtype=dtype, seed=5)
    g, ge = _upstream(N, seed=6)
    up = g if used == "logps" else ge
    params = LogprobParams(0.6, 30.0, True, vocab_chunk=500, token_chunk=64)
    # the unused output stays out of the loss, so its gradient reaches the backward as None
    out = _run_one_output("out", hidden, weight, bias, targets, params, up, used)
    out_pt = _run_one_output("ref", hidden, weight, bias, targets, params, up, used)
    out_ref = _run_one_output("ref", hidden, weight, bias, targets, params, up, used, fp64=True)
    for name, o, o_pt, o_ref in zip(NAMES[2:], out, out_pt, out_ref):
        assert_close_rule(o, o_pt, o_ref, dtype, name)


def _run_one_output(impl, hidden, weight, bias, targets, params, up, used, fp64=False):
    h, w, b = ((x.double() if fp64 else x).detach().clone().requires_grad_(True) for x in (hidden, weight, bias))
    if impl == "out":
        logps, entropy = chunked_logprobs(h, w, targets, b, params)
    else:
        logps, entropy = logprobs_reference(h, w, targets, b, params.temperature, params.softcap, True)
    y = logps if used == "logps" else entropy
    (y * up.to(y.dtype)).sum().backward()
    return h.grad, w.grad, b.grad


CHUNKS = [(None, None), (123, 1151), (40, 300), (7, 128), (1, 333), (64, 4096), (123, 7), (123, 1000)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_size_invariance(dtype):
    """Token and vocab chunk sizes (dividing N/V or not, 1 token, 165 vocab chunks) give the same numbers."""
    hidden, weight, bias, targets = _inputs(dtype=dtype, seed=7)
    g, ge = _upstream(N, seed=8, zero_rows=range(60, 70))
    results = []
    for token_chunk, vocab_chunk in CHUNKS:
        params = LogprobParams(0.6, 30.0, True, vocab_chunk=vocab_chunk, token_chunk=token_chunk)
        results.append(_check(dtype, hidden, weight, bias, targets, params, g, ge))
    # a single tile in both loops is the same computation whatever the budget: bitwise equal
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)


EXTREMES = ("offset_plus_1e4", "offset_minus_1e4", "p_target_near_1")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXTREMES)
@pytest.mark.parametrize("softcap", (None, 30.0))
def test_extreme_logits(dtype, case, softcap):
    hidden, weight, bias, targets = _inputs(n=64, dtype=torch.float64, seed=9)
    if case == "offset_plus_1e4":
        bias = bias + 1e4
    elif case == "offset_minus_1e4":
        bias = bias - 1e4  # every logit negative
    else:
        targets = torch.randperm(V, generator=torch.Generator().manual_seed(10))[:64]
        # W[y_n] = 40 h_n / |h_n|^2: target logit 40 above the rest, p(target) = 1 - O(e^-30)
        weight[targets] = 40.0 * hidden / (hidden * hidden).sum(1, keepdim=True)
    g, ge = _upstream(64, seed=11, zero_rows=range(10, 20))
    params = LogprobParams(1.0, softcap, True, vocab_chunk=256, token_chunk=24)
    cast = lambda x: x.to(dtype)  # noqa: E731
    logps, entropy, *_ = _check(dtype, cast(hidden), cast(weight), cast(bias), targets, params, g, ge)
    if case == "p_target_near_1" and softcap is None:
        assert float(logps.detach().min()) > -1e-3 and float(entropy.detach().max()) < 1e-3


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("grad", [(True, False, False), (False, True, True), (False, True, False)],
                         ids=["weight_and_bias_frozen", "hidden_without_grad", "only_weight"])
def test_needs_input_grad(dtype, grad):
    hidden, weight, bias, targets = _inputs(dtype=dtype, seed=12)
    g, ge = _upstream(N, seed=13, zero_rows=range(50, 100))  # the second token block is dead, the others partly
    params = LogprobParams(1.5, None, True, vocab_chunk=400, token_chunk=50)
    out = _check(dtype, hidden, weight, bias, targets, params, g, ge, grad=grad)
    for x, req in zip(out[2:], grad):
        assert (x is not None) == req
    # frozen operands also skip their matmuls: the recompute (whole token blocks that hold a live row, as the forward
    # made them) + one product per trainable [N, H] / [V, H] operand over the live rows only
    h, w, b = (x.detach().clone().requires_grad_(r) for x, r in zip((hidden, weight, bias), grad))
    logps, entropy = chunked_logprobs(h, w, targets, b, params)
    loss = (logps * g.float()).sum() + (entropy * ge.float()).sum()
    live = (g != 0) | (ge != 0)
    recomputed = _recomputed_rows(live, params.token_chunk)
    assert int(live.sum()) < recomputed < N  # a dead block, and dead rows in live blocks
    assert _backward_matmul_flops(loss) == (recomputed + (grad[0] + grad[1]) * int(live.sum())) * 2 * V * H


def _recomputed_rows(live, token_chunk):
    """Rows whose logits the backward recomputes: every row of a token block that holds a live row."""
    return sum(len(block) for block in live.split(token_chunk) if block.any())


_MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"}


def _backward_matmul_flops(loss):
    """FLOPs of every matrix product ``loss.backward()`` runs, read from the profiler's aten events with shapes.

    The profiler sees ops inside custom ops and autograd Functions alike; only the leaf matmul kernels are counted.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    flops = 0
    for event in prof.events():
        if event.name in _MATMULS:
            a, b = event.input_shapes[-4:-2] if event.name.startswith("aten::addmm") else event.input_shapes[:2]
            flops += 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
    return flops


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_zero_upstream_rows_cost_no_matmul(dtype):
    """Masked rows are skipped: dh and dW matmul FLOPs scale with the active rows, the recompute with the blocks that
    hold one (whole, as the forward made them); the numbers equal the reference."""
    hidden, weight, bias, targets = _inputs(dtype=dtype, seed=14)
    zero = list(range(0, 10)) + list(range(30, 90)) + list(range(100, 123, 2))  # whole blocks and scattered rows
    g, ge = _upstream(N, seed=15, zero_rows=zero)
    active = int(((g != 0) | (ge != 0)).sum())
    params = LogprobParams(0.6, None, True, vocab_chunk=300, token_chunk=16)
    out = _check(dtype, hidden, weight, bias, targets, params, g, ge)
    assert bool((out[2][zero] == 0).all())  # d hidden of skipped rows: exact zeros

    h, w, b = (x.detach().clone().requires_grad_(True) for x in (hidden, weight, bias))
    logps, entropy = chunked_logprobs(h, w, targets, b, params)
    loss = (logps * g.float()).sum() + (entropy * ge.float()).sum()
    # recompute z over the live blocks; dh = dz W, dW = dz^T h: two 2 n V H matmuls over the n active rows only
    recomputed = _recomputed_rows((g != 0) | (ge != 0), params.token_chunk)
    assert recomputed == 16 * 4 + 11  # blocks 0-15 (rows 0-9 dead), 16-31, 80-95, 96-111, 112-122; 32-79 skipped
    assert _backward_matmul_flops(loss) == (recomputed + 2 * active) * 2 * V * H


def test_all_zero_upstream_skips_backward():
    hidden, weight, bias, targets = _inputs(seed=16)
    h, w, b = (x.detach().clone().requires_grad_(True) for x in (hidden, weight, bias))
    logps, entropy = chunked_logprobs(h, w, targets, b, LogprobParams(return_entropy=True))
    assert _backward_matmul_flops((logps * 0.0).sum() + (entropy * 0.0).sum()) == 0
    for x in (h, w, b):
        assert x.grad is not None and x.grad.dtype == x.dtype and not x.grad.any()


def test_tied_embeddings():
    """weight is the embedding that also produced hidden: both gradient paths reach the one parameter."""
    torch.manual_seed(17)
    emb = torch.nn.Embedding(V, H, dtype=torch.float64)
    proj = torch.randn(H, H, dtype=torch.float64) / H**0.5
    input_ids = torch.randint(0, V, (N,))
    targets = torch.randint(0, V, (N,))
    g, ge = _upstream(N, seed=18, zero_rows=range(5, 15))
    params = LogprobParams(0.6, 30.0, True, vocab_chunk=256, token_chunk=32)

    def grad_of(dtype, impl):
        weight = emb.weight.detach().to(dtype).requires_grad_(True)
        hidden = torch.tanh(torch.nn.functional.embedding(input_ids, weight) @ proj.to(dtype)) * 3.0
        if impl == "out":
            logps, entropy = chunked_logprobs(hidden, weight, targets, None, params)
        else:
            logps, entropy = logprobs_reference(hidden, weight, targets, None, 0.6, 30.0, True)
        ((logps * g.to(logps.dtype)).sum() + (entropy * ge.to(entropy.dtype)).sum()).backward()
        return weight.grad

    out, out_pt, out_ref = grad_of(torch.float32, "out"), grad_of(torch.float32, "ref"), grad_of(torch.float64, "ref")
    assert_close_rule(out, out_pt, out_ref, torch.float32, "d_embedding")
    assert bool(out[input_ids].abs().sum(1).gt(0).all())  # rows used as inputs receive the embedding-path gradient


def test_no_grad_forward_is_the_same_computation():
    hidden, weight, bias, targets = _inputs(seed=19)
    params = LogprobParams(0.6, 30.0, True, vocab_chunk=300, token_chunk=40)
    with torch.no_grad():
        a = chunked_logprobs(hidden, weight, targets, bias, params)
    b = chunked_logprobs(hidden.requires_grad_(), weight, targets, bias, params)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert chunked_logprobs(hidden, weight, targets, bias, LogprobParams())[1] is None


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, re, resource, sys, torch
    from grpo_fast.logprobs import chunked_logprobs
    from grpo_fast.logprob_contract import LogprobParams

    n, v, h, dtype = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4])

    def rss_hwm():
        status = open("/proc/self/status").read()
        kib = lambda key: int(re.search(key + r":\\s+(\\d+)", status).group(1)) * 1024
        return kib("VmRSS"), kib("VmHWM")

    torch.manual_seed(0)
    hidden = torch.randn(n, h, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, dtype=dtype) * 0.3).requires_grad_()
    targets = torch.randint(0, v, (n,))
    g, ge = torch.randn(n), torch.randn(n)
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        open("/proc/self/clear_refs", "w").write("5")
        reset = True
    except OSError:
        reset = False
    before, hwm_before = rss_hwm()
    logps, entropy = chunked_logprobs(hidden, weight, targets, None, LogprobParams(return_entropy=True))
    ((logps * g).sum() + (entropy * ge).sum()).backward()
    _, hwm = rss_hwm()
    if not reset:  # ru_maxrss is monotone: the growth is only meaningful above the earlier peak
        hwm, before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, max(before, hwm_before)
    kept = sum(t.numel() * t.element_size() for t in (logps, entropy, hidden.grad, weight.grad))
    finite = all(bool(torch.isfinite(t).all()) for t in (logps, entropy, hidden.grad, weight.grad))
    print(json.dumps(dict(extra=hwm - before - kept, growth=hwm - before, kept=kept, finite=finite)))
    """
)


def _peak_extra(n, v, h, dtype):
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(v), str(h), dtype],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_no_logits():
    """N=4096, V=131072: fp32 logits would be 2 GiB; extra memory (beyond outputs and grads) stays under 256 MiB."""
    res = _peak_extra(4096, 131072, 64, "float32")
    assert res["finite"]
    assert res["extra"] < 256 * 2**20, f"{res['extra'] / 2**20:.0f} MiB beyond outputs and gradients ({res})"


@pytest.mark.slow
def test_peak_memory_no_fp32_weight_copy():
    """bf16 weight V=131072, H=1024: an fp32 V x H copy would be 512 MiB; extra memory stays under 256 MiB."""
    res = _peak_extra(128, 131072, 1024, "bfloat16")
    assert res["finite"]
    assert res["extra"] < 256 * 2**20, f"{res['extra'] / 2**20:.0f} MiB beyond outputs and gradients ({res})"
