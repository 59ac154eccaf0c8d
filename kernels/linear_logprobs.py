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

Specialisations. Every constexpr combination is a separate compile on the user's GPU (and in the static gate,
``bench/kernel_report.py``), so only what changes the code's cost is a constexpr: the input dtype, RETURN_ENTROPY
(the forward's extra sum) and the tile configuration. Bias, softcap and which upstream gradients exist are runtime
flags (uniform branches: a handful of elementwise ops per tile next to the ``tl.dot``). Sizes (N, V, R, C) only mask,
so Triton does not specialise them; H and the row strides keep Triton's divisibility-by-16 specialisation (vector
loads), as do the pointers (16-byte alignment). Per input dtype a launcher therefore produces 2 forward and 1
backward specialisations, times aligned / unaligned inputs.

Launch configurations (tiles, warps, stages) come from ``CONFIGS``, keyed on the GPU family (``launch.Target.family``)
and the input dtype; each entry is held by the static gate to zero spills, shared memory within the family's limit and
tensor-core instructions on every target of the family. float32 inputs reach these kernels on a GPU only when the user
allowed TF32 matmuls (``grpo_fast.dispatch``): their ``tl.dot`` then runs in TF32, like cuBLAS would.

Limits: the grid is ``cdiv(N, BLOCK_N)`` programs on axis 0 (no 65535 limit); element offsets are int64 (V * H may
exceed 2^31). Under TRITON_INTERPRET=1 tiles are upcast to fp32 before an IEEE ``tl.dot`` (UPCAST), since the
interpreter's bf16 dot is wrong, and the interpreter gets few large tiles (it runs one program per tile in numpy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from grpo_fast import dispatch
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.kernels.launch import capturing, current_target, launch


@triton.jit
def _tanh(x):
    # tanh from exp: 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 at large |x|
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap, has_bias, has_softcap,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Shaped fp32 logits ``[BLOCK_N, BLOCK_V]`` (-inf past V) and tanh(raw / softcap) for the chain rule.
    ``rn`` and ``rv`` are int64 (``rv * stride_w`` reaches V * H)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        hmask = rh < H
        a = tl.load(h_ptr + rn[:, None] * stride_h + rh[None, :], mask=nmask[:, None] & hmask[None, :], other=0.0)
        b = tl.load(w_ptr + rv[:, None] * stride_w + rh[None, :], mask=vmask[:, None] & hmask[None, :], other=0.0)
        if UPCAST:  # under the interpreter: exact fp32 products
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:  # bf16 / fp16 tensor-core dot (fp32 inputs: TF32), fp32 accumulation
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if has_bias:
        acc += tl.load(b_ptr + rv, mask=vmask, other=0.0).to(tl.float32)[None, :]
    u = acc
    if has_softcap:
        u = _tanh(acc / softcap)
        acc = softcap * u
    z = acc * inv_temp
    z = tl.where(vmask[None, :], z, float("-inf"))
    return z, u


