"""GRPO loss from per-token log-probs with an analytic gradient: the algorithm the Triton loss kernel implements.

Every loss type's gradient w.r.t. ``logp`` is one scalar per token, so the forward computes the loss *and*
``d loss / d logp`` (and ``d loss / d entropy``) in one elementwise pass and saves only those two ``[B, T]`` tensors.
Autograd through the reference instead saves a dozen ``[B, T]`` intermediates.

Semantics are TRL 1.16's, and verl 0.9.1's per-token terms for dppo_tv, dppo_kl, gpg and dro
(``grpo_fast.reference.loss_from_logps_reference``), including autograd's tie rule for
``torch.min`` (half the gradient to each side on a tie) and clamp's (the gradient passes at the bounds), with one
deliberate difference: masked positions are selected out with ``where`` rather than multiplied by 0, so garbage at
padding (e.g. ``exp(ref - logp) = inf``) never turns the loss into NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from grpo_fast.config import GRPOLossConfig, LossType


class LossTerms(NamedTuple):
    loss: torch.Tensor  # scalar
    dlogp: torch.Tensor  # [B, T], d loss / d logp
    dentropy: torch.Tensor | None  # [B, T], d loss / d entropy (entropy bonus only)
    kl: torch.Tensor | None
    entropy: torch.Tensor | None
    clip_ratio_low: torch.Tensor | None
    clip_ratio_high: torch.Tensor | None
    clip_ratio_region: torch.Tensor | None


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """Masked tokens whose (detached) entropy reaches the ``1 - q`` quantile of the masked entropies. ``[B, T]`` bool."""
    valid = mask.bool()
    # TRL: torch.quantile(entropy[valid].float(), 1 - q), a float32 threshold. Computed here without selecting the
    # masked entries (a boolean index syncs with the host and has no shape on meta tensors), by the same steps as
    # torch.quantile's linear interpolation over the sorted n masked values, so the threshold is bit-identical.
    n = valid.sum()
    ranked = torch.where(valid, entropy.float(), float("inf")).flatten().sort().values  # masked first, ascending
    last = (n - 1).clamp(min=0)
    rank = torch.full((), 1.0 - top_entropy_quantile, dtype=torch.float32, device=entropy.device) * last
    below = rank.long()
    at = lambda i: ranked.gather(0, i.reshape(1))  # noqa: E731  (ranked[i] would read i on the host)
    threshold = at(below).lerp(at(rank.ceil().long().clamp(max=last)), rank - below)
    threshold = torch.where(ranked.isnan().any(), float("nan"), threshold)  # torch.quantile: NaN in, NaN out
    return (torch.where(valid, entropy, 0.0) >= threshold) & valid


# The per-token terms, one function per term, in the order the Triton kernel (grpo_fast.kernels.grpo_loss) has its
# helpers of the same names. Each policy term returns (P, dP/dr, dP/dlogp at fixed r).
def _clip_term(config, r, adv):
    """The clip family's ``-min(r1 * A, r2 * A)``, ``r1 = min(r, delta)``, ``r2 = clamp(r, 1 - epsilon_low, 1 +
    eps_high)``, with autograd's tie rule for ``min`` and clamp's at the bounds."""
    r2 = torch.clamp(r, 1 - config.epsilon_low, 1 + config.eps_high)
    dr2 = ((r >= 1 - config.epsilon_low) & (r <= 1 + config.eps_high)).to(r.dtype)
    if config.delta is None:
        r1, dr1 = r, torch.ones_like(r)
    else:
        r1, dr1 = torch.clamp(r, max=config.delta), (r <= config.delta).to(r.dtype)
    a, b = r1 * adv, r2 * adv
    take_a = torch.where(a < b, 1.0, torch.where(a == b, 0.5, 0.0)).to(r.dtype)
    dP_dr = -(take_a * adv * dr1 + (1 - take_a) * adv * dr2)
    return -torch.minimum(a, b), dP_dr, torch.zeros_like(r)


def _cispo_term(config, r, adv, logp):
    """``-min(r, eps_high).detach() * A * logp`` (the capped ratio is a constant)."""
    c = torch.clamp(r, max=config.eps_high)
    return -c * adv * logp, torch.zeros_like(r), -c * adv


def _sapo_term(config, r, adv):
    """``-sigmoid(tau (r - 1)) * 4 / tau * A``, tau by the sign of A."""
    tau = torch.where(adv > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
    sig = torch.sigmoid(tau * (r - 1))
    return -sig * 4 / tau * adv, -4 * adv * sig * (1 - sig), torch.zeros_like(r)


def _vespo_log_weight(log_ratio, mask, sampling_ratio):
    """The log of VESPO's per-sequence importance weight, clamped (TRL ``get_gamma_weights``): ``[B, 1]``."""
    lower = math.log(1e-8)
    seq = torch.where(mask, log_ratio.clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
    if sampling_ratio is not None:
        seq = seq + torch.log(sampling_ratio).clamp(lower, 20.0).sum(-1, keepdim=True)
    return seq.clamp(lower, 20.0)


def _vespo_term(config, adv, logp, log_w):
    """``-phi(w) * A * logp`` with ``phi`` detached (TRL ``get_gamma_weights``, no gradient): one weight per sequence,
    broadcast like ``adv``; NaN and +-inf weights are 0."""
    nonneg = adv >= 0
    k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
    lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * adv * logp, torch.zeros_like(logp), -phi * adv


def _dppo_tv_valid(config, adv, logp, old):
    """verl's dppo_tv trust region (``compute_policy_loss_dppo_tv``): with ``p = exp(logp)``, ``p - p_old <=
    eps_high`` where A > 0, ``p - p_old >= -epsilon_low`` elsewhere (verl's clip_ratio_high / low). ``[B, T]`` bool."""
    diff = torch.exp(logp) - torch.exp(old)
    return torch.where(adv > 0, diff <= config.eps_high, diff >= -config.epsilon_low)


def _dppo_kl_valid(config, adv, logp, old):
    """verl's dppo_kl trust region (``compute_policy_loss_dppo_kl``): the binary KL ``p_old (old - logp) + (1 - p_old)
    log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` at most eps_high where A > 0 (or p <= p_old), at most epsilon_low
    elsewhere (or p >= p_old). ``[B, T]`` bool."""
    prob, old_prob = torch.exp(logp), torch.exp(old)
    binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    pos = (binary_kl <= config.eps_high) | (prob <= old_prob)
    neg = (binary_kl <= config.epsilon_low) | (prob >= old_prob)
    return torch.where(adv > 0, pos, neg)


def _dppo_term(config, log_ratio, adv, logp, valid):
    """``-A * min(r, cap).detach() * logp`` on the trust region's tokens, ``r = exp(clamp(log_ratio, -20, 20))``
    (verl's clamp), ``cap`` = delta or verl's 20.0: the truncated ratio is a constant."""
    c = torch.clamp(torch.exp(log_ratio.clamp(-20.0, 20.0)), max=config.dppo_cap)
    coef = -adv * c * valid.to(logp.dtype)
    return coef * logp, torch.zeros_like(logp), coef


def _gpg_term(adv, logp):
    """verl's gpg: ``-A * logp``."""
    return -logp * adv, torch.zeros_like(logp), -adv


def _dro_term(config, adv, logp, log_ratio):
    """verl's dro: ``-(A logp - 0.5 dro_beta (logp - old)^2)``."""
    beta = config.dro_beta
    return -(logp * adv - 0.5 * beta * log_ratio.square()), torch.zeros_like(logp), -(adv - beta * log_ratio)


def _kl_term(config, diff, r, l, dl_dr, dl_dlogp):
    """Adds ``beta`` x the k3 KL (``diff = ref - logp``), times r with the bias correction, to the token's loss ``l``
    and its partials; returns the KL and the three sums."""
    e = torch.exp(diff)
    kl0, dkl0 = e - diff - 1, 1 - e
    if config.use_bias_correction_kl and not config.sequence_level:
        # d(kl0 r) / d logp = (dkl0 + kl0) r = -diff r, summed here: apart, the two exp(diff) terms (exp(50) ~ 5e21)
        # cancel in floats and leave their rounding error, orders of magnitude above the gradient
        kl = kl0 * r
        dl_dlogp = dl_dlogp + config.beta * (-diff) * r
    elif config.use_bias_correction_kl:  # the sequence's ratio: its part goes through d r_b / d logp_t
        kl = kl0 * r
        dl_dr = dl_dr + config.beta * kl0
        dl_dlogp = dl_dlogp + config.beta * dkl0 * r
    else:
        kl = kl0
        dl_dlogp = dl_dlogp + config.beta * dkl0
    return kl, l + config.beta * kl, dl_dr, dl_dlogp


def _clip_flags(config, r, adv):
    """The low / high clip-metric flags of the clip family; TRL counts clipping on the delta-clamped ratio."""
    r_seen = r if config.delta is None else torch.clamp(r, max=config.delta)
    return (r_seen < 1 - config.epsilon_low) & (adv < 0), (r_seen > 1 + config.eps_high) & (adv > 0)


def _cispo_flag(config, r, adv):
    """cispo's high clip-metric flag: the ratio is capped."""
    return (r > config.eps_high) & (adv > 0)


def loss_scale(config: GRPOLossConfig, m: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """The factor s of ``loss = sum_t m_t * s * l_t``: ``[B, 1]`` for grpo/sapo, a 0-dim tensor for the rest."""
    B, T = m.shape
    loss_type = config.loss_type
    if loss_type in (LossType.GRPO, LossType.SAPO):
        return 1.0 / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if loss_type == LossType.BNPO:
        return 1.0 / m.sum().clamp(min=1.0)
    if loss_type == LossType.DR_GRPO:
        return torch.full((), 1.0 / (B * (config.max_completion_length or T)), dtype=m.dtype, device=m.device)
    if loss_type == LossType.LUSPO:
        return torch.full((), 1.0 / B, dtype=m.dtype, device=m.device)
    if num_items_in_batch is None:  # divides_by_num_items: dapo, cispo, vespo, dppo_tv, dppo_kl, gpg, dro
        return 1.0 / m.sum().clamp(min=1.0)
    if isinstance(num_items_in_batch, torch.Tensor):
        count = num_items_in_batch.to(dtype=m.dtype, device=m.device).reshape(())
    else:  # a fill kernel, not a host-to-device copy (which CUDA-graph capture refuses)
        count = torch.full((), float(num_items_in_batch), dtype=m.dtype, device=m.device)
    return 1.0 / count.clamp(min=1.0)


def entropy_bonus(entropy, m, ent_mask, coef):
    """``-coef * masked mean of entropy`` over the tokens the policy term acts on, and its gradient ``[B, T]``."""
    eff = m if ent_mask is None else m * ent_mask.to(m.dtype)
    denom = eff.sum().clamp(min=1.0)
    bonus = -coef * torch.where(eff.bool(), entropy, 0.0).sum() / denom
    return bonus, -coef * eff / denom


def grpo_loss_terms(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    sampling_ratio: torch.Tensor | None,
    num_items_in_batch,
    entropy: torch.Tensor | None,
    config: GRPOLossConfig,
) -> LossTerms:
    """Loss, ``d loss / d logp`` and metrics for one micro-batch. All inputs detached.

    logp, old_logps, ref_logps, entropy: ``[B, T]`` float; advantages ``[B, 1]`` or ``[B, T]``; mask ``[B, T]`` bool;
    sampling_ratio ``[B, T]`` or ``[B, 1]``. Computed in logp's dtype (float32, or float64).
    """
    dtype = logp.dtype
    B, T = logp.shape
    m = mask.to(dtype)
    adv = advantages.to(dtype).expand(B, T)
    old = logp if old_logps is None else old_logps.to(dtype)
    loss_type = config.loss_type
    lengths = m.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]

    w = m * loss_scale(config, m, num_items_in_batch)  # loss = sum_t w_t * l_t

    log_ratio = torch.where(mask, logp - old, 0.0)
    if config.sequence_level:
        r = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths).expand(B, T)
    else:
        r = torch.exp(log_ratio)

    if loss_type.is_clip_family:
        policy, dP_dr, dP_dlogp = _clip_term(config, r, adv)
    elif loss_type == LossType.CISPO:
        policy, dP_dr, dP_dlogp = _cispo_term(config, r, adv, logp)
    elif loss_type == LossType.SAPO:
        policy, dP_dr, dP_dlogp = _sapo_term(config, r, adv)
    elif loss_type.is_dppo:
        valid = (_dppo_tv_valid if loss_type == LossType.DPPO_TV else _dppo_kl_valid)(config, adv, logp, old)
        policy, dP_dr, dP_dlogp = _dppo_term(config, log_ratio, adv, logp, valid)
    elif loss_type == LossType.GPG:
        policy, dP_dr, dP_dlogp = _gpg_term(adv, logp)
    elif loss_type == LossType.DRO:
        policy, dP_dr, dP_dlogp = _dro_term(config, adv, logp, log_ratio)
    else:  # vespo
        policy, dP_dr, dP_dlogp = _vespo_term(config, adv, logp, _vespo_log_weight(log_ratio, mask, sampling_ratio))

    scale = torch.ones_like(r)  # entropy mask x sampling ratio: multiplies the policy term only
    ent_mask = None
    if config.top_entropy_quantile < 1.0:
        ent_mask = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
        scale = scale * ent_mask.to(dtype)
    if sampling_ratio is not None and loss_type != LossType.VESPO:
        scale = scale * sampling_ratio.to(dtype).expand(B, T)

    l = scale * policy
    dl_dr = scale * dP_dr  # through the ratio r
    dl_dlogp = scale * dP_dlogp  # direct
    kl = None
    if config.beta != 0.0:
        kl, l, dl_dr, dl_dlogp = _kl_term(config, ref_logps.to(dtype) - logp, r, l, dl_dr, dl_dlogp)

    loss = torch.where(mask, w * l, 0.0).sum()
    g_r = torch.where(mask, w * dl_dr, 0.0)  # d loss / d r_t (per position)
    dlogp = torch.where(mask, w * dl_dlogp, 0.0)
    # otherwise g_r is 0: nothing is differentiated through r (and 0 * r would be NaN where r overflows)
    through_r = loss_type.policy_through_ratio or (
        config.beta != 0.0 and config.use_bias_correction_kl and config.sequence_level)
    if through_r and config.sequence_level:
        # r_b = exp(sum_t m_t (logp_t - old_t) / len_b): d r_b / d logp_t = r_b * m_t / len_b
        dlogp = dlogp + (g_r * r).sum(-1, keepdim=True) * m / lengths
    elif through_r:
        dlogp = dlogp + g_r * r

    dentropy = None
    if config.entropy_coef != 0.0:
        bonus, dentropy = entropy_bonus(entropy, m, ent_mask, config.entropy_coef)
        loss = loss + bonus

    def masked_mean(x):
        return torch.where(mask, x.to(dtype), 0.0).sum() / m.sum().clamp(min=1.0)

    def ratio_mean(flags):
        if config.sequence_level and advantages.shape[-1] == 1:  # one value per sequence, as TRL logs it
            return flags[:, 0].to(dtype).mean()
        return masked_mean(flags)

    low = high = region = None
    if loss_type.is_clip_family:
        is_low, is_high = _clip_flags(config, r, adv)
        low, high, region = ratio_mean(is_low), ratio_mean(is_high), ratio_mean(is_low | is_high)
    elif loss_type == LossType.CISPO:
        high = ratio_mean(_cispo_flag(config, r, adv))
    elif loss_type.is_dppo:  # token level only: outside the trust region with A < 0, A > 0, at all
        outside = ~valid
        low, high, region = masked_mean(outside & (adv < 0)), masked_mean(outside & (adv > 0)), masked_mean(outside)
    return LossTerms(
        loss,
        dlogp,
        dentropy,
        None if kl is None else masked_mean(kl),
        None if entropy is None else masked_mean(entropy),
        low,
        high,
        region,
    )
