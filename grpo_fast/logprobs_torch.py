"""Per-token log-probs (and entropy) straight from hidden states, in pure PyTorch, without an ``N x V`` logits tensor.

Computes, for every token ``n``, what :func:`grpo_fast.reference.logprobs_reference` computes through materialised
logits::

    z = (hidden @ weight.T).float() (+ bias);  z = softcap * tanh(z / softcap) if softcap;  z = z / temperature
    logp[n] = log_softmax(z)[n, y[n]];  entropy[n] = -sum_v softmax(z)[n, v] * log_softmax(z)[n, v]

Algorithm. The forward walks token blocks (outer) and vocab chunks (inner). Each ``[T, C]`` tile of logits is made by
one matmul in the input dtype (as an lm_head would), then cast to fp32 (fp64 for fp64 inputs) for the shaping and an
online logsumexp: a running max ``m`` (starting at -inf), a running ``s = sum exp(z - m)`` and, for the entropy,
``t = sum exp(z - m) * (z - m)``, both rescaled when the max moves, plus the target logit when it falls in the chunk.
``s`` and ``t`` carry across chunks in float64 (``[T]`` vectors: free), so the result does not drift with the number of
vocab chunks. ``logp = (z[y] - m) - log s`` and ``entropy = log s - t / s`` never subtract two large numbers, so logits
offset by 1e4 lose nothing; ``m`` and ``log s`` are saved apart (not as one ``lse``) so the backward's
``p = exp((z - m) - log s)`` keeps that property. The backward (custom autograd, ``grpo_fast.ops``) recomputes each
tile, forms ``dz`` and multiplies it into ``dh = dz @ W``, ``dW = dz^T @ h`` and ``db = sum dz``, walking vocab chunks
(outer) and token blocks (inner) so each ``dW`` chunk is accumulated over all tokens and written once.

The contract. ``forward`` / ``backward`` / ``stats_dtype`` here and in ``grpo_fast.kernels.linear_logprobs`` (the GPU
path) have the same signatures and meaning (``grpo_fast.logprob_contract``); ``grpo_fast.ops`` calls whichever
``impl`` names.

Memory. Saved for backward: the inputs (no copies) and three ``[N]`` vectors (max, log-sum, entropy). Temporaries:
about three fp32 tiles of ``token_chunk x vocab_chunk``, a ``[vocab_chunk, H]`` fp32 ``dW`` accumulator and
``[token_chunk, H]`` row buffers, sized from the temporaries budget the GPU path keeps to (``scratch_bytes()``,
``GRPO_FAST_SCRATCH_MIB``: a tile at most an eighth of it, 8 MiB at the default 64 MiB, the others a quarter each;
``grpo_fast.kernels.logprob_layout.torch_chunks``), and, for bf16/fp16 inputs, an fp32 ``[N, H]`` ``dh``
accumulator. Never an ``N x V`` tensor, never an fp32 copy of a bf16/fp16 weight (chunks are cast one at a time).
Traffic: the forward reads ``W`` once per token block and the backward once per vocab chunk sweep per token block, i.e.
three ``2 N V H``-FLOP matmuls in all, like the unfused lm_head forward and backward.

Limits. Rows whose upstream gradients (log-prob and entropy) are both exactly zero cost no backward matmul work, but
for the logits of a token block that also holds live rows (recomputed whole, so they match the forward's bit for bit);
a block with no live row, or a fully zero upstream gradient, is skipped. No double backward. Host-side Python loops
over cache-sized tiles: meant for CPU, not as the GPU path (``grpo_fast.kernels.linear_logprobs``: the same
mathematics, as cuBLAS GEMMs over vocabulary chunks and two memory-bound kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_fast.kernels.logprob_layout import torch_chunks
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the forward's ``[N]`` outputs for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_sizes(n: int, v: int, h: int, params: LogprobParams) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)``: explicit values as given, else from the budget (``torch_chunks``)."""
    return torch_chunks(n, v, h, params.budget_bytes(), params.vocab_chunk, params.token_chunk)


