"""Per-token log-prob and entropy of ``softmax(shape(h W^T + b))`` from hidden states and the lm_head weight, shaped
for a GPU: the matmuls are cuBLAS GEMMs over vocabulary chunks, the softmax work is two memory-bound Triton kernels,
and nothing of size ``N x V`` exists at any time.

Forward (``forward``). For each vocabulary chunk ``[c0, c0 + C)``: one GEMM writes the chunk's raw
logits ``h @ W[c0:c0+C]^T`` (``[N, C]``, input dtype, into one reused buffer), then ``_chunk_stats`` shapes them
(bias, softcap, 1 / temperature) and folds them into per-row running statistics: the max ``m``, ``s = sum exp(z - m)``
and ``t = sum exp(z - m)(z - m)`` (float64: they carry over every chunk) and the target logit. When there are fewer
row blocks than twice the GPU's SMs, each chunk's columns are split over ``S`` programs per row block, each keeping
its own statistics; ``_stats_finalize`` merges the ``S`` partial statistics in a fixed order (deterministic) into
``logp = (z_y - m) - log s``, ``entropy = log s - t / s``, ``m`` and ``log s``. Launches: ``2 V / C + 1``.

Backward (``backward``). Vocabulary chunks outer, over the active rows only (rows whose upstream
gradients are not both exactly zero; gathered once): per chunk one GEMM recomputes the raw logits of all active rows,
``_chunk_dlogits`` turns them in place into ``dz = (g (onehot - p) - ge p (log p + e)) / temperature (1 - tanh^2)``
in the input dtype, then ``dW[c0:c0+C] = dz^T @ h`` is one GEMM with K = the active rows (written once: no fp32
``V x H`` buffer, no atomics, deterministic) and ``dh += dz @ W[c0:c0+C]`` is one GEMM accumulating into an fp32
``[rows, H]`` matrix (``out_dtype``: fp32 accumulation inside cuBLAS, no rounded product, no second pass); ``db`` is a
column sum. Launches: ``4 V / C`` plus a handful. FLOPs: ``8 N H V`` with the forward. Without a weight gradient (a
frozen lm_head) the rows go in stripes instead, each over the whole vocabulary with its own d-hidden accumulator.

Memory. Temporaries stay within ``scratch_bytes()`` (64 MiB unless ``GRPO_FAST_SCRATCH_MIB`` says otherwise; the one
exception below). Where every temporary lives, the ``dz`` buffers in grad_weight's unwritten rows and the fp32
``dh`` accumulator (docs/design.md §5) in a temporary or in the gradients' own storage, is planned from sizes alone by
``grpo_fast.kernels.logprob_layout`` (its docstring maps the bytes at N = 16384, H = 4096, V = 151936): the launchers
here only walk the layouts it returns (``forward_layout``, ``backward_layout``). The exception: when grad_weight's
tail cannot hold the accumulator's share (16-bit inputs, more active rows than vocabulary rows), the accumulator is a
temporary over the budget.

The plan. Every GEMM, kernel and torch op goes through a ``plan.Plan``, which records it; ``bench/cost_model.py``
prices the plan these same functions produce on meta tensors for a named GPU. Each kernel declares what a launch
reads and writes right below the kernels (``plan.traffic``), so a call site passes only the launch's arguments.

Specialisations. Only the input dtype, RETURN_ENTROPY and the tile sizes are constexprs; bias, softcap and which
upstream gradients exist are runtime flags; sizes and chunk offsets are not specialised. Under TRITON_INTERPRET=1 the
kernels run as they are (no ``tl.dot``: bf16 is exact in the interpreter too). The kernels' line numbers are part of
Triton's cache key (``JITFunction.cache_key``), which keys the static gate's CSV: lines above them shift them, and
every launch then reads as missing from ``bench/results/kernel_report.csv``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from grpo_fast import dispatch
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.kernels.launch import capturing, current_sms, current_target
from grpo_fast.kernels.logprob_layout import (AccHome, StripeWalk, backward_layout,
                                              forward_layout)
from grpo_fast.kernels.plan import Plan, traffic
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams

logger = logging.getLogger("grpo_fast")


@triton.jit
def _tanh(x):
    # tanh from exp: 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 at large |x|
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _shape(x, b_ptr, c0, rc, cmask, inv_temp, softcap, has_bias, has_softcap):
    """Shaped fp32 logits from raw fp32 ``x [BLOCK_N, BLOCK_C]`` (columns ``rc`` of the chunk starting at ``c0``),
    and tanh(raw / softcap) for the chain rule."""
    if has_bias:
        x += tl.load(b_ptr + c0 + rc, mask=cmask, other=0.0).to(tl.float32)[None, :]
    u = x
    if has_softcap:
        u = _tanh(x / softcap)
        x = softcap * u
    return x * inv_temp, u


@triton.jit(do_not_specialize=["N", "C", "c0", "stride_z", "split", "first", "has_bias", "has_softcap"])
def _chunk_stats(
    z_ptr,  # [N, C] raw logits of the chunk (row stride stride_z), input dtype
    b_ptr,  # [V] bias (read when has_bias), indexed from c0
    y_ptr,  # [N] int64 target ids
    m_ptr,  # [S, N] fp32 running max, one row per column split
    s_ptr,  # [S, N] fp64 running sum exp(z - m)
    t_ptr,  # [S, N] fp64 running sum exp(z - m) (z - m) (RETURN_ENTROPY)
    zy_ptr,  # [N] fp32 target logit, written by the program whose columns hold the target
    N, C, c0, stride_z, split, inv_temp, softcap,
    first,  # int 0/1: the first chunk (start the statistics instead of loading them)
    has_bias, has_softcap,  # ints 0/1
    RETURN_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    state = pid_s * N + rn
    if first:
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float64)
        t = tl.zeros((BLOCK_N,), tl.float64)
    else:
        m = tl.load(m_ptr + state, mask=nmask, other=float("-inf"))
        s = tl.load(s_ptr + state, mask=nmask, other=0.0)
        t = tl.zeros((BLOCK_N,), tl.float64)
        if RETURN_ENTROPY:
            t = tl.load(t_ptr + state, mask=nmask, other=0.0)
    y = tl.load(y_ptr + rn, mask=nmask, other=-1) - c0
    zy = tl.zeros((BLOCK_N,), tl.float32)
    found = tl.zeros((BLOCK_N,), tl.int32)
    lo = pid_s * split
    hi = tl.minimum(lo + split, C)
    for j0 in range(lo, hi, BLOCK_C):
        rc = j0 + tl.arange(0, BLOCK_C)
        cmask = rc < hi
        x = tl.load(z_ptr + rn[:, None] * stride_z + rc[None, :], mask=nmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        z, _ = _shape(x, b_ptr, c0, rc, cmask, inv_temp, softcap, has_bias, has_softcap)
        z = tl.where(cmask[None, :], z, float("-inf"))
        hit = rc[None, :] == y[:, None]
        zy += tl.sum(tl.where(hit, z, 0.0), 1)
        found += tl.sum(hit.to(tl.int32), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        delta = tl.where(s > 0, m - m_new, 0.0)  # m = -inf before the first column, where s = t = 0
        alpha = tl.exp(delta).to(tl.float64)
        zm = z - m_new[:, None]
        e = tl.exp(zm)
        if RETURN_ENTROPY:
            t = alpha * (t + delta.to(tl.float64) * s) + tl.sum(tl.where(cmask[None, :], e * zm, 0.0), 1).to(tl.float64)
        s = alpha * s + tl.sum(e, 1).to(tl.float64)
        m = m_new
    tl.store(m_ptr + state, m, mask=nmask)
    tl.store(s_ptr + state, s, mask=nmask)
    if RETURN_ENTROPY:
        tl.store(t_ptr + state, t, mask=nmask)
    tl.store(zy_ptr + rn, zy, mask=nmask & (found > 0))


@triton.jit(do_not_specialize=["N", "S"])
def _stats_finalize(
    m_ptr, s_ptr, t_ptr,  # [S, N] partial statistics (fp32, fp64, fp64)
    zy_ptr,  # [N] fp32 target logit
    logp_ptr, ent_ptr, mo_ptr, logs_ptr,  # [N] fp32 outputs (ent_ptr when RETURN_ENTROPY)
    N, S,
    RETURN_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    big_m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for j in range(0, S):
        big_m = tl.maximum(big_m, tl.load(m_ptr + j * N + rn, mask=nmask, other=float("-inf")))
    s = tl.zeros((BLOCK_N,), tl.float64)
    t = tl.zeros((BLOCK_N,), tl.float64)
    for j in range(0, S):  # a fixed order: the same sums whatever the schedule
        sj = tl.load(s_ptr + j * N + rn, mask=nmask, other=0.0)
        d = tl.where(sj > 0, tl.load(m_ptr + j * N + rn, mask=nmask, other=0.0) - big_m, 0.0)  # empty split: 0
        a = tl.where(sj > 0, tl.exp(d).to(tl.float64), 0.0)
        s += a * sj
        if RETURN_ENTROPY:
            t += a * (tl.load(t_ptr + j * N + rn, mask=nmask, other=0.0) + d.to(tl.float64) * sj)
    s = tl.where(nmask, s, 1.0)  # rows past N: no log(0)
    log_s = tl.log(s).to(tl.float32)
    zy = tl.load(zy_ptr + rn, mask=nmask, other=0.0)
    tl.store(logp_ptr + rn, (zy - big_m) - log_s, mask=nmask)
    tl.store(mo_ptr + rn, big_m, mask=nmask)
    tl.store(logs_ptr + rn, log_s, mask=nmask)
    if RETURN_ENTROPY:
        tl.store(ent_ptr + rn, log_s - (t / s).to(tl.float32), mask=nmask)


@triton.jit(do_not_specialize=["R", "C", "c0", "stride_z", "has_bias", "has_softcap", "has_g", "has_ge"])
def _chunk_dlogits(
    z_ptr,  # [R, C] in: raw logits of the chunk; out: d loss / d raw logits (in place, same dtype)
    b_ptr,  # [V] bias (read when has_bias), indexed from c0
    y_ptr,  # [R] int64 target ids
    m_ptr, logs_ptr, ent_ptr,  # [R] fp32 statistics of the forward (ent_ptr read when has_ge)
    g_ptr, ge_ptr,  # [R] fp32 d loss / d logp (has_g), d loss / d entropy (has_ge)
    R, C, c0, stride_z, inv_temp, softcap,
    has_bias, has_softcap, has_g, has_ge,  # ints 0/1
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    nmask = rn < R
    cmask = rc < C
    mask = nmask[:, None] & cmask[None, :]
    ptrs = z_ptr + rn[:, None] * stride_z + rc[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z, u = _shape(x, b_ptr, c0, rc, cmask, inv_temp, softcap, has_bias, has_softcap)
    m = tl.load(m_ptr + rn, mask=nmask, other=0.0)
    log_s = tl.load(logs_ptr + rn, mask=nmask, other=0.0)
    logp = (z - m[:, None]) - log_s[:, None]  # (z - m) - log s: exact at large logit offsets
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    if has_ge:
        ent = tl.load(ent_ptr + rn, mask=nmask, other=0.0)
        ge = tl.load(ge_ptr + rn, mask=nmask, other=0.0)
        dz -= p * (logp + ent[:, None]) * ge[:, None]
    if has_g:
        g = tl.load(g_ptr + rn, mask=nmask, other=0.0)
        y = tl.load(y_ptr + rn, mask=nmask, other=-1) - c0
        dz += g[:, None] * ((rc[None, :] == y[:, None]).to(tl.float32) - p)
    dz = dz * inv_temp
    if has_softcap:
        dz = dz * (1.0 - u * u)
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ traffic
# What each launch reads and writes (the tensors, from the launch's own arguments): ``Plan.kernel`` records their
# bytes, so a call site describes a launch once.
@traffic(_chunk_stats)
def _chunk_stats_traffic(z, b, y, m, s, t, zy, n, c, c0, stride_z, split, inv_temp, softcap, first, has_bias,
                         has_softcap, *, RETURN_ENTROPY, **_):
    """The chunk's logits, its bias columns, the targets and (after the first chunk) the running statistics in;
    the statistics and the target logits out."""
    carried = () if first else (m, s, t if RETURN_ENTROPY else None)
    return (z, b[c0:c0 + c] if has_bias else None, y, *carried), (m, s, t if RETURN_ENTROPY else None, zy)


@traffic(_stats_finalize)
def _stats_finalize_traffic(m, s, t, zy, logp, ent, mo, logs, n, splits, *, RETURN_ENTROPY, **_):
    """The partial statistics and target logits in; logp, entropy, m and log s out."""
    return (m, s, t if RETURN_ENTROPY else None, zy), (logp, ent if RETURN_ENTROPY else None, mo, logs)


@traffic(_chunk_dlogits)
def _chunk_dlogits_traffic(z, b, y, m, log_s, ent, g, ge, r, c, c0, stride_z, inv_temp, softcap, has_bias,
                           has_softcap, has_g, has_ge, **_):
    """The chunk's logits (rewritten in place as d logits), its bias columns and the per-row vectors it uses."""
    return ((z, b[c0:c0 + c] if has_bias else None, y if has_g else None, m, log_s, ent if has_ge else None,
             g if has_g else None, ge if has_ge else None), (z,))


