"""GRPO per-token loss, ``d loss / d logp`` and metric sums for every loss type, one program per sequence.

Computes what ``grpo_fast.loss_torch.grpo_loss_terms`` computes (TRL 1.16 semantics, and verl 0.9.1's per-token
terms for dppo_tv, dppo_kl, gpg, dro: docs/design.md §4): each program
owns one row b of the ``[B, T]`` inputs and walks T in BLOCK_T blocks, in up to three passes:
  1. the row's token count and, for sequence-level importance sampling / VESPO, the sums of log-ratios;
  2. per token: the ratio, the policy term, the KL, the weighted loss, ``d loss / d logp`` (direct part and
     ``d loss / d r``), and the metric flags; row partial sums go to ``row_out [B, ROW_COLS]``;
  3. sequence level only: adds ``r_b * sum_t(d loss / d r_t) * m_t / len_b`` to ``d loss / d logp``.
The host sums ``row_out`` over B (deterministic: no atomics). Memory traffic: each ``[B, T]`` input is read once per
pass (twice or three times for sequence level), ``dlogp`` written once (read-modify-written in pass 3).
Limits: any B, T (the grid is B programs on axis 0); runs in float32, or float64 for float64 inputs.

Specialisations. Each is a separate compile on the user's GPU (seconds) and in the static gate
(``bench/kernel_report.py``), so nothing that only selects a formula is a constexpr: the loss type, the
importance-sampling level, the normalisation and every optional input are runtime ints (uniform branches: the whole
program takes the same side, and this kernel is memory-bound), Triton does not specialise them
(``do_not_specialize``), and absent tensors are never read. BLOCK_T is fixed per dtype (512 for float32, 256 for
float64: at 2 float64 elements a thread the 8-warp launch's 128-register cap spilled on sm_90a, sm_100a, sm_120 once
the verl losses' branches were added), so T only masks; T keeps Triton's own
specialisation (divisible by 16: aligned row starts, vector loads; equal to 1: a constant). Per input dtype (float32,
float64) the launcher therefore produces 3 specialisations: T % 16 == 0, T == 1, any other T (times 16-byte-aligned
or unaligned pointers, which only a misaligned view brings; the launcher's own buffers are aligned).

Precision. A Python float reaches a compiled kernel as an fp32 argument (the interpreter passes a double), so the
hyper-parameters are ``tl.float64`` arguments and each is rounded to the compute dtype in the kernel, as PyTorch rounds
a Python scalar to a tensor's dtype; SAPO's temperatures and VESPO's k and lambda are passed at the precision
``torch.where`` gives them in the torch path and TRL (the default dtype, float32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from grpo_fast.config import LossType
from grpo_fast.kernels.launch import launch
from grpo_fast.loss_torch import LossTerms, entropy_bonus, high_entropy_mask, loss_scale

# loss_type codes: the formula the kernel takes (the launcher maps a LossType by name, whatever LossType's order)
CLIP = tl.constexpr(0)  # the clip family: grpo, bnpo, dr_grpo, dapo, luspo
CISPO = tl.constexpr(1)
SAPO = tl.constexpr(2)
VESPO = tl.constexpr(3)
DPPO_TV = tl.constexpr(4)
DPPO_KL = tl.constexpr(5)
GPG = tl.constexpr(6)
DRO = tl.constexpr(7)
# the columns of row_out: one row of partial sums per sequence, summed over B by the launcher
ROW_LOSS = tl.constexpr(0)
ROW_KL = tl.constexpr(1)
ROW_LOW = tl.constexpr(2)
ROW_HIGH = tl.constexpr(3)
ROW_REGION = tl.constexpr(4)
ROW_TOKENS = tl.constexpr(5)
ROW_COLS = tl.constexpr(6)
LOG_1E8 = tl.constexpr(math.log(1e-8))  # VESPO's lower clamp of log-weights (TRL: log(1e-8))
# One tile width for every T, 512 over 8 warps: docs/kernels.md, "Tile choices" (why, and what the static gate found).
BLOCK_T = 512
BLOCK_T_FP64 = 256  # float64: 1 element a thread (at 2, the 8-warp launch's 128-register cap spills on sm_90a+)
NUM_WARPS = 8
SPECIALISATIONS_PER_DTYPE = 3  # T % 16 == 0, T == 1, any other T (see the header)


# The per-token terms, one helper per term of grpo_fast.loss_torch, same names, same order. Each policy term returns
# (P, dP/dr, dP/dlogp at fixed r); the hyper-parameters come in the compute dtype.
@triton.jit
def _clip_term(r, adv, clip_low, clip_high, delta):
    """``loss_torch._clip_term``: the clip family's ``-min(r1 A, r2 A)``, ``r1 = min(r, delta)``, ``r2 = clamp(r,
    clip_low, clip_high)``, with autograd's tie rule (half the gradient to each side) and clamp's (it passes at the
    bounds)."""
    r2 = tl.minimum(tl.maximum(r, clip_low), clip_high)
    dr2 = ((r >= clip_low) & (r <= clip_high)).to(r.dtype)
    r1 = tl.where(r > delta, delta, r)  # min(r, delta); delta = +inf leaves r (NaN included) unchanged
    dr1 = (r <= delta).to(r.dtype)
    a = r1 * adv
    b = r2 * adv
    take_a = tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0)).to(r.dtype)
    policy = -tl.minimum(a, b)
    dp_dr = -(take_a * adv * dr1 + (1.0 - take_a) * adv * dr2)
    return policy, dp_dr, tl.zeros(r.shape, r.dtype)


@triton.jit
def _cispo_term(r, adv, logp, eps_high):
    """``loss_torch._cispo_term``: ``-min(r, eps_high).detach() * A * logp`` (the capped ratio is a constant)."""
    c = tl.minimum(r, eps_high)
    return -c * adv * logp, tl.zeros(r.shape, r.dtype), -c * adv


@triton.jit
def _sapo_term(r, adv, tau_pos, tau_neg):
    """``loss_torch._sapo_term``: ``-sigmoid(tau (r - 1)) * 4 / tau * A``, tau by the sign of A."""
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    sig = 1.0 / (1.0 + tl.exp(-tau * (r - 1.0)))
    return -sig * 4.0 / tau * adv, -4.0 * adv * sig * (1.0 - sig), tl.zeros(r.shape, r.dtype)


@triton.jit
def _vespo_term(adv, logp, log_w, k_pos, lam_pos, k_neg, lam_neg):
    """``loss_torch._vespo_term``: ``-phi(w) * A * logp`` with ``phi`` detached (TRL's ``get_gamma_weights``) from the
    sequence's clamped log-weight ``log_w`` (pass 1, ``loss_torch._vespo_log_weight``); NaN and +-inf weights are 0.
    The lambdas come clamped at 1e-4 (the launcher)."""
    nonneg = adv >= 0
    k = tl.where(nonneg, k_pos, k_neg)
    lam = tl.where(nonneg, lam_pos, lam_neg)
    phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
    phi = tl.where(phi == phi, phi, 0.0)  # NaN -> 0
    phi = tl.where(tl.abs(phi) < float("inf"), phi, 0.0)
    return -phi * adv * logp, tl.zeros(adv.shape, adv.dtype), -phi * adv


@triton.jit
def _dppo_tv_valid(adv, logp, old, eps_low, eps_high):
    """``loss_torch._dppo_tv_valid``: verl's dppo_tv trust region, ``p - p_old <= eps_high`` where A > 0,
    ``p - p_old >= -eps_low`` elsewhere."""
    diff = tl.exp(logp) - tl.exp(old)
    return tl.where(adv > 0, diff <= eps_high, diff >= -eps_low)


@triton.jit
def _dppo_kl_valid(adv, logp, old, eps_low, eps_high, tiny):
    """``loss_torch._dppo_kl_valid``: verl's dppo_kl trust region on the binary KL (``tiny``: verl's 1e-8, in the
    compute dtype)."""
    prob = tl.exp(logp)
    old_prob = tl.exp(old)
    binary_kl = old_prob * (old - logp) + (1.0 - old_prob) * tl.log((1.0 - old_prob + tiny) / (1.0 - prob + tiny))
    pos = (binary_kl <= eps_high) | (prob <= old_prob)
    neg = (binary_kl <= eps_low) | (prob >= old_prob)
    return tl.where(adv > 0, pos, neg)


@triton.jit
def _dppo_term(log_ratio, adv, logp, valid, cap):
    """``loss_torch._dppo_term``: ``-A * min(exp(clamp(log_ratio, -20, 20)), cap).detach() * logp`` on the trust
    region's tokens (the truncated ratio is a constant)."""
    c = tl.minimum(tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0)), cap)
    coef = -adv * c * valid.to(adv.dtype)
    return coef * logp, tl.zeros(adv.shape, adv.dtype), coef


