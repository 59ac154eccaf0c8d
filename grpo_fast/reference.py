"""Pure-PyTorch references: naive, readable, materialised logits. Ground truth for every test and benchmark.

These follow TRL 1.16 ``GRPOTrainer._compute_loss`` / ``_generate_and_score_completions`` line by line (docs/design.md §4)
and are never chosen by ``impl="auto"``. Run them in float64 to get the oracle the other paths are held to.
"""

from __future__ import annotations

import math

import torch

from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.outputs import AdvantageOutput, LossOutput


def shaped_logits_reference(hidden, weight, bias=None, temperature=1.0, softcap=None):
    """``z = W h (+ b)``; ``softcap * tanh(z / softcap)``; ``/ temperature``. Shape ``[..., V]``.

    The matmul runs in the input dtype (as a trainer's lm_head does); everything after it in float32, or float64
    for float64 inputs.
    """
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(acc)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def logprobs_reference(hidden, weight, target_ids, bias=None, temperature=1.0, softcap=None, return_entropy=False):
    """``log_softmax(z)[y]`` (and the entropy of ``softmax(z)``) through a materialised ``[..., V]`` logits tensor.

    hidden: ``[..., H]``; weight: ``[V, H]``; target_ids: ``[...]`` -> logps ``[...]`` (float32, float64 for float64
    inputs), entropy ``[...]`` when asked.
    """
    z = shaped_logits_reference(hidden, weight, bias, temperature, softcap)
    logp_all = torch.log_softmax(z, dim=-1)
    logps = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logps
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def high_entropy_mask_reference(entropy, mask, top_entropy_quantile):
    """TRL ``get_high_entropy_mask`` on one process: keep masked tokens whose entropy reaches the (1-q) quantile."""
    local = entropy.detach()[mask.bool()]
    if local.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(local.float(), 1.0 - top_entropy_quantile)  # TRL: a float32 threshold
    return ((entropy.detach() * mask) >= threshold) & mask.bool()