# ------------------------------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class TileConfig:
    """A ``[block_n, block_c]`` tile of the chunk buffer per loop step (per program for ``_chunk_dlogits``)."""

    block_n: int
    block_c: int
    num_warps: int


# (GPU family, N bucket) -> tile of the memory-bound kernels; why these tiles: docs/kernels.md, "Tile choices"
N_BUCKETS = ((4096, "small"), (None, "large"))
_SMALL = TileConfig(16, 256, 4)
_LARGE = TileConfig(16, 256, 8)
CONFIGS: dict[tuple[str, str], TileConfig] = {
    (family, bucket): cfg for family in dispatch.GATED_FAMILIES for bucket, cfg in (("small", _SMALL), ("large", _LARGE))
}
_INTERPRET = TileConfig(32, 128, 4)  # the interpreter runs one program per tile in numpy: few, large tiles


def n_bucket(n: int) -> str:
    return next(name for bound, name in N_BUCKETS if bound is None or n <= bound)


def tile_config(device: torch.device, n: int) -> TileConfig:
    """The configuration of the memory-bound kernels for ``n`` rows on ``device``."""
    if triton_interpreting() and not capturing():
        return _INTERPRET
    return CONFIGS[(current_target(device).family, n_bucket(n))]


def column_splits(n: int, c: int, cfg: TileConfig, sms: int) -> int:
    """How many programs share a row block's columns of each chunk: enough for two programs per SM when the row
    blocks alone are fewer, at most one per ``block_c`` columns."""
    row_blocks = triton.cdiv(max(n, 1), cfg.block_n)
    if row_blocks >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, row_blocks), triton.cdiv(c, cfg.block_c)))