def _tile(h_rows: Tensor, w_c: Tensor, bias_c: Tensor | None, params: LogprobParams, acc_dtype: torch.dtype,
          keep_tanh: bool):
    """Shaped logits ``z [T, C]`` (``acc_dtype``) of ``h_rows [T, H]`` against ``w_c [C, H]``, and
    ``tanh(z_raw/softcap)``.

    The matmul runs in the input dtype, like the lm_head it replaces; the cast and everything after it in ``acc_dtype``.
    """
    x = (h_rows @ w_c.t()).to(acc_dtype)
    if bias_c is not None:
        x.add_(bias_c)
    u = None
    if params.softcap is not None:
        if keep_tanh:
            u = x.div_(params.softcap).tanh_()
            x = u * params.softcap
        else:
            x.div_(params.softcap).tanh_().mul_(params.softcap)
    if params.temperature != 1.0:
        x.div_(params.temperature)
    return x, u


def _target_in_chunk(y: Tensor, c0: int, c: int) -> tuple[Tensor, Tensor]:
    """``(in_chunk [T] bool, local column [T, 1])`` of targets ``y [T]`` in the vocab chunk ``[c0, c0 + c)``."""
    local = y - c0
    in_chunk = (local >= 0) & (local < c)
    return in_chunk, local.clamp(0, c - 1).unsqueeze(1)


def forward(hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Tensor | None, params: LogprobParams):
    """``(logps, entropy or None, m, log_s)``, all ``[N]`` in ``stats_dtype``; ``lse = m + log_s``. hidden ``[N, H]``,
    weight ``[V, H]``, target_ids ``[N]`` int64, bias ``[V]`` or None."""
    n, h = hidden.shape
    v = weight.shape[0]
    acc_dtype = stats_dtype(hidden.dtype)
    token_chunk, vocab_chunk = _tile_sizes(n, v, h, params)
    want_ent = params.return_entropy
    lowest = torch.finfo(torch.float64).min
    logps = torch.empty(n, dtype=acc_dtype, device=hidden.device)
    ent = torch.empty(n, dtype=acc_dtype, device=hidden.device) if want_ent else None
    m_all = torch.empty(n, dtype=acc_dtype, device=hidden.device)
    logs_all = torch.empty(n, dtype=acc_dtype, device=hidden.device)
    bias_acc = None if bias is None else bias.to(acc_dtype)
    for t0 in range(0, n, token_chunk):
        t1 = min(t0 + token_chunk, n)
        h_blk, y_blk = hidden[t0:t1], target_ids[t0:t1]
        m = torch.full((t1 - t0,), float("-inf"), dtype=acc_dtype, device=hidden.device)
        zy = torch.zeros_like(m)
        # The running sums cross chunks in float64: [T] vectors, so free, and the result does not drift with the
        # number of vocab chunks (each chunk's own sum is a vectorised fp32 reduction, as in log_softmax).
        s = torch.zeros(t1 - t0, dtype=torch.float64, device=hidden.device)
        t = torch.zeros_like(s)  # sum exp(z - m) * (z - m)
        for c0 in range(0, v, vocab_chunk):
            c1 = min(c0 + vocab_chunk, v)
            z, _ = _tile(h_blk, weight[c0:c1], None if bias_acc is None else bias_acc[c0:c1], params, acc_dtype,
                         False)
            in_chunk, col = _target_in_chunk(y_blk, c0, c1 - c0)
            zy = torch.where(in_chunk, z.gather(1, col).squeeze(1), zy)
            m_new = torch.maximum(m, z.amax(1))
            delta = (m - m_new).double()  # <= 0; -inf on the first chunk, where s = t = 0
            alpha = delta.exp()
            zm = z.sub_(m_new.unsqueeze(1))
            if want_ent:
                e = zm.exp()
                # t' = sum_old e^(z - m_new) (z - m_new) = alpha * (t + delta * s); clamp keeps -inf * 0 out.
                dot = torch.bmm(e.unsqueeze(1), zm.unsqueeze(2)).view(-1)
                t = alpha * (t + delta.clamp(min=lowest) * s) + dot
            else:
                e = zm.exp_()
            s = alpha * s + e.sum(1)
            m = m_new
            del z, zm, e
        log_s = s.log()
        logps[t0:t1] = (zy - m) - log_s
        m_all[t0:t1] = m
        logs_all[t0:t1] = log_s
        if want_ent:
            ent[t0:t1] = log_s - t / s
    return logps, ent, m_all, logs_all