def vespo_phi_reference(advantages, log_ratio, mask, sampling_ratio, config):
    """TRL ``get_gamma_weights``: ``phi(w) = exp(lam + k log w - lam w)`` of the sequence ratio w, detached, ``[B, 1]``.

    As in TRL, ``log(sampling_ratio)`` is summed over all T positions (TRL's ratio is 1 at padding).
    """
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log_ratio = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if sampling_ratio is not None:
            seq_log_ratio = seq_log_ratio + torch.log(sampling_ratio).clamp(lower, 20.0).sum(-1, keepdim=True)
        log_w = seq_log_ratio.clamp(lower, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
        lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def loss_from_logps_reference(
    logps,
    advantages,
    completion_mask,
    *,
    old_logps=None,
    ref_logps=None,
    sampling_ratio=None,
    num_items_in_batch=None,
    entropy=None,
    config: GRPOLossConfig = GRPOLossConfig(),
) -> LossOutput:
    """TRL's ``_compute_loss`` from per-token log-probs ``[B, T]``, with autograd through every step.

    Gradient-accumulation scaling is left to the caller, so this equals TRL with GA = 1, one process and, for
    dapo/cispo/vespo, ``num_items_in_batch`` as passed (None -> the micro-batch's token count). dppo_tv, dppo_kl, gpg
    and dro are verl 0.9.1's per-token terms (``verl/trainer/ppo/core_algos.py``) on the same path, divided like dapo.
    """
    dtype = logps.dtype
    mask = completion_mask.to(dtype)
    adv = advantages.to(dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = logps.detach() if old_logps is None else old_logps.to(dtype)
    loss_type = config.loss_type
    entropy_mask = None
    if config.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask_reference(entropy, mask, config.top_entropy_quantile)

    log_ratio = logps - old
    if config.sequence_level:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)

    if config.beta != 0.0:
        ref = ref_logps.to(dtype)
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if config.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if loss_type == LossType.CISPO:
        per_token_loss = -torch.clamp(coef_1, max=config.eps_high).detach() * adv * logps
    elif loss_type.is_clip_family:
        coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + config.eps_high)
        clipped_coef_1 = coef_1 if config.delta is None else torch.clamp(coef_1, max=config.delta)
        per_token_loss = -torch.min(clipped_coef_1 * adv, coef_2 * adv)
    elif loss_type == LossType.SAPO:
        tau = torch.where(adv > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    elif loss_type.is_dppo:  # verl 0.9.1 compute_policy_loss_dppo_tv / _kl (clip_ratio_low / high: epsilon / high)
        ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))  # verl clamps the log-ratio "for stability"
        truncated = torch.clamp(ratio, max=config.dppo_cap).detach()  # delta, or verl's default clip_ratio_c 20
        prob, old_prob = torch.exp(logps), torch.exp(old)
        if loss_type == LossType.DPPO_TV:
            pos = (prob - old_prob) <= config.eps_high
            neg = (prob - old_prob) >= -config.epsilon_low
        else:
            binary_kl = old_prob * (old - logps) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            pos = (binary_kl <= config.eps_high) | (prob <= old_prob)
            neg = (binary_kl <= config.epsilon_low) | (prob >= old_prob)
        dppo_valid = torch.where(adv > 0, pos, neg).detach()
        per_token_loss = -adv * truncated * logps * dppo_valid.to(dtype)
    elif loss_type == LossType.GPG:  # verl 0.9.1 compute_policy_loss_gpg
        per_token_loss = -logps * adv
    elif loss_type == LossType.DRO:  # verl 0.9.1 compute_policy_loss_dro
        per_token_loss = -(logps * adv - 0.5 * config.dro_beta * log_ratio.square())
    else:  # VESPO
        ratio = None if sampling_ratio is None else sampling_ratio.to(dtype)
        phi = vespo_phi_reference(adv, log_ratio, mask, ratio, config)
        per_token_loss = -phi * adv * logps

    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if sampling_ratio is not None and loss_type != LossType.VESPO:
        per_token_loss = per_token_loss * sampling_ratio.to(dtype)
    if config.beta != 0.0:
        per_token_loss = per_token_loss + config.beta * per_token_kl

    masked = per_token_loss * mask
    if loss_type in (LossType.GRPO, LossType.SAPO):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == LossType.BNPO:
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == LossType.DR_GRPO:
        max_len = config.max_completion_length or logps.shape[1]
        loss = masked.sum() / (per_token_loss.shape[0] * max_len)
    elif loss_type == LossType.LUSPO:
        loss = masked.sum(-1).mean()
    else:  # divides_by_num_items: DAPO, CISPO, VESPO, DPPO_TV, DPPO_KL, GPG, DRO (verl's "token-mean")
        if num_items_in_batch is None:
            normalizer = mask.sum().clamp(min=1.0)
        else:
            normalizer = torch.as_tensor(num_items_in_batch, dtype=dtype, device=logps.device).reshape(())
            normalizer = normalizer.clamp(min=1.0)
        loss = masked.sum() / normalizer

    if config.entropy_coef != 0.0:
        effective = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - config.entropy_coef * (entropy * effective).sum() / effective.sum().clamp(min=1.0)

    def masked_mean(x):
        x = x.detach().to(dtype)
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    def ratio_mean(flags):
        # TRL logs a sequence-level ratio's flags [B, 1] as one value per sequence. (TRL tells them apart by shape
        # alone, so at T = 1 it also averages per-token metrics over padding; the flags' origin decides here.)
        if config.sequence_level and adv.shape[1] == 1:
            return flags.to(dtype).mean()
        return masked_mean(flags)

    kl = masked_mean(per_token_kl) if config.beta != 0.0 else None
    ent = masked_mean(entropy) if entropy is not None else None
    low = high = region = None
    if loss_type.is_clip_family:
        # TRL counts clipping on the delta-clamped ratio
        is_low = (clipped_coef_1 < 1 - config.epsilon_low) & (adv < 0)
        is_high = (clipped_coef_1 > 1 + config.eps_high) & (adv > 0)
        low, high, region = ratio_mean(is_low), ratio_mean(is_high), ratio_mean(is_low | is_high)
    elif loss_type == LossType.CISPO:
        high = ratio_mean((coef_1 > config.eps_high) & (adv > 0))
    elif loss_type.is_dppo:  # outside the trust region with A < 0, A > 0, at all (verl's pg_clipfrac)
        outside = ~dppo_valid
        low, high, region = masked_mean(outside & (adv < 0)), masked_mean(outside & (adv > 0)), masked_mean(outside)
    return LossOutput(loss, logps.detach(), kl, ent, low, high, region)