@dataclass(frozen=True)
class RowVectors:
    """The ``[rows]`` vectors a backward reads for the rows it walks: target ids, the forward's m and log s, its
    entropy (None without an entropy gradient), and the upstream gradients g and ge (None where absent)."""

    targets: torch.Tensor
    m: torch.Tensor
    log_s: torch.Tensor
    entropy: torch.Tensor | None
    g: torch.Tensor | None
    ge: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.targets, self.m, self.log_s, self.entropy, self.g, self.ge

    def row_bytes(self) -> int:
        """Bytes of one row of the vectors present: what gathering them takes per row."""
        return sum(x.element_size() for x in self.tensors() if x is not None)

    def gather(self, plan: Plan, rows: torch.Tensor) -> "RowVectors":
        """The vectors of ``rows`` only, each a temporary of ``plan`` (``release`` gives them back)."""
        return RowVectors(*(None if x is None else _gather(plan, x, rows) for x in self.tensors()))

    def slice(self, r0: int, r1: int) -> "RowVectors":
        return RowVectors(*(None if x is None else x[r0:r1] for x in self.tensors()))

    def release(self, plan: Plan) -> None:
        plan.release(*self.tensors())


# ------------------------------------------------------------------------------------------------ launchers
def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the forward's ``[N]`` outputs: float32 whatever the inputs' (the contract of
    ``grpo_fast.logprob_contract``)."""
    return torch.float32


def forward(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, bias: torch.Tensor | None,
            params: LogprobParams, *, plan: Plan | None = None):
    """hidden [N, H], weight [V, H], target_ids [N] -> (logps, entropy or None, m, log_s), each [N] fp32, within
    ``params.budget_bytes()`` of temporaries (``params``' chunk sizes are the torch path's: not used here). ``plan``:
    where the launches are recorded (a new one by default)."""
    plan = Plan() if plan is None else plan
    budget, return_entropy = params.budget_bytes(), params.return_entropy
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    logps = torch.empty(n, dtype=torch.float32, device=dev)
    ent = torch.empty(n, dtype=torch.float32, device=dev) if return_entropy else logps
    m = torch.empty(n, dtype=torch.float32, device=dev)
    log_s = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return logps, (ent if return_entropy else None), m, log_s
    cfg = tile_config(dev, n)
    layout = forward_layout(n, v, hidden.element_size(), budget, splits=column_splits(n, v, cfg, current_sms(dev)),
                            block_c=cfg.block_c, return_entropy=return_entropy)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("grpo_fast log-prob forward (triton): N=%d, %d vocabulary chunks of %d, %d column split(s), "
                     "tile %s", n, len(layout.chunks), layout.buffer_chunk, layout.splits, cfg)
    buf = plan.scratch((n, layout.buffer_chunk), hidden.dtype, dev)
    run_m = plan.scratch((layout.splits, n), torch.float32, dev)
    run_s = plan.scratch((layout.splits, n), torch.float64, dev)
    run_t = plan.scratch((layout.splits, n), torch.float64, dev) if return_entropy else run_s
    zy = plan.scratch((n,), torch.float32, dev)
    softcap = params.softcap
    inv_temp, softcap_arg = 1.0 / params.temperature, 1.0 if softcap is None else softcap  # 1.0: unused
    for c0, c1, split in layout.chunks:
        c = c1 - c0
        z = buf[:, :c] if c == layout.buffer_chunk else buf.view(-1)[: n * c].view(n, c)
        plan.gemm("logits", hidden, weight[c0:c1].t(), z)
        plan.kernel(
            "chunk_stats", _chunk_stats, (triton.cdiv(n, cfg.block_n), layout.splits),
            z, z if bias is None else bias, target_ids, run_m, run_s, run_t, zy,
            n, c, c0, z.stride(0), split, inv_temp, softcap_arg, int(c0 == 0), int(bias is not None),
            int(softcap is not None),
            RETURN_ENTROPY=return_entropy, BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
        )
    plan.release(buf)
    plan.kernel(
        "stats_finalize", _stats_finalize, (triton.cdiv(n, cfg.block_n),),
        run_m, run_s, run_t, zy, logps, ent, m, log_s, n, layout.splits,
        RETURN_ENTROPY=return_entropy, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )
    plan.release(run_m, run_s, run_t if return_entropy else None, zy)
    return logps, (ent if return_entropy else None), m, log_s


def backward(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, bias: torch.Tensor | None,
             params: LogprobParams, grads: BackwardInputs, *, rows: torch.Tensor | None = None,
             every_row: bool = False, plan: Plan | None = None):
    """Gradients ``(d hidden or None, d weight or None, d bias or None)`` of ``sum(g * logp + ge * entropy)``, those
    ``grads`` asks for.

    The rows walked: those whose g or ge is not zero, found here (``active_rows``, one host sync); or ``rows``, their
    indices (ascending) when the caller knows them; or, with ``every_row``, all of them without looking at g and ge
    (the cost model and the static gate, whose meta tensors hold no data). The walk is
    ``logprob_layout.backward_layout``'s, within ``params.budget_bytes()``; ``plan``: where the launches are recorded
    (a new one by default)."""
    plan = Plan() if plan is None else plan
    budget = params.budget_bytes()
    need_hidden, need_weight, need_bias = grads.need_hidden, grads.need_weight, grads.need_bias
    g = None if grads.g is None else grads.g.float().contiguous()
    ge = None if grads.ge is None else grads.ge.float().contiguous()
    if every_row and rows is not None:
        raise ValueError(f"linear_logprobs.backward: rows and every_row=True exclude each other, got rows of shape "
                         f"{tuple(rows.shape)} and every_row=True")
    if every_row:
        rows = None
    elif rows is None and g is None and ge is None:  # no upstream gradient at all: no row to walk
        rows = torch.empty(0, dtype=torch.long, device=hidden.device)
    elif rows is None:
        rows = active_rows(g, ge)
    m, log_s, entropy = grads.saved.m, grads.saved.log_s, grads.saved.entropy
    n, h = hidden.shape
    v = weight.shape[0]
    dev, dtype, elem = hidden.device, hidden.dtype, hidden.element_size()
    gh = torch.empty(n, h, dtype=dtype, device=dev) if need_hidden else None
    gw = torch.empty(v, h, dtype=dtype, device=dev) if need_weight else None
    gb = torch.empty(v, dtype=torch.float32, device=dev) if need_bias else None
    active = n if rows is None else rows.shape[0]
    if active == 0:
        for t in (gh, gw, gb):
            if t is not None:
                plan.torch_op("zero", t.zero_, reads=(), writes=(t,))
        return gh, gw, None if gb is None else gb.to(bias.dtype)

    all_vectors = RowVectors(target_ids, m, log_s, entropy if ge is not None else None, g, ge)
    layout = backward_layout(n, active, h, v, elem, budget, gathered=rows is not None, need_hidden=need_hidden,
                             need_weight=need_weight, vector_bytes=all_vectors.row_bytes())
    rows = rows if layout.gathered else None
    # the walked rows' vectors, gathered once (temporaries), and their hidden rows (grad_hidden's first rows)
    walked, h_rows = all_vectors, hidden
    if rows is not None:
        walked = all_vectors.gather(plan, rows)
        h_rows = gh[:layout.rows] if gh is not None else plan.scratch((layout.rows, h), dtype, dev)
        plan.torch_op("gather rows", lambda: torch.index_select(hidden, 0, rows, out=h_rows), reads=(hidden,),
                      writes=(h_rows,))
    if isinstance(layout.walk, StripeWalk):
        logger.debug("grpo_fast log-prob backward (triton): %d of %d rows, d hidden only: %d row stripes",
                     layout.rows, n, len(layout.walk.stripes))
        _stripe_walk(plan, layout.walk, gh, gb, h_rows, weight, bias, walked, rows, params)
    else:
        _vocab_walk(plan, layout.walk, gh, gw, gb, hidden, h_rows, weight, bias, walked, all_vectors, rows, params)
    if rows is not None:
        walked.release(plan)
    return gh, gw, None if gb is None else gb.to(bias.dtype)


def _vocab_walk(plan, walk, gh, gw, gb, hidden, h_rows, weight, bias, walked, all_vectors, rows, params):
    """The backward with a weight gradient, along ``walk`` (a ``VocabWalk``): per chunk a recomputed logits GEMM,
    ``dz`` in place, its d weight (one GEMM over the walked rows ``h_rows``) and its share of the fp32 d-hidden
    accumulator; then the accumulator cast into grad_hidden and the tail's d weight recomputed over every row.
    ``walked``: the walked rows' vectors; ``all_vectors``: every row's; ``rows``: the gathered rows' indices or None."""
    n, h = hidden.shape
    a, v = h_rows.shape[0], weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("grpo_fast log-prob backward (triton): %d of %d rows, %d vocabulary chunks (%d in grad_weight's "
                     "free rows), d-hidden accumulator in %s, %d grad_weight rows recomputed", a, n, len(walk.chunks),
                     sum(chunk.in_grad_weight for chunk in walk.chunks),
                     " + ".join(p.home.value for p in walk.acc) or "nothing", walk.tail)

    acc = []  # (piece, fp32 [rows, H] tensor) of the d-hidden accumulator
    for piece in walk.acc:
        if piece.home is AccHome.GRADIENT:
            part = gh
        elif piece.home is AccHome.TEMPORARY:
            part = plan.scratch((piece.rows, h), torch.float32, dev)
        elif piece.home is AccHome.GRAD_HIDDEN:
            part = _as_fp32(gh, piece.offset, piece.rows, h)
        else:
            part = _as_fp32(gw[v - walk.tail:], piece.offset, piece.rows, h)
        acc.append((piece, part))
    for _, part in acc:
        plan.torch_op("zero", part.zero_, reads=(), writes=(part,))

    buf = plan.scratch((a, walk.buffer_chunk), dtype, dev) if walk.buffer_chunk else None
    for c0, c1, in_grad_weight in walk.chunks:
        z = (gw if in_grad_weight else buf).view(-1)[: a * (c1 - c0)].view(a, c1 - c0)
        _dlogits(plan, z, h_rows, weight, bias, walked, c0, c1, params)
        if gb is not None:
            _dbias(plan, gb[c0:c1], z, accumulate=False)
        for piece, part in acc:
            plan.gemm("d hidden", z[piece.row0:piece.row0 + piece.rows], weight[c0:c1], part, accumulate=True)
        if gw is not None and c1 <= v - walk.tail:
            plan.gemm("d weight", z.t(), h_rows, gw[c0:c1])
    plan.release(buf)

    if gh is not None and all(piece.home is not AccHome.GRADIENT for piece, _ in acc):
        for piece, part in acc:
            _cast(plan, gh, piece, part)
        if rows is not None:
            _move_gathered(plan, gh, rows, walk.move_piece)
    for piece, part in acc:
        if piece.home is AccHome.TEMPORARY:
            plan.release(part)
    if rows is not None and gh is None:
        plan.release(h_rows)
    if walk.recompute:  # the tail held part of the accumulator: its d weight now, over every row
        buf = plan.scratch((n, walk.recompute_chunk), dtype, dev)
        for c0, c1 in walk.recompute:
            z = buf.view(-1)[: n * (c1 - c0)].view(n, c1 - c0)
            _dlogits(plan, z, hidden, weight, bias, all_vectors, c0, c1, params)
            plan.gemm("d weight", z.t(), hidden, gw[c0:c1])
        plan.release(buf)