def _active_blocks(active: Tensor, token_chunk: int):
    """Token blocks holding at least one active row: ``(t0, t1, idx)`` with ``idx`` None when the whole block is."""
    n = active.shape[0]
    idx_all = active.nonzero().squeeze(1)
    starts = torch.arange(0, n, token_chunk, device=active.device)
    bounds = torch.searchsorted(idx_all, torch.cat([starts, starts.new_tensor([n])])).tolist()
    blocks = []
    for i, t0 in enumerate(range(0, n, token_chunk)):
        t1 = min(t0 + token_chunk, n)
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        blocks.append((t0, t1, None if hi - lo == t1 - t0 else idx_all[lo:hi]))
    return blocks


def _select_rows(x: Tensor | None, t0: int, t1: int, idx: Tensor | None) -> Tensor | None:
    if x is None:
        return None
    return x[t0:t1] if idx is None else x.index_select(0, idx)


def _tile_grad(h_blk, rows, w_c, bias_c, y_r, g_r, ge_r, m_r, logs_r, ent_r, c0, c1, params, acc_dtype):
    """``dz [R, C]`` (``acc_dtype``): d loss / d raw logits of the rows ``rows`` (block-local indices, None for all)
    of the token block ``h_blk [T, H]`` against the vocab chunk ``[c0, c1)``.

    ``dz = g (onehot - p) - ge p (log p + e)`` (e the entropy), divided by the temperature and times
    ``1 - tanh^2`` under softcap.
    m_r, logs_r, ent_r: ``[R, 1]``; g_r, ge_r: ``[R]`` or None.

    The logits are recomputed for the whole block, as the forward made them: a matmul of another shape may sum in
    another order (BLAS picks its kernel by shape), and ``p`` and ``log p + e`` must come from the very logits the
    saved ``m``, ``log s`` and entropy came from, or the entropy term's cancellation turns last-bit differences into
    gradient error (8x PyTorch's own on an AVX-512 CPU, rows picked from a block of 6). Only the rows asked for go on.
    """
    z, u = _tile(h_blk, w_c, bias_c, params, acc_dtype, True)
    if rows is not None:
        z = z.index_select(0, rows)
        u = None if u is None else u.index_select(0, rows)
    logp = z.sub_(m_r).sub_(logs_r)  # (z - m) - log s, exact at large logit offsets
    p = logp.exp()
    if ge_r is not None:
        coef = logp.add_(ent_r).mul_(ge_r.unsqueeze(1))
        if g_r is not None:
            coef.add_(g_r.unsqueeze(1))
        dz = p.mul_(coef).neg_()
    else:
        dz = p.mul_(g_r.unsqueeze(1)).neg_()
    del z, logp
    if g_r is not None:
        in_chunk, col = _target_in_chunk(y_r, c0, c1 - c0)
        dz.scatter_add_(1, col, torch.where(in_chunk, g_r, 0.0).unsqueeze(1))
    if params.temperature != 1.0:
        dz.div_(params.temperature)
    if u is not None:  # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
        dz.mul_(u.square_().neg_().add_(1.0))
    return dz