@triton.jit(do_not_specialize=["N", "V", "has_bias", "has_softcap"])
def _linear_logprob_fwd(
    h_ptr,  # [N, H] hidden, row stride stride_h
    w_ptr,  # [V, H] weight, row stride stride_w
    b_ptr,  # [V] bias (read when has_bias)
    y_ptr,  # [N] int64 target ids
    logp_ptr,  # [N] fp32 out
    ent_ptr,  # [N] fp32 out (RETURN_ENTROPY)
    m_ptr,  # [N] fp32 out: running max
    logs_ptr,  # [N] fp32 out: log sum exp(z - m)
    N, V, H, stride_h, stride_w, inv_temp, softcap,
    has_bias,  # int 0/1
    has_softcap,  # int 0/1
    RETURN_ENTROPY: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
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
        rv = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        vmask = rv < V
        z, u = _logits_tile(h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap,
                            has_bias, has_softcap, UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H)
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


@triton.jit(do_not_specialize=["R", "C", "has_bias", "has_softcap", "has_g", "has_ge"])
def _linear_logprob_dlogits(
    h_ptr,  # [R, H] hidden rows of this slab
    w_ptr,  # [C, H] weight rows of this vocab chunk
    b_ptr,  # [C] bias of this chunk (read when has_bias)
    y_ptr,  # [R] target ids, already shifted by the chunk start
    stat_ptr,  # [R, 3] fp32: m, log s, entropy
    g_ptr,  # [R] fp32 d loss / d logp (read when has_g)
    ge_ptr,  # [R] fp32 d loss / d entropy (read when has_ge)
    dz_ptr,  # [R, C] out: d loss / d raw logits, in dz_ptr's dtype
    R, C, H, stride_h, stride_w, inv_temp, softcap,
    has_bias, has_softcap, has_g, has_ge,  # ints 0/1
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    nmask = rn < R
    vmask = rv < C
    z, u = _logits_tile(h_ptr, w_ptr, b_ptr, rn, rv, nmask, vmask, H, stride_h, stride_w, inv_temp, softcap,
                        has_bias, has_softcap, UPCAST, PRECISION, BLOCK_N, BLOCK_V, BLOCK_H)
    m = tl.load(stat_ptr + rn * 3, mask=nmask, other=0.0)
    log_s = tl.load(stat_ptr + rn * 3 + 1, mask=nmask, other=0.0)
    logp = (z - m[:, None]) - log_s[:, None]
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    if has_ge:
        ent = tl.load(stat_ptr + rn * 3 + 2, mask=nmask, other=0.0)
        ge = tl.load(ge_ptr + rn, mask=nmask, other=0.0)
        dz -= p * tl.where(vmask[None, :], logp + ent[:, None], 0.0) * ge[:, None]
    if has_g:
        g = tl.load(g_ptr + rn, mask=nmask, other=0.0)
        y = tl.load(y_ptr + rn, mask=nmask, other=-1)
        onehot = (rv[None, :] == y[:, None]).to(tl.float32)
        dz += g[:, None] * (onehot - p)
    dz = dz * inv_temp
    if has_softcap:
        dz = dz * (1.0 - u * u)
    out_mask = nmask[:, None] & vmask[None, :]
    tl.store(dz_ptr + rn[:, None] * C + rv[None, :], dz.to(dz_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: a ``[BLOCK_N, BLOCK_V]`` logits tile built from ``BLOCK_H``-wide slices of H."""

    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int


# (GPU family, "16bit" | "tf32" | "ieee", aligned) -> (forward, backward dz) configurations. Every entry passes the static
# gate on every target of its family (bench/kernel_report.py, tests/test_kernel_gate.py): no spills, shared memory
# within the per-block limit, tensor-core instructions. Chosen by compiling candidates through the gate, not tuned on
# hardware (no GPU has run them yet). 8 warps keep the fp32 [BLOCK_N, BLOCK_V] tile and its exp temporaries under
# the register cap where 4 warps sit at 255 registers (sm_80, sm_90a) or spill (sm_120). Unaligned inputs (a
# misaligned ``hidden`` view, H or a row stride not a multiple of 16) load element by element, which costs registers
# for addresses: a 32-wide H slice keeps them spill-free on sm_80/86/89 and CDNA. fp32 tiles are twice the bytes of
# 16-bit ones: with a TF32 dot the 32-wide slice keeps three stages within 99 KiB of shared memory; an IEEE fp32 dot
# (no tensor cores: FMAs from registers) spilled 8-144 bytes at 64 x 128 x 32 on every NVIDIA target and spills
# nothing at 64 x 32 x 16 without software pipelining (64 x 64 x 16 still spilled 8-32 bytes on sm_86/89/90a).
# sm_100a caps these kernels at 128 registers a thread: the 16-bit forward without entropy spilled 24 bytes at 3
# stages and spills nothing at 4 (98 KiB of its 227 KiB).
_WIDE = TileConfig(64, 128, 64, 8, 3)
_NARROW = TileConfig(64, 128, 32, 8, 3)
_IEEE = TileConfig(64, 32, 16, 8, 1)
CONFIGS: dict[tuple[str, str, bool], tuple[TileConfig, TileConfig]] = {
    (family, kind, aligned): (cfg, cfg)
    for family in dispatch.GATED_FAMILIES
    for kind, aligned, cfg in (("16bit", True, _WIDE), ("16bit", False, _NARROW), ("tf32", True, _NARROW),
                               ("tf32", False, _NARROW), ("ieee", True, _IEEE), ("ieee", False, _IEEE))
}
CONFIGS[("sm100", "16bit", True)] = (TileConfig(64, 128, 64, 8, 4),) * 2
_INTERPRET_BLOCKS = (32, 128, 128)  # the interpreter runs one program per tile in numpy: few, large tiles are fastest


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether Triton specialises every pointer and row stride of these ``[rows, H]`` tensors (and H) as divisible by
    16 (bytes for pointers, elements for strides), i.e. whether it can vectorise their loads."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.shape[-1] % 16 == 0 for t in tensors)


def tile_configs(device: torch.device, dtype: torch.dtype, h: int, is_aligned: bool,
                 precision: str | None) -> tuple[TileConfig, TileConfig]:
    """The (forward, backward) launch configurations for inputs of ``dtype``, hidden size ``h`` and alignment on
    ``device``; float32 by the dot's ``precision`` (from ``_precision``)."""
    if triton_interpreting() and not capturing():
        block_n, block_v, block_h = _INTERPRET_BLOCKS
        cfg = TileConfig(block_n, block_v, min(block_h, triton.next_power_of_2(h)), 4, 1)
        return cfg, cfg
    kind = precision if dtype == torch.float32 else "16bit"
    return CONFIGS[(current_target(device).family, kind, is_aligned)]


def _precision(device: torch.device, dtype: torch.dtype) -> tuple[bool, str | None]:
    """(UPCAST, PRECISION): the interpreter's exact fp32 dot; else the hardware dot: 16-bit inputs at the backend's
    default; fp32 inputs in TF32 when the user allowed TF32 (``dispatch.tf32_allowed``, PyTorch's own switches) and
    the target has it (CDNA2 has not), else exact IEEE fp32 (no tensor cores: ``auto`` sends that case to cuBLAS)."""
    if triton_interpreting() and not capturing():
        return True, "ieee"
    if dtype != torch.float32:
        return False, None
    target = current_target(device)
    tf32 = dispatch.tf32_allowed() and (target.backend, target.arch) != ("hip", "gfx90a")
    return False, "tf32" if tf32 else "ieee"


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
    upcast, precision = _precision(dev, hidden.dtype)
    cfg = tile_configs(dev, hidden.dtype, h, aligned(hidden, weight), precision)[0]
    launch(
        _linear_logprob_fwd, (triton.cdiv(n, cfg.block_n),),
        hidden, weight, weight if bias is None else bias, target_ids, logps, ent, m, log_s,
        n, v, h, hidden.stride(0), weight.stride(0), 1.0 / temperature, 1.0 if softcap is None else softcap,
        int(bias is not None), int(softcap is not None),
        RETURN_ENTROPY=return_entropy, UPCAST=upcast, PRECISION=precision,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return logps, (ent if return_entropy else None), m, log_s


def linear_logprob_dlogits(h_rows, w_chunk, bias_chunk, y_local, stats, g, ge, temperature, softcap, out_dtype):
    """``dz [R, C]`` for a slab of rows against one vocab chunk; y_local = target id - chunk start (may be out of
    range: then no one-hot in this chunk). stats: ``[R, 3]`` fp32 (m, log s, entropy)."""
    r, h = h_rows.shape
    c = w_chunk.shape[0]
    dz = torch.empty(r, c, dtype=out_dtype, device=h_rows.device)
    upcast, precision = _precision(h_rows.device, h_rows.dtype)
    cfg = tile_configs(h_rows.device, h_rows.dtype, h, aligned(h_rows, w_chunk), precision)[1]
    dummy = stats
    launch(
        _linear_logprob_dlogits, (triton.cdiv(r, cfg.block_n), triton.cdiv(c, cfg.block_v)),
        h_rows, w_chunk, dummy if bias_chunk is None else bias_chunk, y_local, stats,
        dummy if g is None else g, dummy if ge is None else ge, dz,
        r, c, h, h_rows.stride(0), w_chunk.stride(0), 1.0 / temperature, 1.0 if softcap is None else softcap,
        int(bias_chunk is not None), int(softcap is not None), int(g is not None), int(ge is not None),
        UPCAST=upcast, PRECISION=precision, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dz