def _stripe_walk(plan, walk, gh, gb, h_rows, weight, bias, walked, rows, params):
    """d hidden (and d bias) without d weight, along ``walk`` (a ``StripeWalk``): each stripe of the walked rows
    goes over the whole vocabulary with its own fp32 accumulator, cast into grad_hidden's rows of the stripe when it
    is done (gathered rows: their compact positions, which held the stripe's own hidden rows); then gathered rows
    move to their places."""
    h, v = h_rows.shape[1], weight.shape[0]
    buf = plan.scratch((walk.buffer_elems,), h_rows.dtype, h_rows.device)
    for stripe in walk.stripes:
        piece = stripe.acc
        r0, r1 = piece.row0, piece.row0 + piece.rows
        acc = {AccHome.GRADIENT: lambda: gh, AccHome.GRAD_HIDDEN: lambda: _as_fp32(gh, piece.offset, piece.rows, h),
               AccHome.TEMPORARY: lambda: _as_fp32(buf, piece.offset, piece.rows, h)}[piece.home]()
        vectors = walked.slice(r0, r1)
        plan.torch_op("zero", acc.zero_, reads=(), writes=(acc,))
        for c0 in range(0, v, stripe.chunk):
            c1 = min(v, c0 + stripe.chunk)
            z = buf[: piece.rows * (c1 - c0)].view(piece.rows, c1 - c0)
            _dlogits(plan, z, h_rows[r0:r1], weight, bias, vectors, c0, c1, params)
            if gb is not None:  # later stripes add to the first one's column sums
                _dbias(plan, gb[c0:c1], z, accumulate=r0 > 0)
            plan.gemm("d hidden", z, weight[c0:c1], acc, accumulate=True)
        if piece.home is not AccHome.GRADIENT:
            _cast(plan, gh, piece, acc, space=buf)
    plan.release(buf)
    if rows is not None:
        _move_gathered(plan, gh, rows, walk.move_piece)