def backward(hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Tensor | None, params: LogprobParams,
             grads: BackwardInputs):
    """``(d hidden, d weight, d bias)`` of ``sum(g * logp + ge * entropy)``, those ``grads`` asks for (None for the
    others). Rows whose g and ge are both zero cost no dh/dW work (module docstring: Limits)."""
    m_all, logs_all, ent = grads.saved.m, grads.saved.log_s, grads.saved.entropy
    g, ge = grads.g, grads.ge
    need_hidden, need_weight, need_bias = grads.need_hidden, grads.need_weight, grads.need_bias
    n, h = hidden.shape
    v = weight.shape[0]
    dtype = hidden.dtype
    acc_dtype = stats_dtype(dtype)
    in_place = dtype == acc_dtype  # fp32/fp64: accumulate straight into the gradient tensors with addmm_
    token_chunk, vocab_chunk = _tile_sizes(n, v, h, params)

    active = torch.zeros(n, dtype=torch.bool, device=hidden.device)
    if g is not None:
        g = g.to(acc_dtype)
        active |= g != 0
    if ge is not None:
        ge = ge.to(acc_dtype)
        active |= ge != 0
    blocks = _active_blocks(active, token_chunk) if n else []

    dh = torch.zeros(n, h, dtype=acc_dtype, device=hidden.device) if need_hidden else None
    gw = torch.zeros_like(weight) if need_weight else None
    db = torch.zeros(v, dtype=acc_dtype, device=hidden.device) if need_bias else None
    if not blocks:  # every upstream gradient is exactly zero
        return (None if dh is None else dh.to(dtype)), gw, (None if db is None else db.to(bias.dtype))

    bias_acc = None if bias is None else bias.to(acc_dtype)
    # Per-block row data, selected once: [T] vectors only (hidden rows are selected per tile, never all at once).
    block_rows = []
    for t0, t1, idx in blocks:
        block_rows.append((t0, t1, idx, _select_rows(target_ids, t0, t1, idx), _select_rows(g, t0, t1, idx),
                           _select_rows(ge, t0, t1, idx), _select_rows(m_all, t0, t1, idx).unsqueeze(1),
                           _select_rows(logs_all, t0, t1, idx).unsqueeze(1),
                           None if ge is None else _select_rows(ent, t0, t1, idx).unsqueeze(1)))

    for c0 in range(0, v, vocab_chunk):
        c1 = min(c0 + vocab_chunk, v)
        w_c = weight[c0:c1]
        # dW chunk: fp32/fp64 rows of grad_weight itself, else one fp32 [C, H] buffer written once at the end.
        dw_c = None
        if need_weight:
            dw_c = gw[c0:c1] if in_place else torch.zeros(c1 - c0, h, dtype=acc_dtype, device=hidden.device)
        for t0, t1, idx, y_r, g_r, ge_r, m_r, logs_r, ent_r in block_rows:
            h_r = _select_rows(hidden, t0, t1, idx)
            dz = _tile_grad(hidden[t0:t1], None if idx is None else idx - t0, w_c,
                            None if bias_acc is None else bias_acc[c0:c1], y_r, g_r, ge_r, m_r, logs_r, ent_r, c0, c1,
                            params, acc_dtype)
            if need_bias:
                db[c0:c1] += dz.sum(0)
            # fp32/fp64 inputs: matmuls in that dtype, accumulated in place (addmm_). bf16/fp16 inputs: dz is cast
            # to the input dtype so the matmuls run on the fast low-precision path (as Liger and TRL do), and each
            # product comes back into an fp32 accumulator; no fp32 copy of W or of hidden is ever made.
            dz_mm = dz if in_place else dz.to(dtype)
            del dz
            if need_hidden:
                if idx is None:
                    if in_place:
                        dh[t0:t1].addmm_(dz_mm, w_c)
                    else:
                        dh[t0:t1] += torch.mm(dz_mm, w_c)  # in-place promotion: no fp32 copy of the product
                else:
                    dh.index_add_(0, idx, torch.mm(dz_mm, w_c).to(acc_dtype))  # index_add_ wants one dtype
            if need_weight:
                if in_place:
                    dw_c.addmm_(dz_mm.t(), h_r)
                else:
                    dw_c += torch.mm(dz_mm.t(), h_r)
            del dz_mm, h_r
        if need_weight and not in_place:
            gw[c0:c1] = dw_c
        del dw_c

    grad_h = None if dh is None else (dh if in_place else dh.to(dtype))
    grad_b = None if db is None else db.to(bias.dtype)
    return grad_h, gw, grad_b