@triton.jit
def _gpg_term(adv, logp):
    """``loss_torch._gpg_term``: ``-A * logp``."""
    return -logp * adv, tl.zeros(adv.shape, adv.dtype), -adv


@triton.jit
def _dro_term(adv, logp, log_ratio, dro_beta):
    """``loss_torch._dro_term``: ``-(A logp - 0.5 dro_beta (logp - old)^2)``."""
    policy = -(logp * adv - 0.5 * dro_beta * (log_ratio * log_ratio))
    return policy, tl.zeros(adv.shape, adv.dtype), -(adv - dro_beta * log_ratio)


@triton.jit
def _kl_term(diff, r, beta, bias_kl, seq, loss, dl_dr, dl_dlogp):
    """``loss_torch._kl_term``: adds ``beta`` x the k3 KL (``diff = ref - logp``), times r with the bias correction, to
    the token's loss and its partials; returns the KL and the three sums. Token level: the bias-corrected gradient
    ``(dkl0 + kl0) r = -diff r`` in one term (apart, the exp(diff) terms cancel to their rounding error)."""
    e = tl.exp(diff)
    kl0 = e - diff - 1.0
    dkl0 = 1.0 - e
    if (bias_kl != 0) & (seq == 0):
        kl = kl0 * r
        dl_dlogp += beta * (-diff) * r
    elif bias_kl != 0:
        kl = kl0 * r
        dl_dr += beta * kl0
        dl_dlogp += beta * dkl0 * r
    else:
        kl = kl0
        dl_dlogp += beta * dkl0
    return kl, loss + beta * kl, dl_dr, dl_dlogp