def _dbias(plan, db, z, *, accumulate):
    """``db (+)= z.sum(0)`` in fp32: the bias gradient of a chunk's ``dz``."""
    if accumulate:
        plan.torch_op("d bias", lambda: db.add_(torch.sum(z, 0, dtype=torch.float32)), reads=(z, db), writes=(db,))
    else:
        plan.torch_op("d bias", lambda: torch.sum(z, 0, dtype=torch.float32, out=db), reads=(z,), writes=(db,))


def _dlogits(plan, z, h_rows, weight, bias, vectors, c0, c1, params):
    """``z [R, C]`` (a buffer) <- d loss / d raw logits of ``h_rows`` against the vocabulary chunk ``[c0, c1)``:
    the logits GEMM, then ``_chunk_dlogits`` in place. ``vectors``: the rows' ``RowVectors``."""
    r, c = z.shape
    softcap = params.softcap
    plan.gemm("logits (recomputed)", h_rows, weight[c0:c1].t(), z)
    cfg = tile_config(z.device, r)
    y, m, log_s, ent, g, ge = vectors.tensors()
    plan.kernel(
        "chunk_dlogits", _chunk_dlogits, (triton.cdiv(r, cfg.block_n), triton.cdiv(c, cfg.block_c)),
        z, z if bias is None else bias, y, m, log_s, m if ent is None else ent, m if g is None else g,
        m if ge is None else ge, r, c, c0, z.stride(0), 1.0 / params.temperature, 1.0 if softcap is None else softcap,
        int(bias is not None), int(softcap is not None), int(g is not None), int(ge is not None),
        BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
    )


