"""verl 0.9.1's policy losses on grpo-fast's loss path: the loss and ``d loss / d log_prob`` in one pass.

``policy_loss(name, ...)`` equals verl's ``POLICY_LOSS_REGISTRY[name](old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights)`` (``verl/trainer/ppo/core_algos.py``; the float64
transcription is ``grpo_fast.reference.verl_policy_loss_reference``): the same loss, the same gradient w.r.t.
``log_prob`` (autograd's tie rules included: half the gradient to each side of a ``torch.maximum`` / ``torch.min`` tie,
the gradient passes at clamp bounds), the same metrics dict. Each loss's gradient is one scalar per token, so the
forward computes it with the loss and the autograd node saves that one ``[B, T]`` tensor, where verl's autograd keeps
up to a dozen ``[B, T]`` intermediates. Whole-batch statistics (kl_cov's top-k, clip_cov's random choice, gspo's and
geo_mean's sequence ratios) are taken in the same forward; the choices are constants of the gradient, as in verl.

Traffic: ~5 reads of ``[B, T]`` (log_prob, old_log_prob, advantages, mask, weights) and 1 write (the gradient); the
metrics cost one host sync (verl: one per metric). kl_cov copies the masked advantages and log-probs to the host and
clip_cov draws ``torch.randperm`` on the global CPU generator, both exactly as verl does, so they pick the same tokens.
Limits: ``log_prob`` float32 or float64, everything computed in its dtype; inputs are assumed finite at padding too
(where verl multiplies padding by 0 this path selects it out, so garbage there gives NaN in verl, a value here).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from grpo_fast import checks
from grpo_fast.reference import verl_agg_loss, verl_masked_mean

LOSS_NAMES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
              "cispo")
REFUSED = {
    "bypass_mode": "rollout-correction wiring around vanilla / REINFORCE (IS weights and rejection masks computed "
                   "from verl's rollout_corr_helper), not a loss of its own; verl's bypass mode sets loss_mode to its "
                   "own 'bypass_mode' whatever the config names, so a grpo_fast.* loss is not used there; outside "
                   "bypass mode, grpo_fast.vanilla takes verl's rollout_is_weights",
}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")

_CLIP_RANGE_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "clip_cov", "geo_mean", "cispo")


@dataclass(frozen=True)
class VerlLossParams:
    """verl's loss options, named as in ``ActorConfig`` (``actor.*``) and ``PolicyLossConfig`` (``policy_loss.*``).

    None means what verl does without the value: ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``clip_ratio``;
    ``clip_ratio_c`` to 3.0 for vanilla and 20.0 for dppo_* (``config.get("clip_ratio_c", ...)``; note that an
    ``ActorConfig`` always has the field, 3.0 by default, so dppo gets 3.0 from it); ``tau_pos`` / ``tau_neg`` to
    ActorConfig's 1.0 / 1.05; ``clip_cov_ratio`` / ``lb`` / ``ub`` to 0.0002 / 1.0 / 5.0; ``kl_cov_ratio`` to 0.0002;
    ``ppo_kl_coef`` to 1.0 (PolicyLossConfig's own default is 0.1); ``dro_beta`` has none (dro needs it). Values are
    checked here for type; the ranges a loss needs are checked by ``policy_loss`` for the loss that reads them.
    """

    clip_ratio: float | None = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float | None = None
    tau_pos: float | None = 1.0
    tau_neg: float | None = 1.05
    clip_cov_ratio: float | None = 0.0002
    clip_cov_lb: float | None = 1.0
    clip_cov_ub: float | None = 5.0
    kl_cov_ratio: float | None = 0.0002
    ppo_kl_coef: float | None = 0.1
    dro_beta: float | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, checks.real_value(f"VerlLossParams.{f.name}", value))

    def clip_range(self) -> tuple[float, float]:
        """``(low, high)`` as verl resolves them, checked >= 0."""
        out = []
        for side in ("low", "high"):
            field = f"clip_ratio_{side}"
            value = getattr(self, field)
            if value is None:
                field, value = "clip_ratio", self.clip_ratio
            if value is None:
                raise ValueError(f"VerlLossParams.{field} must be a number >= 0 (clip_ratio_{side} is None, so "
                                 "verl falls back to clip_ratio), got None")
            out.append(checks.real_value(f"VerlLossParams.{field}", value, low=0.0))
        return out[0], out[1]


def _required(params, field, default, *, low=None, strict=False, why=""):
    value = getattr(params, field)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"VerlLossParams.{field} must be a number{why}, got None")
    return checks.real_value(f"VerlLossParams.{field}{why}", value, low=low, strict=strict)


# ------------------------------------------------------------------------------------- per-token terms
# Each returns (l, dl, metrics): verl's loss matrix l [B, T] before the IS weights, d l_t / d log_prob_t, and verl's
# metrics as 0-dim tensors (floats where verl logs a constant). The metric expressions are verl's, character for
# character, so the logged values are bit-identical.

def _share(a, b, *, larger: bool):
    """The share of the gradient of ``torch.maximum(a, b)`` (``larger``) or ``torch.minimum(a, b)`` that goes to
    ``a``: 1 where ``a`` wins, 0.5 on a tie, 0 where ``b`` wins."""
    wins = a > b if larger else a < b
    return torch.where(wins, 1.0, torch.where(a == b, 0.5, 0.0)).to(a.dtype)


def _ratio(x, clamp: bool):
    """``exp(clamp(x, -20, 20))`` (verl's "for stability" clamp, where that loss has it) and its derivative."""
    if not clamp:
        r = torch.exp(x)
        return x, r, r
    nkl = torch.clamp(x, min=-20.0, max=20.0)
    r = torch.exp(nkl)
    return nkl, r, torch.where((x >= -20.0) & (x <= 20.0), r, 0.0)


def _ppo_clip(r, dr, adv, low, high):
    """``torch.maximum(-A r, -A clamp(r, 1 - low, 1 + high))`` with its derivative, and both branches."""
    l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - low, 1 + high)
    dl1 = -adv * dr
    dl2 = -adv * torch.where((r >= 1 - low) & (r <= 1 + high), dr, 0.0)
    s = _share(l1, l2, larger=True)
    return torch.maximum(l1, l2), s * dl1 + (1 - s) * dl2, l1, l2


def _vanilla(old, logp, adv, mask, valid, p):
    low, high = p.clip_range()
    c = _required(p, "clip_ratio_c", 3.0, low=1.0, strict=True, why=" (vanilla's dual-clip bound)")
    nkl, r, dr = _ratio(logp - old, clamp=True)
    m1, dm1, l1, l2 = _ppo_clip(r, dr, adv, low, high)
    l3 = -adv * c
    dm2 = _share(m1, l3, larger=False) * dm1  # torch.min(l3, m1): l3 is a constant
    neg = adv < 0
    metrics = {"actor/pg_clipfrac": verl_masked_mean(torch.gt(l2, l1).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-nkl, mask),
               "actor/pg_clipfrac_lower": verl_masked_mean(torch.gt(m1, l3) * neg.float(), mask)}
    return torch.where(neg, torch.minimum(l3, m1), m1), torch.where(neg, dm2, dm1), metrics


def _dppo(old, logp, adv, mask, valid, p, kind):
    low, high = p.clip_range()
    c = _required(p, "clip_ratio_c", 20.0, low=0.0, strict=True, why=f" ({kind}'s truncation of the ratio)")
    nkl, r, _ = _ratio(logp - old, clamp=True)
    truncated = torch.clamp(r, max=c)
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "dppo_tv":
        pos, neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos = (binary_kl <= high) | (prob <= old_prob)
        neg = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).float()
    coef = -adv * truncated
    metrics = {"actor/pg_clipfrac": verl_masked_mean((1.0 - valid).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-nkl, mask),
               "actor/pg_clipfrac_lower": verl_masked_mean((r > c).float() * valid, mask)}
    return coef * logp * valid, coef * valid, metrics