@triton.jit
def _clip_flags(r, adv, clip_low, clip_high, delta):
    """``loss_torch._clip_flags``: the low / high clip-metric flags; TRL counts clipping on the delta-clamped ratio."""
    r_seen = tl.where(r > delta, delta, r)
    return (r_seen < clip_low) & (adv < 0), (r_seen > clip_high) & (adv > 0)


@triton.jit
def _cispo_flag(r, adv, eps_high):
    """``loss_torch._cispo_flag``: the ratio is capped (cispo's high clip-metric flag)."""
    return (r > eps_high) & (adv > 0)


@triton.jit(do_not_specialize=["B", "loss_type", "seq_level", "norm_global", "has_old", "has_kl", "bias_kl",
                               "adv_per_token", "has_ratio", "ratio_per_token", "has_ent_mask"])
def _grpo_loss_kernel(
    logp_ptr,  # [B, T] current log-probs
    old_ptr,  # [B, T] old log-probs (has_old)
    ref_ptr,  # [B, T] reference log-probs (has_kl)
    adv_ptr,  # [B] or [B, T] advantages (adv_per_token)
    mask_ptr,  # [B, T] completion mask, uint8
    ratio_ptr,  # [B, T] or [B] sampling ratios (has_ratio, ratio_per_token)
    ent_mask_ptr,  # [B, T] uint8 top-entropy mask (has_ent_mask)
    inv_norm_ptr,  # [] device scalar, 1 / normalizer (norm_global)
    dlogp_ptr,  # [B, T] out: d loss / d logp
    row_out_ptr,  # [B, ROW_COLS] out: loss and metric partial sums per row
    T,
    B,
    loss_type: tl.int32,  # CLIP, CISPO, SAPO, VESPO, DPPO_TV, DPPO_KL, GPG or DRO
    seq_level: tl.int32,
    norm_global: tl.int32,  # 0: w = m / (len_b * B); 1: w = m * inv_norm
    has_old: tl.int32,
    has_kl: tl.int32,
    bias_kl: tl.int32,
    adv_per_token: tl.int32,
    has_ratio: tl.int32,
    ratio_per_token: tl.int32,
    has_ent_mask: tl.int32,
    # hyper-parameters as float64 kernel arguments (a plain Python float would reach the GPU as fp32)
    clip_low: tl.float64,  # 1 - epsilon_low
    clip_high: tl.float64,  # 1 + epsilon_high
    eps_low: tl.float64,
    eps_high: tl.float64,
    delta: tl.float64,  # +inf without delta; dppo: its cap on the ratio (GRPOLossConfig.dppo_cap)
    beta: tl.float64,
    tau_pos: tl.float64,
    tau_neg: tl.float64,
    k_pos: tl.float64,
    lam_pos: tl.float64,
    k_neg: tl.float64,
    lam_neg: tl.float64,
    dro_beta: tl.float64,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    dtype = logp_ptr.dtype.element_ty
    log_1e8 = tl.full((), LOG_1E8, dtype)
    # the hyper-parameters in the compute dtype (tl.full also takes the Python float the interpreter passes)
    clip_low = tl.full((), clip_low, tl.float64).to(dtype)
    clip_high = tl.full((), clip_high, tl.float64).to(dtype)
    eps_high = tl.full((), eps_high, tl.float64).to(dtype)
    delta = tl.full((), delta, tl.float64).to(dtype)
    beta = tl.full((), beta, tl.float64).to(dtype)
    tau_pos = tl.full((), tau_pos, tl.float64).to(dtype)
    tau_neg = tl.full((), tau_neg, tl.float64).to(dtype)
    k_pos = tl.full((), k_pos, tl.float64).to(dtype)
    lam_pos = tl.full((), lam_pos, tl.float64).to(dtype)
    k_neg = tl.full((), k_neg, tl.float64).to(dtype)
    lam_neg = tl.full((), lam_neg, tl.float64).to(dtype)
    seq = seq_level != 0
    vespo = loss_type == VESPO
    # LossType.policy_through_ratio, or the bias-corrected KL at sequence level: something goes through r
    through_r = (loss_type == CLIP) | (loss_type == SAPO) | ((has_kl != 0) & (bias_kl != 0) & seq)

    # pass 1: token count, sum of log-ratios (sequence level), VESPO's clamped sums (loss_torch._vespo_log_weight)
    n_tok = tl.zeros((BLOCK_T,), dtype)
    lr_sum = tl.zeros((BLOCK_T,), dtype)
    vespo_sum = tl.zeros((BLOCK_T,), dtype)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < T
        m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
        n_tok += m.to(dtype)
        if seq | vespo:
            logp = tl.load(logp_ptr + base + offs, mask=m, other=0.0)
            old = logp
            if has_old != 0:
                old = tl.load(old_ptr + base + offs, mask=m, other=0.0)
            lr = tl.where(m, logp - old, 0.0)
            lr_sum += lr
            if vespo:
                vespo_sum += tl.minimum(tl.maximum(lr, -20.0), 20.0)
                if (has_ratio != 0) & (ratio_per_token != 0):  # TRL sums log(sampling ratio) over all T positions
                    sr = tl.load(ratio_ptr + base + offs, mask=inb, other=1.0)
                    vespo_sum += tl.where(inb, tl.minimum(tl.maximum(tl.log(sr), log_1e8), 20.0), 0.0)
    length = tl.sum(n_tok, 0)
    length_c = tl.maximum(length, 1.0)
    vespo_total = tl.sum(vespo_sum, 0)
    if vespo & (has_ratio != 0) & (ratio_per_token == 0):
        vespo_total += tl.minimum(tl.maximum(tl.log(tl.load(ratio_ptr + row)), log_1e8), 20.0)
    log_w = tl.minimum(tl.maximum(vespo_total, log_1e8), 20.0)
    if norm_global != 0:
        scale = tl.load(inv_norm_ptr)
    else:
        scale = 1.0 / (length_c * B)
    r_seq = tl.exp(tl.sum(lr_sum, 0) / length_c)

    # pass 2: per-token terms (loss_torch.grpo_loss_terms, step for step)
    loss_acc = tl.zeros((BLOCK_T,), dtype)
    kl_acc = tl.zeros((BLOCK_T,), dtype)
    # the metric flags are counted in int32 (one register a lane, where float64 takes two: the float64 kernel
    # spilled on sm_90a / sm_100a with them in the compute dtype)
    low_acc = tl.zeros((BLOCK_T,), tl.int32)
    high_acc = tl.zeros((BLOCK_T,), tl.int32)
    region_acc = tl.zeros((BLOCK_T,), tl.int32)
    gr_acc = tl.zeros((BLOCK_T,), dtype)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < T
        zero = tl.zeros((BLOCK_T,), dtype)
        m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
        logp = tl.load(logp_ptr + base + offs, mask=inb, other=0.0)
        old = logp
        if has_old != 0:
            old = tl.load(old_ptr + base + offs, mask=inb, other=0.0)
        if adv_per_token != 0:
            adv = tl.load(adv_ptr + base + offs, mask=inb, other=0.0)
        else:
            adv = zero + tl.load(adv_ptr + row)
        lr = tl.where(m, logp - old, 0.0)
        if seq:
            r = zero + r_seq
        else:
            r = tl.exp(lr)

        no_flag = zero != zero
        if loss_type == CLIP:
            policy, dp_dr, dp_dlogp = _clip_term(r, adv, clip_low, clip_high, delta)
            is_low, is_high = _clip_flags(r, adv, clip_low, clip_high, delta)
            is_region = is_low | is_high
        elif loss_type == CISPO:
            policy, dp_dr, dp_dlogp = _cispo_term(r, adv, logp, eps_high)
            is_low, is_high, is_region = no_flag, _cispo_flag(r, adv, eps_high), no_flag
        elif loss_type == SAPO:
            policy, dp_dr, dp_dlogp = _sapo_term(r, adv, tau_pos, tau_neg)
            is_low, is_high, is_region = no_flag, no_flag, no_flag
        elif (loss_type == DPPO_TV) | (loss_type == DPPO_KL):
            # converted here, where read (kept out of the loop's live registers: the float64 kernel spills else)
            eps_low_t = tl.full((), eps_low, tl.float64).to(dtype)
            if loss_type == DPPO_TV:
                valid = _dppo_tv_valid(adv, logp, old, eps_low_t, eps_high)
            else:
                tiny = tl.full((), 1e-8, tl.float64).to(dtype)  # verl's 1e-8, rounded as PyTorch rounds it
                valid = _dppo_kl_valid(adv, logp, old, eps_low_t, eps_high, tiny)
            policy, dp_dr, dp_dlogp = _dppo_term(lr, adv, logp, valid, delta)
            is_region = valid == 0  # outside the trust region (low: with A < 0, high: with A > 0)
            is_low, is_high = is_region & (adv < 0), is_region & (adv > 0)
        elif loss_type == GPG:
            policy, dp_dr, dp_dlogp = _gpg_term(adv, logp)
            is_low, is_high, is_region = no_flag, no_flag, no_flag
        elif loss_type == DRO:
            policy, dp_dr, dp_dlogp = _dro_term(adv, logp, lr, tl.full((), dro_beta, tl.float64).to(dtype))
            is_low, is_high, is_region = no_flag, no_flag, no_flag
        else:
            policy, dp_dr, dp_dlogp = _vespo_term(adv, logp, log_w, k_pos, lam_pos, k_neg, lam_neg)
            is_low, is_high, is_region = no_flag, no_flag, no_flag

        mult = zero + 1.0  # entropy mask x sampling ratio scale the policy term only
        if has_ent_mask != 0:
            em = tl.load(ent_mask_ptr + base + offs, mask=inb, other=0) != 0
            mult = mult * em.to(dtype)
        if (has_ratio != 0) & (loss_type != VESPO):
            if ratio_per_token != 0:
                sr = tl.load(ratio_ptr + base + offs, mask=inb, other=1.0)
            else:
                sr = zero + tl.load(ratio_ptr + row)
            mult = mult * sr
        loss_t = mult * policy
        dl_dr = mult * dp_dr
        dl_dlogp = mult * dp_dlogp
        if has_kl != 0:
            ref = tl.load(ref_ptr + base + offs, mask=inb, other=0.0)
            kl, loss_t, dl_dr, dl_dlogp = _kl_term(tl.where(m, ref - logp, 0.0), r, beta, bias_kl, seq_level, loss_t,
                                                   dl_dr, dl_dlogp)
            kl_acc += tl.where(m, kl, 0.0)

        loss_acc += tl.where(m, scale * loss_t, 0.0)
        g_r = tl.where(m, scale * dl_dr, 0.0)
        dlogp = tl.where(m, scale * dl_dlogp, 0.0)
        if through_r:  # else g_r is 0 (and 0 * r NaN where r overflows): loss_torch.grpo_loss_terms
            if seq:
                gr_acc += g_r * r
            else:
                dlogp += g_r * r
        tl.store(dlogp_ptr + base + offs, dlogp, mask=inb)
        low_acc += (m & is_low).to(tl.int32)
        high_acc += (m & is_high).to(tl.int32)
        region_acc += (m & is_region).to(tl.int32)

    if seq:
        # pass 3: d r_b / d logp_t = r_b * m_t / len_b
        coef = tl.sum(gr_acc, 0) / length_c
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            inb = offs < T
            m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
            d = tl.load(dlogp_ptr + base + offs, mask=inb, other=0.0)
            tl.store(dlogp_ptr + base + offs, d + tl.where(m, coef, 0.0), mask=inb)

    low_sum = tl.sum(low_acc, 0).to(dtype)
    high_sum = tl.sum(high_acc, 0).to(dtype)
    region_sum = tl.sum(region_acc, 0).to(dtype)
    if seq & (adv_per_token == 0):
        # one flag per sequence (TRL logs the mean over sequences, all-masked ones included)
        adv_row = tl.load(adv_ptr + row)
        if loss_type == CLIP:
            low_flag, high_flag = _clip_flags(r_seq, adv_row, clip_low, clip_high, delta)
            low_sum = low_flag.to(dtype)
            high_sum = high_flag.to(dtype)
        elif loss_type == CISPO:
            low_sum = (adv_row != adv_row).to(dtype)
            high_sum = _cispo_flag(r_seq, adv_row, eps_high).to(dtype)
        region_sum = tl.maximum(low_sum, high_sum)
    out = row_out_ptr + row * ROW_COLS
    tl.store(out + ROW_LOSS, tl.sum(loss_acc, 0))
    tl.store(out + ROW_KL, tl.sum(kl_acc, 0))
    tl.store(out + ROW_LOW, low_sum)
    tl.store(out + ROW_HIGH, high_sum)
    tl.store(out + ROW_REGION, region_sum)
    tl.store(out + ROW_TOKENS, length)


def _loss_type_code(loss_type) -> int:
    """The kernel's ``loss_type`` argument for a ``LossType``."""
    if loss_type.is_clip_family:
        return CLIP.value
    return {LossType.CISPO: CISPO, LossType.SAPO: SAPO, LossType.VESPO: VESPO, LossType.DPPO_TV: DPPO_TV,
            LossType.DPPO_KL: DPPO_KL, LossType.GPG: GPG, LossType.DRO: DRO}[loss_type].value


def _as_torch_where(value: float, low: float | None = None) -> float:
    """``value`` as ``torch.where(cond, value, other)`` (then ``.clamp(min=low)``) holds it in the torch path and TRL:
    a Python float becomes a tensor of the default dtype (float32). Host-only: no device is involved."""
    t = torch.tensor(value)
    return float(t if low is None else t.clamp(min=low))


def grpo_loss_terms_triton(
    logp, advantages, mask, *, old_logps, ref_logps, sampling_ratio, num_items_in_batch, entropy, config
):
    """Launcher with the contract of ``grpo_fast.loss_torch.grpo_loss_terms`` (same inputs, same ``LossTerms``).

    logp, old_logps, ref_logps, entropy: ``[B, T]``; advantages ``[B, 1]`` or ``[B, T]``; mask ``[B, T]`` bool;
    sampling_ratio ``[B, T]`` or ``[B, 1]``. All detached. float32 (float64 for float64 logp).
    """
    B, T = logp.shape
    dtype = logp.dtype
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"grpo_loss_terms_triton: logp must be float32 or float64 (the compute dtype); got {dtype}")
    logp = logp.contiguous()
    m = mask.to(dtype)
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    old, ref, ratio = cast(old_logps), cast(ref_logps), cast(sampling_ratio)
    adv = advantages.to(dtype).contiguous()
    adv_per_token = adv.shape[-1] == T and T != 1
    ent_mask = None
    if config.top_entropy_quantile < 1.0:
        ent_mask = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
    norm_global = config.loss_type not in (LossType.GRPO, LossType.SAPO)
    dlogp = torch.empty_like(logp)
    row_out = torch.empty(B, ROW_COLS.value, dtype=dtype, device=logp.device)
    inv_norm = loss_scale(config, m, num_items_in_batch).reshape(()) if norm_global else row_out  # else never read
    mask_u8 = mask.to(torch.uint8).contiguous()
    launch(
        _grpo_loss_kernel, (B,),
        logp, logp if old is None else old, logp if ref is None else ref, adv, mask_u8,  # logp: an absent input
        logp if ratio is None else ratio,
        mask_u8 if ent_mask is None else ent_mask.to(torch.uint8).contiguous(),
        inv_norm, dlogp, row_out,
        T, B,
        _loss_type_code(config.loss_type), int(config.sequence_level), int(norm_global), int(old is not None),
        int(config.beta != 0.0), int(config.use_bias_correction_kl), int(adv_per_token), int(ratio is not None),
        int(ratio is not None and ratio.shape[-1] == T and T != 1), int(ent_mask is not None),
        1.0 - config.epsilon_low, 1.0 + config.eps_high, config.epsilon_low, config.eps_high,
        config.dppo_cap if config.loss_type.is_dppo else math.inf if config.delta is None else config.delta,
        config.beta,
        _as_torch_where(config.sapo_temperature_pos), _as_torch_where(config.sapo_temperature_neg),
        _as_torch_where(config.vespo_k_pos), _as_torch_where(config.vespo_lambda_pos, 1e-4),
        _as_torch_where(config.vespo_k_neg), _as_torch_where(config.vespo_lambda_neg, 1e-4),
        0.0 if config.dro_beta is None else config.dro_beta,
        BLOCK_T=BLOCK_T if dtype == torch.float32 else BLOCK_T_FP64, num_warps=NUM_WARPS, num_stages=1,
    )
    column = lambda col: row_out[:, col.value]  # noqa: E731  (col: a ROW_* constant)
    loss = column(ROW_LOSS).sum()
    tokens = column(ROW_TOKENS).sum().clamp(min=1.0)
    dentropy = None
    if config.entropy_coef != 0.0:
        bonus, dentropy = entropy_bonus(entropy, m, ent_mask, config.entropy_coef)
        loss = loss + bonus

    per_sequence = config.sequence_level and not adv_per_token
    ratio_mean = (lambda col: column(col).mean()) if per_sequence else (lambda col: column(col).sum() / tokens)
    has_low, has_high, has_region = config.loss_type.clip_metrics
    low = ratio_mean(ROW_LOW) if has_low else None
    high = ratio_mean(ROW_HIGH) if has_high else None
    region = ratio_mean(ROW_REGION) if has_region else None
    kl = column(ROW_KL).sum() / tokens if config.beta != 0.0 else None
    ent = None if entropy is None else torch.where(mask, entropy, 0.0).sum() / tokens
    return LossTerms(loss, dlogp, dentropy, kl, ent, low, high, region)
