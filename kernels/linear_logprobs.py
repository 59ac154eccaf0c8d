"""Per-token log-prob and entropy of ``softmax(shape(h W^T + b))`` from hidden states and the lm_head weight.

Forward (``_linear_logprob_fwd``): one program per block of BLOCK_N tokens walks the vocabulary in BLOCK_V tiles;
each tile of logits is built by ``tl.dot`` over BLOCK_H slices of H with fp32 accumulation, shaped (bias, softcap,
1/temperature, tiles past V masked to -inf) and folded into an online max ``m``, ``s = sum exp(z - m)``,
``t = sum exp(z - m) (z - m)`` and the target logit. Outputs per token: ``logp = (z_y - m) - log s``,
``entropy = log s - t / s``, ``m`` and ``log s``. Nothing of size ``N x V`` is written. Traffic: W is read once per
token block (N / BLOCK_N times), hidden once; 2NHV FLOPs.

Backward (``_linear_logprob_dlogits``): for one slab of (active) token rows and one vocabulary chunk it recomputes the
logits tile and writes ``dz = (g (onehot - p) - ge p (log p + H)) / temperature * (1 - tanh^2)`` into a bounded
``[rows, chunk]`` buffer; the launcher multiplies it into ``dh`` and ``dW`` with two matmuls (cuBLAS on GPU) in the
shared chunk loop of ``grpo_fast.logprobs_torch`` (vocab chunks outer, so each dW chunk is written once: no fp32
``V x H`` buffer, no atomics, deterministic). Rows whose upstream gradients are exactly zero are never visited.

Limits: the grid is ``cdiv(N, BLOCK_N)`` programs on axis 0 (no 65535 limit); offsets are int64. Under
TRITON_INTERPRET=1 tiles are upcast to fp32 before ``tl.dot`` (UPCAST), since the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_fast.dispatch import triton_interpreting


@triton.jit
def _tanh(x):
    # tanh from exp: 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 at large |x|
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Shaped fp32 logits ``[BLOCK_N, BLOCK_V]`` (-inf past V) and tanh(raw / softcap) for the chain rule."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        hmask = rh < H
        a = tl.load(h_ptr + rn[:, None] * stride_h + rh[None, :], mask=nmask[:, None] & hmask[None, :], other=0.0)
        b = tl.load(w_ptr + rv[:, None] * stride_w + rh[None, :], mask=vmask[:, None] & hmask[None, :], other=0.0)
        if UPCAST:  # fp32 inputs, or any input under the interpreter: exact fp32 products (no TF32)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:  # bf16 / fp16 tensor-core dot, fp32 accumulation
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rv, mask=vmask, other=0.0).to(tl.float32)[None, :]
    u = acc
    if HAS_SOFTCAP:
        u = _tanh(acc / softcap)
        acc = softcap * u
    z = acc * inv_temp
    z = tl.where(vmask[None, :], z, float("-inf"))
    return z, u


@triton.jit
def _linear_logprob_fwd(
    h_ptr,  # [N, H] hidden, row stride stride_h
    w_ptr,  # [V, H] weight, row stride stride_w
    b_ptr,  # [V] bias (HAS_BIAS)
    y_ptr,  # [N] int64 target ids
    logp_ptr,  # [N] fp32 out
    ent_ptr,  # [N] fp32 out (RETURN_ENTROPY)
    m_ptr,  # [N] fp32 out: running max
    logs_ptr,  # [N] fp32 out: log sum exp(z - m)
    N, V, H, stride_h, stride_w, inv_temp, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RETURN_ENTROPY: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    y = tl.load(y_ptr + rn, mask=nmask, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    # s and t carry across all V / BLOCK_V tiles (1187 at V=151936): float64 keeps them from drifting; [BLOCK_N] only
    s = tl.zeros((BLOCK_N,), tl.float64)
    t = tl.zeros((BLOCK_N,), tl.float64)
    zy = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        vmask = rv < V
        z, u = _logits_tile(h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap,
                            HAS_BIAS, HAS_SOFTCAP, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
        zy += tl.sum(tl.where(rv[None, :] == y[:, None], z, 0.0), 1)
        m_new = tl.maximum(m, tl.max(z, 1))
        delta = tl.where(s > 0, m - m_new, 0.0)  # m = -inf before the first tile, where s = t = 0
        alpha = tl.exp(delta).to(tl.float64)
        zm = z - m_new[:, None]
        e = tl.exp(zm)
        if RETURN_ENTROPY:
            t = alpha * (t + delta.to(tl.float64) * s) + tl.sum(tl.where(vmask[None, :], e * zm, 0.0), 1).to(tl.float64)
        s = alpha * s + tl.sum(e, 1).to(tl.float64)
        m = m_new
    log_s = tl.log(s).to(tl.float32)
    tl.store(logp_ptr + rn, (zy - m) - log_s, mask=nmask)
    tl.store(m_ptr + rn, m, mask=nmask)
    tl.store(logs_ptr + rn, log_s, mask=nmask)
    if RETURN_ENTROPY:
        tl.store(ent_ptr + rn, log_s - (t / s).to(tl.float32), mask=nmask)


@triton.jit
def _linear_logprob_dlogits(
    h_ptr,  # [R, H] hidden rows of this slab
    w_ptr,  # [C, H] weight rows of this vocab chunk
    b_ptr,  # [C] bias of this chunk (HAS_BIAS)
    y_ptr,  # [R] target ids, already shifted by the chunk start
    stat_ptr,  # [R, 3] fp32: m, log s, entropy
    g_ptr,  # [R] fp32 d loss / d logp (HAS_G)
    ge_ptr,  # [R] fp32 d loss / d entropy (HAS_GE)
    dz_ptr,  # [R, C] out: d loss / d raw logits, in dz_ptr's dtype
    R, C, H, stride_h, stride_w, inv_temp, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_GE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    nmask = rn < R
    vmask = rv < C
    z, u = _logits_tile(h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap,
                        HAS_BIAS, HAS_SOFTCAP, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
    m = tl.load(stat_ptr + rn * 3, mask=nmask, other=0.0)
    log_s = tl.load(stat_ptr + rn * 3 + 1, mask=nmask, other=0.0)
    logp = (z - m[:, None]) - log_s[:, None]
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    if HAS_GE:
        ent = tl.load(stat_ptr + rn * 3 + 2, mask=nmask, other=0.0)
        ge = tl.load(ge_ptr + rn, mask=nmask, other=0.0)
        dz -= p * tl.where(vmask[None, :], logp + ent[:, None], 0.0) * ge[:, None]
    if HAS_G:
        g = tl.load(g_ptr + rn, mask=nmask, other=0.0)
        y = tl.load(y_ptr + rn, mask=nmask, other=-1)
        onehot = (rv[None, :] == y[:, None]).to(tl.float32)
        dz += g[:, None] * (onehot - p)
    dz = dz * inv_temp
    if HAS_SOFTCAP:
        dz = dz * (1.0 - u * u)
    out_mask = nmask[:, None] & vmask[None, :]
    tl.store(dz_ptr + rn[:, None] * C + rv[None, :], dz.to(dz_ptr.dtype.element_ty), mask=out_mask)


def _blocks(H: int):
    interpret = triton_interpreting()
    if interpret:  # the interpreter runs a program per tile in numpy: few, large tiles are fastest
        return 32, 128, min(128, triton.next_power_of_2(H))
    return 64, 128, 64


def linear_logprob_forward(hidden, weight, target_ids, bias, temperature, softcap, return_entropy):
    """hidden [N, H], weight [V, H], target_ids [N] -> (logps, entropy or None, m, log_s), each [N] fp32."""
    n, h = hidden.shape
    v = weight.shape[0]
    assert hidden.stride(1) == 1 and weight.stride(1) == 1, "hidden and weight need unit stride along H"
    dev = hidden.device
    logps = torch.empty(n, dtype=torch.float32, device=dev)
    ent = torch.empty(n, dtype=torch.float32, device=dev) if return_entropy else logps
    m = torch.empty(n, dtype=torch.float32, device=dev)
    log_s = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return logps, (ent if return_entropy else None), m, log_s
    block_n, block_v, block_h = _blocks(h)
    _linear_logprob_fwd[(triton.cdiv(n, block_n),)](
        hidden, weight, weight if bias is None else bias, target_ids, logps, ent, m, log_s,
        n, v, h, hidden.stride(0), weight.stride(0), 1.0 / temperature, 1.0 if softcap is None else softcap,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, RETURN_ENTROPY=return_entropy,
        UPCAST=triton_interpreting() or hidden.dtype == torch.float32,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h,
    )
    return logps, (ent if return_entropy else None), m, log_s


def linear_logprob_dlogits(h_rows, w_chunk, bias_chunk, y_local, stats, g, ge, temperature, softcap, out_dtype):
    """``dz [R, C]`` for a slab of rows against one vocab chunk; y_local = target id - chunk start (may be out of
    range: then no one-hot in this chunk). stats: ``[R, 3]`` fp32 (m, log s, entropy)."""
    r, h = h_rows.shape
    c = w_chunk.shape[0]
    dz = torch.empty(r, c, dtype=out_dtype, device=h_rows.device)
    block_n, block_v, block_h = _blocks(h)
    grid = (triton.cdiv(r, block_n), triton.cdiv(c, block_v))
    dummy = stats
    _linear_logprob_dlogits[grid](
        h_rows, w_chunk, dummy if bias_chunk is None else bias_chunk, y_local, stats,
        dummy if g is None else g, dummy if ge is None else ge, dz,
        r, c, h, h_rows.stride(0), w_chunk.stride(0), 1.0 / temperature, 1.0 if softcap is None else softcap,
        HAS_BIAS=bias_chunk is not None, HAS_SOFTCAP=softcap is not None, HAS_G=g is not None, HAS_GE=ge is not None,
        UPCAST=triton_interpreting() or h_rows.dtype == torch.float32,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h,
    )
    return dz