def _as_fp32(t: torch.Tensor, byte_offset: int, rows: int, h: int) -> torch.Tensor:
    """An fp32 ``[rows, h]`` view of ``t``'s bytes from ``byte_offset`` (``t`` contiguous)."""
    ratio = 4 // t.element_size()
    start = byte_offset // t.element_size()
    return t.view(-1)[start: start + rows * h * ratio].view(torch.float32).view(rows, h)


def _cast(plan, gh, piece, acc, space=None):
    """``gh[piece's rows] = acc`` (the fp32 ``[rows, H]`` accumulator of ``piece``, an ``AccPiece``): one copy, or
    (``piece.cast_piece``: ``acc`` lies in ``gh``'s own bytes at or above its destination) ascending pieces through a
    temporary (``space``, a free 1-D buffer of gh's dtype, or a temporary of the plan), each written below every byte
    still unread."""
    r0 = piece.row0
    if not piece.cast_piece:
        dst = gh[r0:r0 + piece.rows]
        plan.torch_op("cast d hidden", lambda: dst.copy_(acc), reads=(acc,), writes=(dst,))
        return
    h = gh.shape[1]
    for p0 in range(0, piece.rows, piece.cast_piece):
        src = acc[p0:p0 + piece.cast_piece]
        rows = src.shape[0]
        tmp = space[: rows * h].view(rows, h) if space is not None else plan.scratch(src.shape, gh.dtype, gh.device)
        plan.torch_op("cast d hidden", lambda: tmp.copy_(src), reads=(src,), writes=(tmp,))
        dst = gh[r0 + p0:r0 + p0 + rows]
        plan.torch_op("cast d hidden", lambda: dst.copy_(tmp), reads=(tmp,), writes=(dst,))
        if space is None:
            plan.release(tmp)