def _cispo(old, logp, adv, mask, valid, p):
    low, high = p.clip_range()
    nkl, r, _ = _ratio(logp - old, clamp=True)
    clipped = torch.clamp(r, 1 - low, 1 + high)  # a constant of the gradient (verl detaches it)
    metrics = {"actor/pg_clipfrac": verl_masked_mean((r != clipped).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-nkl, mask), "actor/pg_clipfrac_lower": 0.0}
    return -clipped * adv * logp, -clipped * adv, metrics


def _sapo(old, logp, adv, mask, valid, p):
    kw = dict(dtype=adv.dtype, device=adv.device)
    tau_pos = torch.as_tensor(checks.temperature_value("VerlLossParams.tau_pos", 1.0 if p.tau_pos is None
                                                       else p.tau_pos, checks.SAPO_TEMPERATURE), **kw)
    tau_neg = torch.as_tensor(checks.temperature_value("VerlLossParams.tau_neg", 1.05 if p.tau_neg is None
                                                       else p.tau_neg, checks.SAPO_TEMPERATURE), **kw)
    nkl, r, dr = _ratio(logp - old, clamp=True)
    taus = torch.where(adv > 0, tau_pos, tau_neg)
    sig = torch.sigmoid(taus * (r - 1.0))
    scale = 4.0 / taus
    metrics = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": verl_masked_mean(-nkl, mask),
               "actor/pg_clipfrac_lower": 0.0}
    return -(sig * scale) * adv, -adv * scale * (sig * (1 - sig) * taus) * dr, metrics