def grpo_loss_reference(
    hidden,
    weight,
    target_ids,
    advantages,
    completion_mask,
    *,
    old_logps=None,
    ref_logps=None,
    sampling_ratio=None,
    num_items_in_batch=None,
    bias=None,
    config: GRPOLossConfig = GRPOLossConfig(),
) -> LossOutput:
    """``grpo_loss`` the way trainers do it today: materialise ``[B, T, V]`` logits, then TRL's loss."""
    logps, entropy = logprobs_reference(
        hidden, weight, target_ids, bias, config.temperature, config.softcap, return_entropy=True
    )
    if config.entropy_coef == 0.0:
        entropy = entropy.detach()  # TRL computes it under no_grad unless the entropy bonus is on
    return loss_from_logps_reference(
        logps,
        advantages,
        completion_mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        sampling_ratio=sampling_ratio,
        num_items_in_batch=num_items_in_batch,
        entropy=entropy,
        config=config,
    )


FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** floor(log2(amax))`` where ``amax`` (a group's largest |value|) is at least the smallest normal float32,
    else 1. Group statistics are taken on ``x / scale``, whose squares cannot overflow for any finite ``x`` (rewards
    of 1e30 overflow float32 squares); a power of two divides exactly, so wherever the unscaled sums neither overflow
    nor underflow the results are the same bit for bit. The torch path and the Triton kernel use the same scale."""
    return torch.where(amax >= FLOAT32_TINY, torch.exp2(torch.floor(torch.log2(amax))), 1.0)


def _nanstats(x, dim=None, keepdim=False):
    """NaN-aware mean and unbiased std of ``x`` (TRL ``nanmean`` / ``nanstd``: std NaN with fewer than two values),
    taken on ``x / scale`` (``pow2_scale`` of the largest |x|). Returns ``(mean, std / scale, scale)``: the std
    stays in those units so that z-scores of any finite ``x`` are computed without overflow (``zscore``)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    scale = pow2_scale(torch.nan_to_num(x.abs(), nan=0.0).amax(dim=dim, keepdim=True))
    xs = x / scale
    mean = torch.nanmean(xs, dim=dim, keepdim=True)
    var = torch.nanmean((xs - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(x.dtype)  # TRL: int64 / int64 -> float32 factor
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    out = (mean * scale, var.sqrt(), scale)
    return out if keepdim else tuple(t.squeeze(dim) for t in out)


def zscore(x, mean, std_scaled, scale, eps):
    """``(x - mean) / (std + eps)`` in units of ``scale`` (finite for any finite x, mean and std)."""
    return (x / scale - mean / scale) / (std_scaled + eps / scale)


def group_advantages_reference(
    rewards,
    *,
    group_size=None,
    group_ids=None,
    scale="group",
    eps=1e-4,
    reward_weights=None,
    aggregation="sum_then_normalize",
) -> AdvantageOutput:
    """TRL's advantages, one group at a time in a Python loop (readable, slow). Float64 for float64 rewards."""
    r = rewards if rewards.dim() == 2 else rewards.unsqueeze(1)
    n, k = r.shape
    dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
    r = r.to(dtype)
    w = torch.ones(k, dtype=dtype) if reward_weights is None else torch.as_tensor(reward_weights, dtype=dtype)
    w = w.to(r.device)
    if group_ids is None:
        group_ids = torch.arange(n, device=r.device) // group_size
    groups = [torch.nonzero(group_ids == g).flatten() for g in torch.unique(group_ids)]
    unscorable = torch.isnan(r).all(dim=1)

    if aggregation == "normalize_then_sum":
        z = torch.full_like(r, float("nan"))
        for idx in groups:
            sub = r[idx]
            z[idx] = zscore(sub, *_nanstats(sub, 0, keepdim=True), eps)
        total = (z * w).nansum(dim=1)
        total[unscorable] = float("nan")
    else:
        total = (r * w).nansum(dim=1)
        total[unscorable] = float("nan")

    group_mean = torch.empty(n, dtype=dtype, device=r.device)
    group_std = torch.empty(n, dtype=dtype, device=r.device)
    group_z = torch.empty(n, dtype=dtype, device=r.device)
    zero_std = torch.empty(n, dtype=torch.bool, device=r.device)
    for idx in groups:
        sub = total[idx]
        scored = sub[~torch.isnan(sub)]
        mean, std_scaled, s = _nanstats(sub)
        group_mean[idx], group_std[idx] = mean, std_scaled * s
        group_z[idx] = zscore(sub, mean, std_scaled, s, eps)
        zero_std[idx] = bool(scored.numel() < 2 or (scored.max() == scored.min()))

    if aggregation == "normalize_then_sum":
        mean, std_scaled, s = _nanstats(total)
        adv = zscore(total, mean, std_scaled, s, eps)
        return AdvantageOutput(torch.nan_to_num(adv, nan=0.0), mean.expand(n).clone(),
                               (std_scaled * s).expand(n).clone(), zero_std)

    if scale == "group":
        adv = group_z
    elif scale == "batch":
        _, std_scaled, s = _nanstats(total)
        adv = zscore(total, group_mean, std_scaled, s, eps)
        group_std = (std_scaled * s).expand(n).clone()
    else:
        adv = total - group_mean
    adv = torch.nan_to_num(adv, nan=0.0)
    adv = adv.masked_fill(zero_std, 0.0)  # exact zeros, not (r - mean) rounding noise over eps
    return AdvantageOutput(adv, group_mean, group_std, zero_std)


# ---------------------------------------------------------------------------------------------- verl 0.9.1's losses
# A line-by-line transcription of verl 0.9.1 (verl/trainer/ppo/core_algos.py: agg_loss and the POLICY_LOSS_REGISTRY
# functions; verl/utils/torch_functional.py: masked_sum, masked_mean), plain autograd, without importing verl.
# ``params`` is any object with grpo_fast.verl_losses.VerlLossParams's fields (None: the default verl falls back to).
# grpo_fast.verl_losses computes the same values in one pass, and reuses the three helpers below for the scalars.

def verl_masked_sum(values, mask, axis=None):
    """verl ``masked_sum``: ``(where(mask, values, 0) * mask).sum(axis)``."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    """verl ``masked_mean``: ``masked_sum / (mask.sum() + 1e-8)`` (0 where nothing is masked in)."""
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl ``agg_loss`` (``loss_mat``, ``loss_mask``: ``[B, T]``) -> a scalar."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return verl_masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        return verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def _verl_clip_range(p):
    low = p.clip_ratio_low if p.clip_ratio_low is not None else p.clip_ratio
    high = p.clip_ratio_high if p.clip_ratio_high is not None else p.clip_ratio
    return low, high


def _verl_ref_vanilla(old, logp, adv, mask, p, name):
    low, high = _verl_clip_range(p)
    nkl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(nkl)
    ppo_kl = verl_masked_mean(-nkl, mask)
    if name in ("dppo_tv", "dppo_kl"):  # binary TV / KL trust region, truncated IS (default cap 20, not 3)
        c = p.clip_ratio_c if p.clip_ratio_c is not None else 20.0
        truncated = torch.clamp(ratio, max=c).detach()
        prob, old_prob = torch.exp(logp), torch.exp(old)
        if name == "dppo_tv":
            pos, neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
        else:
            binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            pos = (binary_kl <= high) | (prob <= old_prob)
            neg = (binary_kl <= low) | (prob >= old_prob)
        valid = torch.where(adv > 0, pos, neg).detach().float()
        losses = -adv * truncated * logp * valid
        return losses, {"actor/pg_clipfrac": verl_masked_mean((1.0 - valid).float(), mask), "actor/ppo_kl": ppo_kl,
                        "actor/pg_clipfrac_lower": verl_masked_mean((ratio > c).float() * valid, mask)}
    if name == "cispo":
        clipped = torch.clamp(ratio, 1 - low, 1 + high)
        losses = -clipped.detach() * adv * logp
        return losses, {"actor/pg_clipfrac": verl_masked_mean((ratio != clipped).float(), mask), "actor/ppo_kl": ppo_kl,
                        "actor/pg_clipfrac_lower": torch.tensor(0.0)}
    if name == "sapo":
        tau_pos = torch.as_tensor(1.0 if p.tau_pos is None else p.tau_pos, dtype=adv.dtype, device=adv.device)
        tau_neg = torch.as_tensor(1.05 if p.tau_neg is None else p.tau_neg, dtype=adv.dtype, device=adv.device)
        taus = torch.where(adv > 0, tau_pos, tau_neg)
        losses = -(torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)) * adv
        return losses, {"actor/pg_clipfrac": torch.tensor(0.0), "actor/ppo_kl": ppo_kl,
                        "actor/pg_clipfrac_lower": torch.tensor(0.0)}
    c = p.clip_ratio_c if p.clip_ratio_c is not None else 3.0
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(losses1, losses2)
    clipfrac = verl_masked_mean(torch.gt(losses2, losses1).float(), mask)
    losses3 = -adv * c
    clip2 = torch.min(losses3, clip1)
    lower = verl_masked_mean(torch.gt(clip1, losses3) * (adv < 0).float(), mask)
    losses = torch.where(adv < 0, clip2, clip1)
    return losses, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": lower}


def _verl_ref_gspo(old, logp, adv, mask, p):
    low, high = _verl_clip_range(p)
    nkl = logp - old
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    nkl_seq = torch.sum(nkl * mask, dim=-1) / seq_lengths
    log_ratio = torch.clamp(logp - logp.detach() + nkl_seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    losses1 = -adv * ratio
    losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    losses = torch.maximum(losses1, losses2)
    return losses, {"actor/pg_clipfrac": verl_masked_mean(torch.gt(losses2, losses1).float(), mask),
                    "actor/ppo_kl": verl_masked_mean(-nkl, mask), "actor/pg_clipfrac_lower": torch.tensor(0.0)}


def _verl_ref_clip_cov(old, logp, adv, mask, p):
    low, high = _verl_clip_range(p)
    ratio_k = 0.0002 if p.clip_cov_ratio is None else p.clip_cov_ratio
    ub = 5.0 if p.clip_cov_ub is None else p.clip_cov_ub
    lb = 1.0 if p.clip_cov_lb is None else p.clip_cov_lb
    nkl = logp - old
    ratio = torch.exp(nkl)
    ppo_kl = verl_masked_mean(-nkl, mask)
    losses1 = -adv * ratio
    corr = torch.ones_like(adv)
    losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (losses2 > losses1) & (mask > 0)
    cov_all = (adv - verl_masked_mean(adv, mask)) * (logp - verl_masked_mean(logp.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_k * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))  # verl draws from the global CPU generator
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    losses = torch.maximum(losses1, losses2) * corr
    return losses, {"actor/pg_clipfrac": verl_masked_mean((corr == 0).float(), mask), "actor/ppo_kl": ppo_kl}


def _verl_ref_kl_cov(old, logp, adv, mask, p):
    ratio_k = 0.0002 if p.kl_cov_ratio is None else p.kl_cov_ratio
    coef = 1.0 if p.ppo_kl_coef is None else p.ppo_kl_coef
    nkl = logp - old
    abs_kl = nkl.abs()
    ratio = torch.exp(nkl)
    ppo_kl_abs = verl_masked_mean(nkl.abs(), mask)
    losses = -adv * ratio
    losses_kl = -adv * ratio + coef * abs_kl
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    valid_adv = adv[all_valid].detach().reshape(-1).cpu()
    valid_logp = logp[all_valid].detach().reshape(-1).cpu()
    if min(ratio_k, len(valid_adv)) != 0:
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        idx = torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices
        if len(idx) != 0:
            idx = all_valid_idx[idx]
            T = adv.shape[1]
            losses[idx // T, idx % T] = losses_kl[idx // T, idx % T]
    return losses, {"actor/ppo_kl": ppo_kl_abs}


def _verl_ref_geo_mean(old, logp, adv, mask, p, weights):
    low, high = _verl_clip_range(p)
    nkl = logp - old
    ppo_kl = verl_masked_mean(-nkl, mask)
    sgn = torch.sign(adv)
    nkl_clamp = torch.clamp(nkl, -low, high)
    nkl_min = sgn * torch.min(sgn * nkl, sgn * nkl_clamp)
    mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((nkl_min * mask).sum(dim=-1) / (mask_sum + 1e-8))
    advantage = (adv * mask).sum(dim=-1) / (mask_sum + 1e-8)
    losses = -advantage * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * mask).sum(dim=-1) / (mask_sum + 1e-8))
    clipped = torch.ne(nkl, nkl_clamp)
    return torch.mean(losses), {
        "actor/pg_clipfrac": verl_masked_mean((clipped * (adv > 0)).float(), mask), "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": verl_masked_mean((clipped * (adv < 0)).float(), mask)}


def verl_policy_loss_reference(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                               rollout_is_weights=None, global_batch_info=None):
    """verl 0.9.1's ``POLICY_LOSS_REGISTRY[name](old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights)`` with ``config``'s fields from ``params`` and ``config.global_batch_info`` =
    ``global_batch_info``: ``(loss, metrics)``, the loss differentiable w.r.t. ``log_prob``, the metrics floats.

    All tensors ``[B, T]`` (``rollout_is_weights`` also ``[B, 1]``); run in float64 for the oracle.
    """
    old, logp, adv, mask = old_log_prob, log_prob, advantages, response_mask
    info = dict(global_batch_info or {})
    if name == "geo_mean":  # a mean over sequences of its own: loss_agg_mode and global_batch_info are unused
        loss, metrics = _verl_ref_geo_mean(old, logp, adv, mask, params, rollout_is_weights)
        return loss, {k: v.detach().item() for k, v in metrics.items()}
    if name == "dro":
        beta = params.dro_beta
        if beta is None or beta <= 0:
            raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
        log_ratio = logp - old
        losses = -(logp * adv - 0.5 * beta * log_ratio.square())
        metrics = {"actor/ppo_kl": verl_masked_mean(-log_ratio, mask)}
    elif name == "gpg":
        losses, metrics = -logp * adv, {}
    elif name == "gspo":
        losses, metrics = _verl_ref_gspo(old, logp, adv, mask, params)
    elif name == "clip_cov":
        losses, metrics = _verl_ref_clip_cov(old, logp, adv, mask, params)
    elif name == "kl_cov":
        losses, metrics = _verl_ref_kl_cov(old, logp, adv, mask, params)
    elif name in ("vanilla", "dppo_tv", "dppo_kl", "cispo", "sapo"):
        losses, metrics = _verl_ref_vanilla(old, logp, adv, mask, params, name)
    else:
        raise ValueError(f"verl_policy_loss_reference: no verl policy loss {name!r}")
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    mode = "seq-mean-token-mean" if name == "sapo" else loss_agg_mode  # sapo ignores loss_agg_mode
    loss = verl_agg_loss(losses, mask, mode, **info)
    return loss, {k: v.detach().item() for k, v in metrics.items()}