def _move_gathered(plan, gh, rows, piece):
    """Gathered rows' d hidden from grad_hidden's first rows to their own (descending pieces of ``piece`` rows
    through a temporary: row j goes to rows[j] >= j, above every row not yet moved), and the other rows zeroed."""
    n, h = gh.shape
    a = rows.shape[0]
    for p1 in range(a, 0, -piece):
        p0 = max(0, p1 - piece)
        tmp = plan.scratch((p1 - p0, h), gh.dtype, gh.device)
        plan.torch_op("move d hidden", lambda: tmp.copy_(gh[p0:p1]), reads=(gh[p0:p1],), writes=(tmp,))
        plan.torch_op("move d hidden", lambda: gh.index_copy_(0, rows[p0:p1], tmp), reads=(tmp,),
                      writes=(gh[p0:p1],))  # as many bytes as the rows it writes
        plan.release(tmp)
    inactive = torch.ones(n, dtype=torch.bool, device=gh.device)
    plan.torch_op("inactive rows", lambda: inactive.index_fill_(0, rows, False), reads=(rows,), writes=(inactive,))
    plan.torch_op("zero inactive rows", lambda: gh.masked_fill_(inactive[:, None], 0), reads=(inactive,),
                  writes=(gh,))


def _gather(plan: Plan, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = plan.scratch((rows.shape[0],), x.dtype, x.device)
    plan.torch_op("gather", lambda: torch.index_select(x, 0, rows, out=out), reads=(rows,), writes=(out,))
    return out


def active_rows(g: torch.Tensor | None, ge: torch.Tensor | None) -> torch.Tensor | None:
    """Indices of the rows whose upstream gradients are not both exactly zero, or None when every row is active
    (no gather needed). One host sync (the count)."""
    active = None
    for x in (g, ge):
        if x is not None:
            active = (x != 0) if active is None else active | (x != 0)
    rows = active.nonzero().squeeze(1)
    return None if rows.shape[0] == active.shape[0] else rows
