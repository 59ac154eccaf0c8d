"""Per-token log-prob and entropy of ``softmax(shape(h W^T + b))`` from hidden states and the lm_head weight, shaped
for a GPU: the matmuls are cuBLAS GEMMs over vocabulary chunks, the softmax work is two memory-bound Triton kernels,
and nothing of size ``N x V`` exists at any time.

Forward (``linear_logprob_forward``). For each vocabulary chunk ``[c0, c0 + C)``: one GEMM writes the chunk's raw
logits ``h @ W[c0:c0+C]^T`` (``[N, C]``, input dtype, into one reused buffer), then ``_chunk_stats`` shapes them
(bias, softcap, 1 / temperature) and folds them into per-row running statistics: the max ``m``, ``s = sum exp(z - m)``
and ``t = sum exp(z - m)(z - m)`` (float64: they carry over every chunk) and the target logit. When there are fewer
row blocks than twice the GPU's SMs, each chunk's columns are split over ``S`` programs per row block, each keeping
its own statistics; ``_stats_finalize`` merges the ``S`` partial statistics in a fixed order (deterministic) into
``logp = (z_y - m) - log s``, ``entropy = log s - t / s``, ``m`` and ``log s``. Launches: ``2 V / C + 1``.

Backward (``linear_logprob_backward``). Vocabulary chunks outer, over the active rows only (rows whose upstream
gradients are not both exactly zero; gathered once): per chunk one GEMM recomputes the raw logits of all active rows,
``_chunk_dlogits`` turns them in place into ``dz = (g (onehot - p) - ge p (log p + H)) / temperature (1 - tanh^2)``
in the input dtype, then ``dW[c0:c0+C] = dz^T @ h`` is one GEMM with K = the active rows (written once: no fp32
``V x H`` buffer, no atomics, deterministic) and ``dh += dz @ W[c0:c0+C]`` is one GEMM accumulating into an fp32
``[rows, H]`` matrix (``out_dtype``: fp32 accumulation inside cuBLAS, no rounded product, no second pass); ``db`` is a
column sum. Launches: ``4 V / C`` plus a handful. FLOPs: ``8 N H V`` with the forward. Without a weight gradient (a
frozen lm_head) the rows go in stripes instead, each over the whole vocabulary (``_rows_outer``).

Memory. Temporaries stay within ``scratch_bytes()`` (64 MiB unless ``GRPO_FAST_SCRATCH_MIB`` says otherwise; the one
exception below). The forward's logits buffer takes the budget. With a weight gradient the backward walks the
vocabulary from the end and keeps its ``dz`` buffer in grad_weight's rows not yet written (wider chunks, no memory);
the first rows go through a budget-sized buffer. The gathered active rows live in grad_hidden's storage until the
end. The fp32 ``dh`` accumulator (``4 rows H`` bytes: docs/design.md §5 accumulates ``dh`` in fp32, and a vocabulary-outer
sweep holds it for every row) is a temporary when it is at most half the budget; else it lives in the gradients' own
storage, in grad_hidden's free bytes and then in the last rows of grad_weight, whose ``dW`` is recomputed once the
accumulator is cast (``backward_layout``: 0.22 NHV more FLOPs at N = 16384, V = 151936). The exception: when those
rows are too few (16-bit inputs, more active rows than vocabulary rows) the accumulator is a temporary over budget.

The plan. Every GEMM, kernel and torch op goes through a ``plan.Plan``, which records it; ``bench/cost_model.py``
prices the plan these same functions produce on meta tensors for a named GPU.

Specialisations. Only the input dtype, RETURN_ENTROPY and the tile sizes are constexprs; bias, softcap and which
upstream gradients exist are runtime flags; sizes and chunk offsets are not specialised. Under TRITON_INTERPRET=1 the
kernels run as they are (no ``tl.dot``: bf16 is exact in the interpreter too).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from grpo_fast import dispatch
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.kernels.launch import capturing, current_sms, current_target
from grpo_fast.kernels.plan import Plan

logger = logging.getLogger("grpo_fast")
DEFAULT_SCRATCH_MIB = 64
_CHUNK_ALIGN = 128  # vocabulary chunks are multiples of this many columns (GEMM-friendly, whole column tiles)
_MAX_CHUNK = 16384  # a chunk kept in grad_weight's free rows is at most this wide


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


# ------------------------------------------------------------------------------------------------ configurations
@dataclass(frozen=True)
class TileConfig:
    """A ``[block_n, block_c]`` tile of the chunk buffer per loop step (per program for ``_chunk_dlogits``)."""

    block_n: int
    block_c: int
    num_warps: int


# (GPU family, N bucket) -> configuration of the memory-bound kernels. The kernels stream the chunk buffer once, so
# the tile only has to keep loads coalesced (256 contiguous columns: 512 bytes of bf16 per row) and registers low;
# 16 rows per program: the gate found 32-row tiles spilling on NVIDIA targets (32 x 256 / 8 warps: _chunk_stats
# 8-728 bytes and _chunk_dlogits 8-40 bytes on every one; 32 x 128: at 4 warps everywhere, at 8 on sm_90a/sm_120),
# 16-row tiles not (at most 251 registers); large N gets 8 warps. Held by the static gate (no spills, shared memory
# within limits) on every target of the family; not tuned on hardware.
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


def scratch_bytes() -> int:
    """The temporaries budget of the log-prob launchers: ``GRPO_FAST_SCRATCH_MIB`` MiB (default 64)."""
    raw = os.environ.get("GRPO_FAST_SCRATCH_MIB", str(DEFAULT_SCRATCH_MIB))
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise ValueError(f"GRPO_FAST_SCRATCH_MIB must be a positive number of MiB, got {raw!r}")
    return int(mib * 2**20)


def _align16(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 16 (cuBLAS and vector loads want 16-byte aligned rows)."""
    return -(-nbytes // 16) * 16


def budget_chunk(rows: int, elem: int, v: int, budget: int) -> int:
    """The widest vocabulary chunk whose ``[rows, C]`` buffer of ``elem``-byte elements fits ``budget`` (a multiple
    of 128 columns, at least 128, at most V)."""
    c = budget // max(rows * elem, 1) // _CHUNK_ALIGN * _CHUNK_ALIGN
    return min(v, max(_CHUNK_ALIGN, c))


@dataclass(frozen=True)
class BackwardLayout:
    """Where the backward keeps its large temporaries and how it walks the vocabulary.

    chunks: ``(c0, c1, in_weight)`` in order; ``in_weight``: the ``dz`` buffer lives in rows ``[0, ceil(rows C / H))``
    of grad_weight, below every row written so far and below the tail. tail: rows ``[V - tail, V)`` of grad_weight
    hold part of the fp32 ``dh`` accumulator during the sweep; their ``dW`` is recomputed afterwards (``recompute``
    chunks, budget buffer, all rows). acc: "none", "gradient" (fp32 inputs: grad_hidden itself), "scratch" or
    "split" (rows ``[0, acc_lo)`` in grad_hidden's free bytes from byte ``acc_offset``, the rest in the tail).
    budget_chunk: the width of the budget-sized buffer's chunks (0: none)."""

    chunks: tuple[tuple[int, int, bool], ...]
    tail: int = 0
    acc: str = "none"
    acc_lo: int = 0
    acc_offset: int = 0
    recompute: tuple[tuple[int, int], ...] = ()
    budget_chunk: int = 0
    recompute_chunk: int = 0


def backward_layout(n: int, rows: int, h: int, v: int, elem: int, budget: int, *, gathered: bool, need_hidden: bool,
                    need_weight: bool) -> BackwardLayout:
    """The layout of a backward over ``rows`` active rows (of ``n``) of ``elem``-byte inputs within ``budget`` bytes
    of temporaries (see ``BackwardLayout``). The fp32 accumulator (``4 rows H`` bytes) goes to the temporaries when
    it takes at most half the budget (the rest is the buffer's), else into the gradients' own storage: the bytes of
    grad_hidden that the gathered rows do not occupy, and the tail of grad_weight, whose rows are recomputed at the
    end (``2 n H tail`` more FLOPs); when it needs the tail and there is no grad_weight, it stays a temporary (over
    the budget)."""
    acc, acc_lo, acc_offset, tail = "none", 0, 0, 0
    if need_hidden:
        acc = "gradient" if elem == 4 and not gathered else "scratch"
    if acc == "scratch" and 4 * rows * h > budget // 2:
        acc_offset = _align16(rows * h * elem) if gathered else 0  # the gathered rows come first
        acc_lo = max(0, min(rows, (n * h * elem - acc_offset) // (4 * h)))
        tail = 0
        if acc_lo < rows:
            tail = -(-(rows - acc_lo) * 4 // elem)
            while (v - tail) * h * elem % 16:  # the accumulator's rows start 16-byte aligned
                tail += 1
        if tail == 0 or (need_weight and tail < v):
            acc = "split"
        else:
            acc_lo, acc_offset, tail = 0, 0, 0
    if acc == "scratch":
        budget = max(budget - 4 * rows * h, 0)
    small = budget_chunk(rows, elem, v, budget)

    chunks: list[tuple[int, int, bool]] = []

    def sweep(lo: int, end: int) -> None:
        while end > lo:
            if need_weight:  # widest C with ceil(rows C / H) <= min(c0, V - tail): the buffer avoids written rows
                c = min(_MAX_CHUNK, end * h // (h + rows), (v - tail) * h // rows)
                c = min(c // _CHUNK_ALIGN * _CHUNK_ALIGN, end - lo)
                if c > small and -(-rows * c // h) <= min(end - c, v - tail):
                    chunks.append((end - c, end, True))
                    end -= c
                    continue
            c = min(small, end - lo)
            chunks.append((end - c, end, False))
            end -= c

    sweep(v - tail, v)  # the tail first: d hidden (and d bias) only
    sweep(0, v - tail)
    recompute_chunk = budget_chunk(n, elem, tail, budget) if tail else 0
    recompute = tuple((c0, min(c0 + recompute_chunk, v)) for c0 in range(v - tail, v, recompute_chunk or 1)) if tail \
        else ()
    used_small = max((c1 - c0 for c0, c1, home in chunks if not home), default=0)
    return BackwardLayout(tuple(chunks), tail, acc, acc_lo, acc_offset, recompute, used_small, recompute_chunk)


# ------------------------------------------------------------------------------------------------ launchers
def linear_logprob_forward(hidden, weight, target_ids, bias, temperature, softcap, return_entropy, *, plan=None,
                           budget=None):
    """hidden [N, H], weight [V, H], target_ids [N] -> (logps, entropy or None, m, log_s), each [N] fp32."""
    plan = Plan() if plan is None else plan
    budget = scratch_bytes() if budget is None else budget
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
    splits = column_splits(n, v, cfg, current_sms(dev))
    stats_bytes = n * (4 + (2 + return_entropy) * splits * 8)  # zy, and m, s (t) per split (m counted as 8: slack)
    c_max = budget_chunk(n, hidden.element_size(), v, max(budget - stats_bytes, 0))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("grpo_fast log-prob forward (triton): N=%d, %d vocabulary chunks of %d, %d column split(s), "
                     "tile %s", n, triton.cdiv(v, c_max), c_max, splits, cfg)
    buf = plan.scratch((n, c_max), hidden.dtype, dev)
    run_m = plan.scratch((splits, n), torch.float32, dev)
    run_s = plan.scratch((splits, n), torch.float64, dev)
    run_t = plan.scratch((splits, n), torch.float64, dev) if return_entropy else run_s
    zy = plan.scratch((n,), torch.float32, dev)
    inv_temp, cap = 1.0 / temperature, 1.0 if softcap is None else softcap
    for c0 in range(0, v, c_max):
        c = min(c_max, v - c0)
        z = buf[:, :c] if c == c_max else buf.view(-1)[: n * c].view(n, c)
        plan.gemm("logits", hidden, weight[c0:c0 + c].t(), z)
        split = triton.cdiv(triton.cdiv(c, splits), cfg.block_c) * cfg.block_c
        plan.kernel(
            "chunk_stats", _chunk_stats, (triton.cdiv(n, cfg.block_n), splits),
            z, z if bias is None else bias, target_ids, run_m, run_s, run_t, zy,
            n, c, c0, z.stride(0), split, inv_temp, cap, int(c0 == 0), int(bias is not None), int(softcap is not None),
            reads=(z, None if bias is None else bias[c0:c0 + c], target_ids, *((run_m, run_s) if c0 else ()),
                   *((run_t,) if c0 and return_entropy else ())),
            writes=(run_m, run_s, run_t if return_entropy else None, zy),
            RETURN_ENTROPY=return_entropy, BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
        )
    plan.release(buf)
    plan.kernel(
        "stats_finalize", _stats_finalize, (triton.cdiv(n, cfg.block_n),),
        run_m, run_s, run_t, zy, logps, ent, m, log_s, n, splits,
        reads=(run_m, run_s, run_t if return_entropy else None, zy),
        writes=(logps, ent if return_entropy else None, m, log_s),
        RETURN_ENTROPY=return_entropy, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )
    plan.release(run_m, run_s, run_t if return_entropy else None, zy)
    return logps, (ent if return_entropy else None), m, log_s


def linear_logprob_backward(hidden, weight, target_ids, bias, m, log_s, entropy, g, ge, temperature, softcap,
                            need_hidden, need_weight, need_bias, *, rows=None, plan=None, budget=None):
    """Gradients ``(d hidden or None, d weight or None, d bias or None)`` of ``sum(g * logp + ge * entropy)``.

    ``rows``: the indices of the active rows (g or ge not zero, ascending), or None for all rows (the cost model,
    which has no data to look at); ``active_rows`` finds them. m, log_s, entropy: the forward's ``[N]`` statistics;
    g, ge: ``[N]`` fp32 or None."""
    plan = Plan() if plan is None else plan
    budget = scratch_bytes() if budget is None else budget
    n, h = hidden.shape
    v = weight.shape[0]
    dev, dtype, elem = hidden.device, hidden.dtype, hidden.element_size()
    gh = torch.empty(n, h, dtype=dtype, device=dev) if need_hidden else None
    gw = torch.empty(v, h, dtype=dtype, device=dev) if need_weight else None
    gb = torch.empty(v, dtype=torch.float32, device=dev) if need_bias else None
    a = n if rows is None else rows.shape[0]
    if a == 0:
        for t in (gh, gw, gb):
            if t is not None:
                plan.torch_op("zero", t.zero_, reads=(), writes=(t,))
        return gh, gw, None if gb is None else gb.to(bias.dtype)
    if rows is not None and gh is None and 2 * a * h * elem > budget:
        rows, a = None, n  # no room for the gathered rows without grad_hidden's storage: every row, no gather

    # the active rows' [A] vectors, gathered once (temporaries), and their hidden rows (grad_hidden's first rows)
    all_rows = [target_ids, m, log_s, entropy if ge is not None else None, g, ge]
    vectors, h_a = all_rows, hidden
    if rows is not None:
        vectors = [None if x is None else _gather(plan, x, rows) for x in all_rows]
        h_a = gh[:a] if gh is not None else plan.scratch((a, h), dtype, dev)
        plan.torch_op("gather rows", lambda: torch.index_select(hidden, 0, rows, out=h_a), reads=(hidden,),
                      writes=(h_a,))
    if need_hidden and not need_weight:  # no d weight to complete per chunk: row stripes, each over the vocabulary
        logger.debug("grpo_fast log-prob backward (triton): %d of %d rows, d hidden only: row stripes", a, n)
        _rows_outer(plan, gh, gb, h_a, weight, bias, vectors, temperature, softcap, max(budget - plan.live_bytes, 0),
                    gathered=rows is not None)
        if rows is not None:
            _finish_hidden(plan, gh, [], rows, budget)
    else:
        _vocab_outer(plan, gh, gw, gb, hidden, h_a, weight, bias, vectors, all_rows, rows, temperature, softcap, budget)
    for x in vectors if rows is not None else ():
        plan.release(x)
    return gh, gw, None if gb is None else gb.to(bias.dtype)


def _vocab_outer(plan, gh, gw, gb, hidden, h_a, weight, bias, vectors, all_rows, rows, temperature, softcap, budget):
    """The backward with a weight gradient: vocabulary chunks laid out by ``backward_layout``, each a recomputed
    logits GEMM, ``dz`` in place, its d weight (one GEMM over the active rows ``h_a``) and its share of the fp32 d
    hidden accumulator; then the accumulator cast into grad_hidden and the tail's d weight recomputed over every row.
    ``vectors``: the active rows' (targets, m, log s, entropy, g, ge); ``all_rows``: the same for every row."""
    n, h = hidden.shape
    a, v = h_a.shape[0], weight.shape[0]
    dev, dtype, elem = hidden.device, hidden.dtype, hidden.element_size()
    need_hidden, need_weight, need_bias = gh is not None, gw is not None, gb is not None
    layout = backward_layout(n, a, h, v, elem, max(budget - plan.live_bytes, 0), gathered=rows is not None,
                             need_hidden=need_hidden, need_weight=need_weight)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("grpo_fast log-prob backward (triton): %d of %d rows, %d vocabulary chunks (%d in grad_weight's "
                     "free rows), d-hidden accumulator: %s, %d grad_weight rows recomputed", a, n, len(layout.chunks),
                     sum(home for *_, home in layout.chunks), layout.acc, layout.tail)

    acc_parts = []  # (first row, fp32 [rows, H], whether it lives in grad_hidden's bytes): the d hidden accumulator
    if layout.acc == "gradient":
        acc_parts = [(0, gh, True)]
    elif layout.acc == "scratch":
        acc_parts = [(0, plan.scratch((a, h), torch.float32, dev), False)]
    elif layout.acc == "split":
        lo = layout.acc_lo
        acc_parts = [(0, _as_fp32(gh, layout.acc_offset, lo, h), True),
                     (lo, _as_fp32(gw[v - layout.tail:], 0, a - lo, h), False)]
        acc_parts = [p for p in acc_parts if p[1].shape[0]]
    for _, part, _ in acc_parts:
        plan.torch_op("zero", part.zero_, reads=(), writes=(part,))

    buf = plan.scratch((a, layout.budget_chunk), dtype, dev) if layout.budget_chunk else None
    for c0, c1, in_weight in layout.chunks:
        z = (gw if in_weight else buf).view(-1)[: a * (c1 - c0)].view(a, c1 - c0)
        _dlogits(plan, z, h_a, weight, bias, *vectors, c0, c1, temperature, softcap)
        if need_bias:
            _dbias(plan, gb[c0:c1], z, accumulate=False)
        for r0, part, _ in acc_parts:
            plan.gemm("d hidden", z[r0:r0 + part.shape[0]], weight[c0:c1], part, accumulate=True)
        if need_weight and c1 <= v - layout.tail:
            plan.gemm("d weight", z.t(), h_a, gw[c0:c1])
    plan.release(buf)

    if need_hidden and layout.acc != "gradient":
        _finish_hidden(plan, gh, acc_parts, rows, budget)
    if layout.acc == "scratch":
        plan.release(acc_parts[0][1])
    if rows is not None and gh is None:
        plan.release(h_a)
    if layout.recompute:  # the tail held part of the accumulator: its d weight now, over every row
        buf = plan.scratch((n, layout.recompute_chunk), dtype, dev)
        for c0, c1 in layout.recompute:
            z = buf.view(-1)[: n * (c1 - c0)].view(n, c1 - c0)
            _dlogits(plan, z, hidden, weight, bias, *all_rows, c0, c1, temperature, softcap)
            plan.gemm("d weight", z.t(), hidden, gw[c0:c1])
        plan.release(buf)


def _rows_outer(plan, gh, gb, h_a, weight, bias, vectors, temperature, softcap, budget, *, gathered):
    """d hidden (and d bias) without d weight: stripes of the active rows, each walking the whole vocabulary with
    its own fp32 accumulator, cast into grad_hidden's rows of the stripe when it is done (gathered rows: their
    compact positions, which held the stripe's own hidden rows). The accumulator is a temporary when the remaining
    rows' fits half the budget; before that it lives in grad_hidden's bytes that no finished stripe (nor a gathered
    row) holds, so stripes halve (N/2, N/4, ... rows) and the ``[rows, C]`` buffer gets the whole budget. Launches:
    3 per (stripe, chunk), about ``3 N V elem / budget`` in all."""
    a, h = h_a.shape
    n, v = gh.shape[0], weight.shape[0]
    dtype, dev, elem = h_a.dtype, h_a.device, h_a.element_size()
    small = a if 4 * a * h <= budget // 2 else max(1, budget // 2 // (4 * h))  # rows a temporary accumulator holds
    stripes = []  # (r0, r1, home, byte offset in gh): home "gradient" (fp32, not gathered), "gh" or "scratch"
    r0 = 0
    while r0 < a:
        if dtype == torch.float32 and not gathered:
            stripes.append((0, a, "gradient", 0))
            break
        if 4 * (a - r0) * h <= budget // 2:
            stripes.append((r0, a, "scratch", 0))
            break
        offset = _align16((a if gathered else r0) * h * elem)  # past the rows in use
        rows = min(a - r0, max(0, (n * h * elem - offset) // (4 * h)))
        if 4 * rows * h <= budget // 2:  # no room worth a stripe: a temporary's worth of rows
            rows = min(a - r0, small)
            stripes.append((r0, r0 + rows, "scratch", 0))
        else:
            stripes.append((r0, r0 + rows, "gh", offset))
        r0 += rows
    # one temporary of the budget: the [rows, C] buffer, and at its end a stripe's accumulator when it is "scratch"
    def acc_bytes(r, home):
        return _align16(4 * r * h) if home == "scratch" else 0

    chunks = {(r1 - r0, home): budget_chunk(r1 - r0, elem, v, max(budget - acc_bytes(r1 - r0, home), 0))
              for r0, r1, home, _ in stripes}
    space = max(r * c * elem + acc_bytes(r, home) for (r, home), c in chunks.items())
    buf = plan.scratch((_align16(space) // elem,), dtype, dev)
    for r0, r1, home, offset in stripes:
        rows, c_max = r1 - r0, chunks[(r1 - r0, home)]
        acc = {"gradient": lambda: gh, "gh": lambda: _as_fp32(gh, offset, rows, h),
               "scratch": lambda: _as_fp32(buf, buf.numel() * elem - acc_bytes(rows, home), rows, h)}[home]()
        y, m, log_s, ent, g, ge = (None if x is None else x[r0:r1] for x in vectors)
        plan.torch_op("zero", acc.zero_, reads=(), writes=(acc,))
        for c0 in range(0, v, c_max):
            c1 = min(v, c0 + c_max)
            z = buf[: rows * (c1 - c0)].view(rows, c1 - c0)
            _dlogits(plan, z, h_a[r0:r1], weight, bias, y, m, log_s, ent, g, ge, c0, c1, temperature, softcap)
            if gb is not None:  # later stripes add to the first one's column sums
                _dbias(plan, gb[c0:c1], z, accumulate=r0 > 0)
            plan.gemm("d hidden", z, weight[c0:c1], acc, accumulate=True)
        if home != "gradient":  # in place (ascending pieces) where the accumulator overlaps the stripe's rows
            _cast_rows(plan, gh, r0, acc, home == "gh" and not gathered, budget, space=buf)
    plan.release(buf)


def _dbias(plan, db, z, *, accumulate):
    """``db (+)= z.sum(0)`` in fp32: the bias gradient of a chunk's ``dz``."""
    if accumulate:
        plan.torch_op("d bias", lambda: db.add_(torch.sum(z, 0, dtype=torch.float32)), reads=(z, db), writes=(db,))
    else:
        plan.torch_op("d bias", lambda: torch.sum(z, 0, dtype=torch.float32, out=db), reads=(z,), writes=(db,))


def _dlogits(plan, z, h_rows, weight, bias, y, m, log_s, ent, g, ge, c0, c1, temperature, softcap):
    """``z [R, C]`` (a buffer) <- d loss / d raw logits of ``h_rows`` against the vocabulary chunk ``[c0, c1)``:
    the logits GEMM, then ``_chunk_dlogits`` in place."""
    r, c = z.shape
    plan.gemm("logits (recomputed)", h_rows, weight[c0:c1].t(), z)
    cfg = tile_config(z.device, r)
    plan.kernel(
        "chunk_dlogits", _chunk_dlogits, (triton.cdiv(r, cfg.block_n), triton.cdiv(c, cfg.block_c)),
        z, z if bias is None else bias, y, m, log_s, m if ent is None else ent, m if g is None else g,
        m if ge is None else ge, r, c, c0, z.stride(0), 1.0 / temperature, 1.0 if softcap is None else softcap,
        int(bias is not None), int(softcap is not None), int(g is not None), int(ge is not None),
        reads=(z, None if bias is None else bias[c0:c1], y if g is not None else None, m, log_s, ent, g, ge),
        writes=(z,), BLOCK_N=cfg.block_n, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps,
    )


def _as_fp32(t: torch.Tensor, byte_offset: int, rows: int, h: int) -> torch.Tensor:
    """An fp32 ``[rows, h]`` view of ``t``'s bytes from ``byte_offset`` (``t`` contiguous)."""
    ratio = 4 // t.element_size()
    start = byte_offset // t.element_size()
    return t.view(-1)[start: start + rows * h * ratio].view(torch.float32).view(rows, h)


def _cast_rows(plan, gh, r0, acc, in_gh, budget, space=None):
    """``gh[r0:r0 + rows] = acc`` (fp32 ``[rows, H]``). ``in_gh``: ``acc`` lives in ``gh``'s own bytes at or above the
    destination's; then in ascending pieces through a temporary (``space``, a free 1-D buffer of gh's dtype, or the
    budget left), each written below every byte still unread."""
    if not in_gh:
        dst = gh[r0:r0 + acc.shape[0]]
        plan.torch_op("cast d hidden", lambda: dst.copy_(acc), reads=(acc,), writes=(dst,))
        return
    h = gh.shape[1]
    piece = max(1, (space.numel() // h) if space is not None else max(budget - plan.live_bytes, 0) // (h * 4))
    for p0 in range(0, acc.shape[0], piece):
        src = acc[p0:p0 + piece]
        rows = src.shape[0]
        tmp = space[: rows * h].view(rows, h) if space is not None else plan.scratch(src.shape, gh.dtype, gh.device)
        plan.torch_op("cast d hidden", lambda: tmp.copy_(src), reads=(src,), writes=(tmp,))
        dst = gh[r0 + p0:r0 + p0 + rows]
        plan.torch_op("cast d hidden", lambda: dst.copy_(tmp), reads=(tmp,), writes=(dst,))
        if space is None:
            plan.release(tmp)


def _finish_hidden(plan, gh, acc_parts, rows, budget):
    """grad_hidden from the fp32 accumulator pieces: cast into its first A rows (in place where the accumulator lives
    in grad_hidden's own bytes: ascending pieces through a temporary, each written below every byte still unread),
    then, for gathered rows, moved to their rows (descending pieces: row j goes to rows[j] >= j, above every row not
    yet moved) and the other rows zeroed."""
    n, h = gh.shape
    piece = max(1, max(budget - plan.live_bytes, 0) // (h * 4))
    for r0, part, in_gh in acc_parts:
        _cast_rows(plan, gh, r0, part, in_gh, budget)
    if rows is None:
        return
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