def _gspo(old, logp, adv, mask, valid, p):
    low, high = p.clip_range()
    x = logp - old
    # s_b = mean log-ratio of the row, a constant; token t's log-ratio is log_prob_t - sg(log_prob_t) + s_b = s_b
    seq = (torch.where(valid, x, 0.0) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq = seq.unsqueeze(-1).expand_as(x)
    r = torch.exp(torch.clamp(seq, max=10.0))
    dr = torch.where(seq <= 10.0, r, 0.0)
    loss, dloss, l1, l2 = _ppo_clip(r, dr, adv, low, high)
    metrics = {"actor/pg_clipfrac": verl_masked_mean(torch.gt(l2, l1).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-x, mask), "actor/pg_clipfrac_lower": 0.0}
    return loss, dloss, metrics


def _clip_cov(old, logp, adv, mask, valid, p):
    low, high = p.clip_range()
    ratio_k = _required(p, "clip_cov_ratio", 0.0002, low=0.0, strict=True, why=" (clip_cov)")
    ub = _required(p, "clip_cov_ub", 5.0, why=" (clip_cov)")
    lb = _required(p, "clip_cov_lb", 1.0, why=" (clip_cov)")
    x = logp - old
    r = torch.exp(x)
    loss, dloss, l1, l2 = _ppo_clip(r, r, adv, low, high)
    # verl's choice, step for step: candidates in torch.nonzero's order, one torch.randperm on the global generator
    cov_all = (adv - verl_masked_mean(adv, mask)) * (logp - verl_masked_mean(logp, mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[(l2 > l1) & (mask > 0)] = -torch.inf
    clip_num = max(int(ratio_k * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    corr = torch.ones_like(adv)
    if len(top_k_idx) > 0:
        top_k_idx = top_k_idx[torch.randperm(len(top_k_idx))[: min(clip_num, len(top_k_idx))]]
        corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    metrics = {"actor/pg_clipfrac": verl_masked_mean((corr == 0).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-x, mask)}
    return loss * corr, dloss * corr, metrics


def _kl_cov(old, logp, adv, mask, valid, p):
    ratio_k = _required(p, "kl_cov_ratio", 0.0002, low=0.0, strict=True, why=" (kl_cov)")
    coef = _required(p, "ppo_kl_coef", 1.0, why=" (kl_cov)")
    x = logp - old
    r = torch.exp(x)
    l1 = -adv * r
    # the top-k of the covariance over the masked tokens, on the host and in this order as verl computes it
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    valid_adv = adv[valid].reshape(-1).cpu()
    valid_logp = logp[valid].reshape(-1).cpu()
    chosen = torch.zeros(adv.numel(), dtype=torch.bool, device=adv.device)
    if len(valid_adv) != 0:
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        idx = torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices
        chosen[valid_idx[idx]] = True
    chosen = chosen.view_as(adv)
    metrics = {"actor/ppo_kl": verl_masked_mean(x.abs(), mask)}
    return (torch.where(chosen, l1 + coef * x.abs(), l1), torch.where(chosen, l1 + coef * torch.sign(x), l1),
            metrics)


def _dro(old, logp, adv, mask, valid, p):
    if p.dro_beta is None or p.dro_beta <= 0:
        raise ValueError(f"VerlLossParams.dro_beta must be a number > 0 for loss 'dro' (verl: policy_loss.dro_beta, "
                         f"the weight of the quadratic log-ratio penalty), got {p.dro_beta!r}")
    beta = p.dro_beta
    x = logp - old
    metrics = {"actor/ppo_kl": verl_masked_mean(-x, mask)}
    return -(logp * adv - 0.5 * beta * x.square()), -(adv - beta * x), metrics


def _geo_mean(old, logp, adv, mask, valid, weights, p):
    """geo_mean is one term per sequence: returns (loss, dlogp, metrics) directly. verl takes ``torch.mean`` over all
    B rows and reads neither loss_agg_mode nor global_batch_info."""
    low, high = p.clip_range()
    x = logp - old
    sgn = torch.sign(adv)
    xc = torch.clamp(x, -low, high)
    dxc = ((x >= -low) & (x <= high)).to(x.dtype)
    a, b = sgn * x, sgn * xc
    s = _share(a, b, larger=False)
    y = sgn * torch.minimum(a, b)
    dy = sgn * (s * sgn + (1 - s) * sgn * dxc)
    den = mask.sum(dim=-1) + 1e-8
    ratio = torch.exp((torch.where(valid, y, 0.0) * mask).sum(dim=-1) / den)
    advantage = (adv * mask).sum(dim=-1) / den
    seq_loss = -advantage * ratio
    coef = -advantage * ratio
    if weights is not None:
        seq_w = torch.exp((torch.log(weights + 1e-10) * mask).sum(dim=-1) / den)
        seq_loss, coef = seq_loss * seq_w, coef * seq_w
    B = logp.shape[0]
    dlogp = torch.where(valid, (coef / B / den).unsqueeze(-1) * dy, 0.0)
    clipped = torch.ne(x, xc)
    metrics = {"actor/pg_clipfrac": verl_masked_mean((clipped * (adv > 0)).float(), mask),
               "actor/ppo_kl": verl_masked_mean(-x, mask),
               "actor/pg_clipfrac_lower": verl_masked_mean((clipped * (adv < 0)).float(), mask)}
    return torch.mean(seq_loss), dlogp, metrics


def _gpg(old, logp, adv, mask, valid, p):
    return -logp * adv, -adv, {}


# name -> (old, log_prob, advantages, mask, valid, params) -> (l, dl, metrics); geo_mean is one term per sequence
_TOKEN_TERMS = {"vanilla": _vanilla, "dppo_tv": functools.partial(_dppo, kind="dppo_tv"),
                "dppo_kl": functools.partial(_dppo, kind="dppo_kl"), "gspo": _gspo, "sapo": _sapo, "gpg": _gpg,
                "clip_cov": _clip_cov, "kl_cov": _kl_cov, "dro": _dro, "cispo": _cispo}


# ------------------------------------------------------------------------------------- aggregation
def _agg_grad(mask, valid, mode, info, dtype):
    """``d agg_loss / d loss_mat`` on the mask, ``[B, T]`` (verl's masked sums give padding no gradient)."""
    dp = info.get("dp_size", 1)
    v = valid.to(dtype)
    if mode == "token-mean":
        n = info.get("batch_num_tokens")
        g = v / (mask.sum() if n is None else n) * dp
    elif mode == "token-sum":
        g = v * dp
    else:
        count = mask.sum(dim=-1)
        rows = (count > 0).to(dtype).unsqueeze(-1)  # verl's float32 counts are whole numbers: exact in dtype
        gbs = info.get("global_batch_size")
        per_row = rows / (rows.sum() if gbs is None else gbs) * dp
        if mode == "seq-mean-token-mean":
            per_row = per_row / (count + 1e-8).to(dtype).unsqueeze(-1)  # verl's + 1e-8, in float32 for a bool mask
        elif mode == "seq-mean-token-sum-norm":
            lsf = info.get("loss_scale_factor")
            per_row = per_row / (mask.shape[-1] if lsf is None else lsf)
        g = v * per_row
    return g  # NaN off the mask where verl divides 0 by 0: the caller selects the mask


def verl_loss_terms(name, old_log_prob, log_prob, advantages, response_mask, valid, loss_agg_mode, params,
                    rollout_is_weights, global_batch_info):
    """``(loss, d loss / d log_prob [B, T], metrics)`` of verl's loss ``name``, one pass over detached inputs (all
    ``[B, T]`` in log_prob's dtype, ``valid`` the bool mask; weights ``[B, T]``, ``[B, 1]`` or None). Metrics are
    0-dim tensors or floats. Inputs as ``policy_loss`` checks them."""
    old, logp, adv, mask, w = old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
    if name == "geo_mean":
        return _geo_mean(old, logp, adv, mask, valid, w, params)
    l, dl, metrics = _TOKEN_TERMS[name](old, logp, adv, mask, valid, params)
    if w is not None:
        l, dl = l * w, dl * w
    mode = "seq-mean-token-mean" if name == "sapo" else loss_agg_mode  # verl's sapo overrides the mode
    loss = verl_agg_loss(l, mask, mode, **global_batch_info)  # verl's own arithmetic: the same loss value
    dlogp = torch.where(valid, _agg_grad(mask, valid, mode, global_batch_info, logp.dtype) * dl, 0.0)
    return loss, dlogp, metrics


class _VerlPolicyLoss(torch.autograd.Function):
    """``loss`` forward, ``grad * (d loss / d log_prob)`` backward: the node saves that one ``[B, T]`` tensor."""

    @staticmethod
    def forward(ctx, log_prob, compute, sink):
        loss, dlogp, metrics = compute(log_prob)
        ctx.save_for_backward(dlogp)
        sink.update(metrics)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (dlogp,) = ctx.saved_tensors
        return grad * dlogp, None, None


def _metrics_to_floats(metrics: dict) -> dict:
    """verl's ``.item()`` of each metric, with one host sync for all of them."""
    tensors = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([metrics[k].to(torch.float64) for k in tensors]).tolist() if tensors else []
    return {k: (values[tensors.index(k)] if k in tensors else float(v)) for k, v in metrics.items()}


def _check_inputs(fn, name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                  rollout_is_weights, global_batch_info):
    if name not in LOSS_NAMES:
        if name in REFUSED:
            raise ValueError(f"{fn}: verl's policy loss {name!r} is not offered: {REFUSED[name]}")
        raise ValueError(f"{fn}: name must be one of {', '.join(LOSS_NAMES)} (verl's policy losses), got {name!r}")
    if not isinstance(params, VerlLossParams):
        raise TypeError(f"{fn}: params must be a VerlLossParams, got {checks.describe(params)}")
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"{fn}: loss_agg_mode must be one of {', '.join(AGG_MODES)}, got {loss_agg_mode!r}")
    checks.check_tensor(fn, "log_prob", log_prob, ndim=2)
    if log_prob.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{fn}: log_prob must be float32 or float64, got {checks.describe(log_prob)}")
    B, T = log_prob.shape
    dev = log_prob.device
    checks.check_tensor(fn, "response_mask", response_mask, shape=(B, T), device=dev, like="log_prob")
    valid = checks.check_mask(fn, "response_mask", response_mask)
    for arg, x in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        checks.check_tensor(fn, arg, x, shape=(B, T), dtypes="float", device=dev, like="log_prob")
    checks.check_tensor(fn, "rollout_is_weights", rollout_is_weights, ndim=2, dtypes="float", device=dev,
                        like="log_prob", optional=True)
    if rollout_is_weights is not None and tuple(rollout_is_weights.shape) not in ((B, T), (B, 1)):
        raise ValueError(f"{fn}: rollout_is_weights must have shape [{B}, {T}] or [{B}, 1], got "
                         f"{checks.describe(rollout_is_weights)}")
    for arg, x in (("old_log_prob", old_log_prob), ("advantages", advantages),
                   ("rollout_is_weights", rollout_is_weights)):
        checks.check_constant(fn, arg, x)
    info = dict(global_batch_info or {})
    unknown = sorted(set(info) - set(BATCH_INFO_KEYS))
    if unknown:
        raise ValueError(f"{fn}: global_batch_info may hold only {', '.join(BATCH_INFO_KEYS)} (the keywords of "
                         f"verl's agg_loss), got {', '.join(map(repr, unknown))}")
    info = {k: v for k, v in info.items() if v is not None}  # None: agg_loss's default, as verl passes it
    if name in _CLIP_RANGE_LOSSES:
        params.clip_range()
    return valid, info


def policy_loss(name: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str, params: VerlLossParams,
                rollout_is_weights: torch.Tensor | None = None, global_batch_info: dict | None = None):
    """verl 0.9.1's policy loss ``name`` (one of ``LOSS_NAMES``): ``(loss, metrics)``.

    Equals ``verl.trainer.ppo.core_algos.get_policy_loss_fn(name)(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_is_weights)`` for an ``ActorConfig`` with ``params``'s fields and
    ``config.global_batch_info == global_batch_info`` (keys ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``): the same scalar loss (NaN where verl's is, e.g. token-mean over no token), the same
    gradient w.r.t. ``log_prob``, the same metrics dict of floats (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...).

    old_log_prob, log_prob, advantages: ``[B, T]`` (log_prob float32 or float64; the rest are cast to its dtype);
    response_mask: ``[B, T]`` bool or 0/1; rollout_is_weights: ``[B, T]`` or ``[B, 1]``. Only ``log_prob`` gets a
    gradient; the others must not require grad.
    """
    fn = "policy_loss"
    valid, info = _check_inputs(fn, name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                                rollout_is_weights, global_batch_info)
    dtype = log_prob.dtype
    cast = lambda x: None if x is None else x.detach().to(dtype)  # noqa: E731

    def compute(logp):
        return verl_loss_terms(name, cast(old_log_prob), logp.detach(), cast(advantages), response_mask, valid,
                               loss_agg_mode, params, cast(rollout_is_weights), info)

    sink: dict = {}
    if torch.is_grad_enabled() and log_prob.requires_grad:
        loss = _VerlPolicyLoss.apply(log_prob, compute, sink)
    else:
        loss, _, sink = compute(log_prob)
    return loss, _metrics_to_floats(sink)
