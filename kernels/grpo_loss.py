"""GRPO per-token loss, ``d loss / d logp`` and metric sums for every loss type, one program per sequence.

Computes what ``grpo_fast.loss_torch.grpo_loss_terms`` computes (TRL 1.16 semantics, DESIGN.md §4): each program
owns one row b of the ``[B, T]`` inputs and walks T in blocks, in up to three passes:
  1. the row's token count and, for sequence-level importance sampling / VESPO, the sums of log-ratios;
  2. per token: the ratio, the policy term, the KL, the weighted loss, ``d loss / d logp`` (direct part and
     ``d loss / d r``), and the metric flags; row partial sums go to ``row_out [B, 6]``;
  3. sequence level only: adds ``r_b * sum_t(d loss / d r_t) * m_t / len_b`` to ``d loss / d logp``.
The host sums ``row_out`` over B (deterministic: no atomics). Memory traffic: each ``[B, T]`` input is read once per
pass (twice or three times for sequence level), ``dlogp`` written once (read-modify-written in pass 3).
Limits: any B, T (the grid is B programs on axis 0); runs in float32, or float64 for float64 inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_fast.config import LossType
from grpo_fast.loss_torch import LossTerms, entropy_bonus, high_entropy_mask, loss_scale

# LOSS_TYPE constants (grpo_fast.config.LossType order is irrelevant: the launcher maps by name)
CLIP, CISPO, SAPO, VESPO = 0, 1, 2, 3
# NORM constants: how the row weight w_t = m_t * scale is formed
NORM_ROW, NORM_GLOBAL = 0, 1  # 1 / (len_b * B)  |  inv_norm (a device scalar: bnpo, dr_grpo, luspo, dapo, ...)
# columns of row_out
ROW_LOSS, ROW_KL, ROW_LOW, ROW_HIGH, ROW_REGION, ROW_TOKENS = 0, 1, 2, 3, 4, 5
ROW_COLS = 6


@triton.jit
def _grpo_loss_kernel(
    logp_ptr,  # [B, T] current log-probs
    old_ptr,  # [B, T] old log-probs (HAS_OLD)
    ref_ptr,  # [B, T] reference log-probs (HAS_KL)
    adv_ptr,  # [B] or [B, T] advantages (ADV_PER_TOKEN)
    mask_ptr,  # [B, T] completion mask, uint8
    ratio_ptr,  # [B, T] or [B, 1] sampling ratios (HAS_RATIO, RATIO_PER_TOKEN)
    ent_mask_ptr,  # [B, T] uint8 top-entropy mask (HAS_ENT_MASK)
    inv_norm_ptr,  # [] device scalar, 1 / normalizer (NORM == NORM_GLOBAL)
    dlogp_ptr,  # [B, T] out: d loss / d logp
    row_out_ptr,  # [B, ROW_COLS] out: loss and metric partial sums per row
    T,
    B,
    eps_low,
    eps_high,
    delta,
    beta,
    tau_pos,
    tau_neg,
    k_pos,
    lam_pos,
    k_neg,
    lam_neg,
    LOSS_TYPE: tl.constexpr,
    NORM: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS_KL: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    ADV_PER_TOKEN: tl.constexpr,
    HAS_RATIO: tl.constexpr,
    RATIO_PER_TOKEN: tl.constexpr,
    HAS_ENT_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    dtype = logp_ptr.dtype.element_ty
    LOG_1E8: tl.constexpr = -18.420680743952367

    # pass 1: token count, sum of log-ratios (sequence level), VESPO's clamped sums
    n_tok = tl.zeros((BLOCK_T,), dtype)
    lr_sum = tl.zeros((BLOCK_T,), dtype)
    vespo_sum = tl.zeros((BLOCK_T,), dtype)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < T
        m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
        n_tok += m.to(dtype)
        if SEQ_LEVEL or LOSS_TYPE == 3:
            logp = tl.load(logp_ptr + base + offs, mask=m, other=0.0)
            if HAS_OLD:
                old = tl.load(old_ptr + base + offs, mask=m, other=0.0)
            else:
                old = logp
            lr = tl.where(m, logp - old, 0.0)
            lr_sum += lr
            if LOSS_TYPE == 3:
                vespo_sum += tl.minimum(tl.maximum(lr, -20.0), 20.0)
                if HAS_RATIO:  # TRL sums log(sampling ratio) over all T positions
                    if RATIO_PER_TOKEN:
                        sr = tl.load(ratio_ptr + base + offs, mask=inb, other=1.0)
                        vespo_sum += tl.where(inb, tl.minimum(tl.maximum(tl.log(sr), LOG_1E8), 20.0), 0.0)
    length = tl.sum(n_tok, 0)
    length_c = tl.maximum(length, 1.0)
    if HAS_RATIO and LOSS_TYPE == 3 and not RATIO_PER_TOKEN:
        sr_row = tl.load(ratio_ptr + row)
        vespo_total = tl.sum(vespo_sum, 0) + tl.minimum(tl.maximum(tl.log(sr_row), LOG_1E8), 20.0)
    else:
        vespo_total = tl.sum(vespo_sum, 0)
    if NORM == 0:
        scale = 1.0 / (length_c * B)
    else:
        scale = tl.load(inv_norm_ptr).to(dtype)
    if SEQ_LEVEL:
        r_seq = tl.exp(tl.sum(lr_sum, 0) / length_c)

    # pass 2: per-token terms
    loss_acc = tl.zeros((BLOCK_T,), dtype)
    kl_acc = tl.zeros((BLOCK_T,), dtype)
    low_acc = tl.zeros((BLOCK_T,), dtype)
    high_acc = tl.zeros((BLOCK_T,), dtype)
    region_acc = tl.zeros((BLOCK_T,), dtype)
    gr_acc = tl.zeros((BLOCK_T,), dtype)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        inb = offs < T
        m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
        logp = tl.load(logp_ptr + base + offs, mask=inb, other=0.0)
        if HAS_OLD:
            old = tl.load(old_ptr + base + offs, mask=inb, other=0.0)
        else:
            old = logp
        if ADV_PER_TOKEN:
            adv = tl.load(adv_ptr + base + offs, mask=inb, other=0.0).to(dtype)
        else:
            adv = tl.zeros((BLOCK_T,), dtype) + tl.load(adv_ptr + row).to(dtype)
        if SEQ_LEVEL:
            r = tl.zeros((BLOCK_T,), dtype) + r_seq
        else:
            r = tl.exp(tl.where(m, logp - old, 0.0))

        zero = tl.zeros((BLOCK_T,), dtype)
        if LOSS_TYPE == 0:  # clip family: -min(r1 A, r2 A), autograd's tie rule (half to each side)
            r2 = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
            dr2 = ((r >= 1.0 - eps_low) & (r <= 1.0 + eps_high)).to(dtype)
            if HAS_DELTA:
                r1 = tl.minimum(r, delta)
                dr1 = (r <= delta).to(dtype)
            else:
                r1 = r
                dr1 = zero + 1.0
            a = r1 * adv
            b = r2 * adv
            take_a = tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0)).to(dtype)
            policy = -tl.minimum(a, b)
            dp_dr = -(take_a * adv * dr1 + (1.0 - take_a) * adv * dr2)
            dp_dlogp = zero
            is_low = (r1 < 1.0 - eps_low) & (adv < 0)  # TRL counts clipping on the delta-clamped ratio
            is_high = (r1 > 1.0 + eps_high) & (adv > 0)
        elif LOSS_TYPE == 1:  # cispo: -min(r, eps_high).detach() * A * logp
            c = tl.minimum(r, eps_high)
            policy = -c * adv * logp
            dp_dr = zero
            dp_dlogp = -c * adv
            is_low = zero != zero
            is_high = (r > eps_high) & (adv > 0)
        elif LOSS_TYPE == 2:  # sapo: -sigmoid(tau (r - 1)) * 4 / tau * A
            tau = tl.where(adv > 0, tau_pos, tau_neg).to(dtype)
            sig = 1.0 / (1.0 + tl.exp(-tau * (r - 1.0)))
            policy = -sig * 4.0 / tau * adv
            dp_dr = -4.0 * adv * sig * (1.0 - sig)
            dp_dlogp = zero
            is_low = zero != zero
            is_high = is_low
        else:  # vespo: -phi(w) * A * logp, phi detached
            log_w = tl.minimum(tl.maximum(vespo_total, LOG_1E8), 20.0)
            nonneg = adv >= 0
            k = tl.where(nonneg, k_pos, k_neg).to(dtype)
            lam = tl.maximum(tl.where(nonneg, lam_pos, lam_neg).to(dtype), 1e-4)
            phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
            phi = tl.where(phi == phi, phi, 0.0)  # NaN -> 0
            phi = tl.where(tl.abs(phi) < float("inf"), phi, 0.0)
            policy = -phi * adv * logp
            dp_dr = zero
            dp_dlogp = -phi * adv
            is_low = zero != zero
            is_high = is_low

        mult = zero + 1.0  # entropy mask x sampling ratio scale the policy term only
        if HAS_ENT_MASK:
            em = tl.load(ent_mask_ptr + base + offs, mask=inb, other=0) != 0
            mult = mult * em.to(dtype)
        if HAS_RATIO and LOSS_TYPE != 3:
            if RATIO_PER_TOKEN:
                sr = tl.load(ratio_ptr + base + offs, mask=inb, other=1.0).to(dtype)
            else:
                sr = zero + tl.load(ratio_ptr + row).to(dtype)
            mult = mult * sr
        loss_t = mult * policy
        dl_dr = mult * dp_dr
        dl_dlogp = mult * dp_dlogp
        if HAS_KL:
            ref = tl.load(ref_ptr + base + offs, mask=inb, other=0.0)
            diff = tl.where(m, ref - logp, 0.0)
            e = tl.exp(diff)
            kl0 = e - diff - 1.0
            dkl0 = 1.0 - e
            if BIAS_KL:
                kl = kl0 * r
                dl_dr += beta * kl0
                dl_dlogp += beta * dkl0 * r
            else:
                kl = kl0
                dl_dlogp += beta * dkl0
            loss_t += beta * kl
            kl_acc += tl.where(m, kl, 0.0)

        loss_acc += tl.where(m, scale * loss_t, 0.0)
        g_r = tl.where(m, scale * dl_dr, 0.0)
        dlogp = tl.where(m, scale * dl_dlogp, 0.0)
        if SEQ_LEVEL:
            gr_acc += g_r * r
        else:
            dlogp += g_r * r
        tl.store(dlogp_ptr + base + offs, dlogp, mask=inb)
        low_acc += tl.where(m, is_low.to(dtype), 0.0)
        high_acc += tl.where(m, is_high.to(dtype), 0.0)
        region_acc += tl.where(m, (is_low | is_high).to(dtype), 0.0)

    if SEQ_LEVEL:
        # pass 3: d r_b / d logp_t = r_b * m_t / len_b
        coef = tl.sum(gr_acc, 0) / length_c
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            inb = offs < T
            m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
            d = tl.load(dlogp_ptr + base + offs, mask=inb, other=0.0)
            tl.store(dlogp_ptr + base + offs, d + tl.where(m, coef, 0.0), mask=inb)

    low_sum = tl.sum(low_acc, 0)
    high_sum = tl.sum(high_acc, 0)
    region_sum = tl.sum(region_acc, 0)
    if SEQ_LEVEL and not ADV_PER_TOKEN:
        # one flag per sequence (TRL logs the mean over sequences, all-masked ones included)
        adv_row = tl.load(adv_ptr + row).to(dtype)
        if LOSS_TYPE == 0:
            r_seen = r_seq
            if HAS_DELTA:
                r_seen = tl.minimum(r_seq, delta)
            low_sum = ((r_seen < 1.0 - eps_low) & (adv_row < 0)).to(dtype)
            high_sum = ((r_seen > 1.0 + eps_high) & (adv_row > 0)).to(dtype)
        elif LOSS_TYPE == 1:
            low_sum = (adv_row != adv_row).to(dtype)
            high_sum = ((r_seq > eps_high) & (adv_row > 0)).to(dtype)
        region_sum = tl.maximum(low_sum, high_sum)
    out = row_out_ptr + row * 6
    tl.store(out + 0, tl.sum(loss_acc, 0))
    tl.store(out + 1, tl.sum(kl_acc, 0))
    tl.store(out + 2, low_sum)
    tl.store(out + 3, high_sum)
    tl.store(out + 4, region_sum)
    tl.store(out + 5, length)


def _loss_type_code(loss_type) -> int:
    if loss_type.is_clip_family:
        return CLIP
    return {LossType.CISPO: CISPO, LossType.SAPO: SAPO, LossType.VESPO: VESPO}[loss_type]


def grpo_loss_terms_triton(
    logp, advantages, mask, *, old_logps, ref_logps, sampling_ratio, num_items_in_batch, entropy, config
):
    """Launcher with the contract of ``grpo_fast.loss_torch.grpo_loss_terms`` (same inputs, same ``LossTerms``).

    logp, old_logps, ref_logps, entropy: ``[B, T]``; advantages ``[B, 1]`` or ``[B, T]``; mask ``[B, T]`` bool;
    sampling_ratio ``[B, T]`` or ``[B, 1]``. All detached. float32 (float64 for float64 logp).
    """
    B, T = logp.shape
    dtype = logp.dtype
    logp = logp.contiguous()
    m = mask.to(dtype)
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    old, ref, ratio = cast(old_logps), cast(ref_logps), cast(sampling_ratio)
    adv = advantages.to(dtype).contiguous()
    adv_per_token = adv.shape[-1] == T and T != 1
    ent_mask = None
    if config.top_entropy_quantile < 1.0:
        ent_mask = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
    row_norm = config.loss_type in (LossType.GRPO, LossType.SAPO)
    inv_norm = m.new_ones(()) if row_norm else loss_scale(config, m, num_items_in_batch).reshape(())
    dlogp = torch.empty_like(logp)
    row_out = torch.empty(B, ROW_COLS, dtype=dtype, device=logp.device)
    mask_u8 = mask.to(torch.uint8).contiguous()
    dummy = logp  # stands in for absent optional pointers (never read: HAS_X is False)
    _grpo_loss_kernel[(B,)](
        logp, dummy if old is None else old, dummy if ref is None else ref, adv, mask_u8,
        dummy if ratio is None else ratio,
        mask_u8 if ent_mask is None else ent_mask.to(torch.uint8).contiguous(),
        inv_norm, dlogp, row_out,
        T, B,
        config.epsilon_low, config.eps_high, config.delta if config.delta is not None else 0.0, config.beta,
        config.sapo_temperature_pos, config.sapo_temperature_neg,
        config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg,
        LOSS_TYPE=_loss_type_code(config.loss_type),
        NORM=NORM_ROW if row_norm else NORM_GLOBAL,
        SEQ_LEVEL=config.sequence_level,
        HAS_OLD=old is not None,
        HAS_KL=config.beta != 0.0,
        BIAS_KL=config.use_bias_correction_kl,
        HAS_DELTA=config.delta is not None,
        ADV_PER_TOKEN=adv_per_token,
        HAS_RATIO=ratio is not None,
        RATIO_PER_TOKEN=ratio is not None and ratio.shape[-1] == T and T != 1,
        HAS_ENT_MASK=ent_mask is not None,
        BLOCK_T=min(1024, triton.next_power_of_2(max(T, 16))),
    )
    loss = row_out[:, ROW_LOSS].sum()
    tokens = row_out[:, ROW_TOKENS].sum().clamp(min=1.0)
    dentropy = None
    if config.entropy_coef != 0.0:
        bonus, dentropy = entropy_bonus(entropy, m, ent_mask, config.entropy_coef)
        loss = loss + bonus

    per_sequence = config.sequence_level and not adv_per_token
    ratio_mean = (lambda col: row_out[:, col].mean()) if per_sequence else (lambda col: row_out[:, col].sum() / tokens)
    low = high = region = None
    if config.loss_type.is_clip_family:
        low, high, region = ratio_mean(ROW_LOW), ratio_mean(ROW_HIGH), ratio_mean(ROW_REGION)
    elif config.loss_type == LossType.CISPO:
        high = ratio_mean(ROW_HIGH)
    kl = row_out[:, ROW_KL].sum() / tokens if config.beta != 0.0 else None
    ent = None if entropy is None else torch.where(mask, entropy, 0.0).sum() / tokens
    return LossTerms(loss, dlogp, dentropy, kl, ent, low, high, region)
