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
    dapo/cispo/vespo, ``num_items_in_batch`` as passed (None -> the micro-batch's token count).
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
    else:  # DAPO, CISPO, VESPO
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
