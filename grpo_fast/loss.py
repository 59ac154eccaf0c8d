"""Public GRPO losses: ``grpo_loss`` (from hidden states), ``grpo_loss_from_logps`` and the ``GRPOLoss`` module; the
gradient-accumulation weight of a micro-batch's loss (``micro_batch_scale``, ``token_mean_weight``)."""

from __future__ import annotations

import torch
from torch import nn

from grpo_fast import checks
from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.dispatch import resolve_impl
from grpo_fast.logprobs import logprobs_and_entropy, validate_logprob_inputs
from grpo_fast.ops import loss_terms
from grpo_fast.outputs import LossOutput
from grpo_fast.reference import grpo_loss_reference, loss_from_logps_reference


def _validate_loss_inputs(fn, B, T, device, advantages, completion_mask, old_logps, ref_logps, sampling_ratio,
                          num_items_in_batch, entropy, config):
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"{fn}: config must be a GRPOLossConfig, got {type(config).__name__}")
    checks.check_tensor(fn, "completion_mask", completion_mask, shape=(B, T), device=device)
    mask = checks.check_mask(fn, "completion_mask", completion_mask)
    checks.check_tensor(fn, "advantages", advantages, ndim=(1, 2), dtypes="float", device=device)
    if tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"{fn}: advantages must have shape [{B}] or [{B}, {T}], got {checks.describe(advantages)}")
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps), ("entropy", entropy)):
        checks.check_tensor(fn, name, x, shape=(B, T), dtypes="float", device=device, optional=True)
    checks.check_tensor(fn, "sampling_ratio", sampling_ratio, ndim=2, dtypes="float", device=device, optional=True)
    if sampling_ratio is not None and tuple(sampling_ratio.shape) not in ((B, T), (B, 1)):
        raise ValueError(
            f"{fn}: sampling_ratio must have shape [{B}, {T}] or [{B}, 1], got {checks.describe(sampling_ratio)}"
        )
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(
            f"{fn}: config.beta={config.beta} needs ref_logps (the reference model's per-token log-probs [B, T]); "
            "got None. Pass ref_logps, or set beta=0.0 to train without a KL term"
        )
    for name, x in (("advantages", advantages), ("old_logps", old_logps), ("ref_logps", ref_logps),
                    ("sampling_ratio", sampling_ratio)):
        checks.check_constant(fn, name, x)
    checks.check_finite(fn, "advantages", advantages)
    # only where the mask counts: padding may hold anything (TRL's -inf / 0 fills, uninitialised memory)
    checks.check_logprobs(fn, "old_logps", old_logps, where=mask)
    checks.check_logprobs(fn, "ref_logps", ref_logps, where=mask)
    # p_old / p_sampler: any finite value >= 0 is a ratio of two probabilities (0: TRL's masked-out token); no upper
    # bound, the cap is the user's (TRL's vllm_importance_sampling_clip_max, applied before the loss). Checked at
    # padding too: vespo sums log(ratio) over every column, as TRL does (whose ratio is exp(0) = 1 there)
    checks.check_values(fn, "sampling_ratio", sampling_ratio, low=0.0,
                        expected="importance-sampling weights p_old / p_sampler (finite and >= 0)")
    if config.loss_type == LossType.DR_GRPO:
        checks.check_completion_length(fn, config.max_completion_length, mask)
    # after the other value checks: a CUDA tensor's check then finds the stream already drained
    num_items_in_batch = checks.check_count(fn, "num_items_in_batch", num_items_in_batch)
    return mask, num_items_in_batch


def _to_output(loss, logps, metrics, config: GRPOLossConfig, has_entropy: bool) -> LossOutput:
    # the custom op's outputs all carry autograd history; the metrics are documented as detached
    kl, entropy, low, high, region = (m.detach() for m in metrics)
    has_low, has_high, has_region = config.loss_type.clip_metrics
    return LossOutput(
        loss=loss,
        per_token_logps=logps.detach(),
        kl=kl if config.beta != 0.0 else None,
        entropy=entropy if has_entropy else None,
        clip_ratio_low=low if has_low else None,
        clip_ratio_high=high if has_high else None,
        clip_ratio_region=region if has_region else None,
    )


def _loss_from_logps(impl, logps, advantages, mask, entropy, kw, config):
    if impl == "reference":
        return loss_from_logps_reference(logps, advantages, mask, entropy=entropy, config=config, **kw)
    # "torch" / "triton": the grpo_fast::loss_terms custom op (grpo_loss_terms or its kernel twin), differentiable
    # w.r.t. logps and entropy; metrics NaN where undefined
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    n = kw["num_items_in_batch"]
    if isinstance(n, torch.Tensor):
        n = n.to(dtype=logps.dtype, device=logps.device)
    elif n is not None:  # a fill, not a host-to-device copy (CUDA-graph capture refuses those)
        n = torch.full((), float(n), dtype=logps.dtype, device=logps.device)
    loss, _, _, metrics = loss_terms(logps, entropy, adv, mask, kw["old_logps"], kw["ref_logps"], kw["sampling_ratio"],
                                     n, config.to_json(), impl)
    return _to_output(loss, logps, metrics.unbind(0), config, entropy is not None)


def grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    sampling_ratio: torch.Tensor | None = None,
    num_items_in_batch=None,
    bias: torch.Tensor | None = None,
    config: GRPOLossConfig = GRPOLossConfig(),
    impl: str = "auto",
) -> LossOutput:
    """The GRPO loss of TRL 1.16 (``GRPOTrainer._compute_loss``, GA = 1) computed from the last hidden states and the
    lm_head weight, never materialising the ``[B, T, V]`` logits.

    Equals ``grpo_loss_reference(...)`` (``grpo_fast.reference``), i.e. TRL's loss on
    ``log_softmax(shape(hidden @ weight.T + bias)).gather(target_ids)``; the exact formula per loss type is in
    docs/design.md §4.

    hidden: ``[B, T, H]`` where ``hidden[:, t]`` predicts ``target_ids[:, t]``; weight: ``[V, H]``; bias: ``[V]``;
    target_ids, completion_mask, old_logps, ref_logps: ``[B, T]``; advantages: ``[B]`` or ``[B, T]``;
    sampling_ratio: ``[B, T]`` or ``[B, 1]`` (vLLM importance-sampling weights). ``old_logps=None`` means one update
    per generation (the ratio is 1, its gradient is not). Values: old_logps and ref_logps must be log-probabilities
    (finite and <= ``checks.LOGPROB_SLACK``) where completion_mask is 1, anything at padding; sampling_ratio finite
    and >= 0 everywhere; for dr_grpo no token may be counted past ``config.max_completion_length`` columns.
    ``num_items_in_batch``: the token denominator of dapo/cispo/vespo and of verl's dppo_tv/dppo_kl/gpg/dro
    (``LossType.divides_by_num_items``; None: this micro-batch's masked tokens; values below 1 count as 1); pass the
    global count so gradient accumulation matches one large batch. It must be finite and > 0: a Python or numpy
    number (checked for free) or a one-element tensor (checked on the host: one device sync for a CUDA tensor; see
    ``grpo_fast.checks.check_count``). Returns ``LossOutput``.

    float16 hidden and weight: the lm_head matmul runs in float16, so logits beyond +-65504 give a NaN loss, without
    an error (see ``fused_logprobs``: finding it would cost a device sync after the op).

    Gradients: the loss is differentiable w.r.t. hidden, weight and bias. ``advantages``, ``old_logps``,
    ``ref_logps`` and ``sampling_ratio`` are constants of the objective, as in TRL (which computes them without
    gradient): passing one that requires grad while grad mode is on is a ``ValueError`` rather than a silent zero
    gradient; detach it.
    """
    fn = "grpo_loss"
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"{fn}: config must be a GRPOLossConfig, got {type(config).__name__}")
    checks.check_tensor(fn, "hidden", hidden, dtypes="float")
    if hidden.dim() != 3:
        raise ValueError(f"{fn}: hidden must be [B, T, H], got {checks.describe(hidden)}")
    validate_logprob_inputs(fn, hidden, weight, target_ids, bias, config.temperature, config.softcap)
    B, T = target_ids.shape
    mask, num_items_in_batch = _validate_loss_inputs(fn, B, T, hidden.device, advantages, completion_mask, old_logps,
                                                     ref_logps, sampling_ratio, num_items_in_batch, None, config)
    impl = resolve_impl(impl, hidden.device, fn, hidden.dtype)
    kw = dict(old_logps=old_logps, ref_logps=ref_logps, sampling_ratio=sampling_ratio,
              num_items_in_batch=num_items_in_batch)
    if impl == "reference":
        return grpo_loss_reference(hidden, weight, target_ids, advantages, completion_mask, bias=bias, config=config,
                                   **kw)
    logps, entropy = logprobs_and_entropy(
        hidden, weight, target_ids, bias, config.temperature, config.softcap, True, impl
    )
    if config.entropy_coef == 0.0:
        entropy = entropy.detach()  # only the entropy bonus differentiates through it
    return _loss_from_logps(impl, logps, advantages, mask, entropy, kw, config)


def grpo_loss_from_logps(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    sampling_ratio: torch.Tensor | None = None,
    num_items_in_batch=None,
    entropy: torch.Tensor | None = None,
    config: GRPOLossConfig = GRPOLossConfig(),
    impl: str = "auto",
) -> LossOutput:
    """``grpo_loss`` for pipelines that already have per-token log-probs ``logps [B, T]`` (differentiable).

    ``logps`` must be log-probabilities where completion_mask is 1, as ``old_logps`` (see ``grpo_loss``).
    ``entropy [B, T]`` is needed for ``top_entropy_quantile < 1`` and ``entropy_coef != 0`` (and for the entropy
    metric). ``config.temperature``/``softcap`` are not applied here: they belong to whoever computed ``logps``.
    Differentiable w.r.t. ``logps`` and ``entropy``; the other tensors are constants (see ``grpo_loss``).
    """
    fn = "grpo_loss_from_logps"
    checks.check_tensor(fn, "logps", logps, ndim=2, dtypes="float")
    B, T = logps.shape
    mask, num_items_in_batch = _validate_loss_inputs(fn, B, T, logps.device, advantages, completion_mask, old_logps,
                                                     ref_logps, sampling_ratio, num_items_in_batch, entropy, config)
    if entropy is None and (config.top_entropy_quantile < 1.0 or config.entropy_coef != 0.0):
        raise ValueError(
            f"{fn}: config.top_entropy_quantile={config.top_entropy_quantile} / entropy_coef={config.entropy_coef} "
            "need entropy (per-token entropies [B, T], e.g. from fused_logprobs(..., return_entropy=True)); got None"
        )
    checks.check_logprobs(fn, "logps", logps, where=mask)
    checks.check_finite(fn, "entropy", entropy, where=mask)
    impl = resolve_impl(impl, logps.device, fn, logps.dtype)
    compute_dtype = torch.float64 if logps.dtype == torch.float64 else torch.float32
    logps = logps.to(compute_dtype)
    entropy = None if entropy is None else entropy.to(compute_dtype)
    kw = dict(old_logps=old_logps, ref_logps=ref_logps, sampling_ratio=sampling_ratio,
              num_items_in_batch=num_items_in_batch)
    return _loss_from_logps(impl, logps, advantages, mask, entropy, kw, config)


def micro_batch_scale(loss_type: LossType | str, row_share: float, token_weight: float) -> float:
    """The weight of one micro-batch's ``grpo_loss`` under gradient accumulation, so that the accumulated gradient is
    the whole batch's (TRL's scaling).

    The losses that divide by ``num_items_in_batch`` (dapo, cispo, vespo, dppo_tv, dppo_kl, gpg, dro:
    ``LossType.divides_by_num_items``) are already weighted when it is the whole batch's token count: 1. bnpo's token
    mean of the micro-batch counts with ``token_weight`` (TRL's ``1 / gradient_accumulation_steps``; a trainer may
    weight it by its share of the batch's tokens instead); the per-sequence means (grpo, sapo, dr_grpo, luspo) with
    ``row_share``, the micro-batch's share of the batch's rows (TRL's ``1 / gradient_accumulation_steps``, its
    micro-batches being of one size).
    """
    loss_type = LossType(loss_type)
    if loss_type.divides_by_num_items:
        return 1.0
    if loss_type == LossType.BNPO:
        return token_weight
    return row_share


def token_mean_weight(token_mean: str, tokens: float, total_tokens: float, micro_batches: int) -> float:
    """The weight of one micro-batch's token mean in the generation's (``micro_batch_scale``'s ``token_weight``; also
    that of the entropy bonus, a token mean for every loss type): ``1 / micro_batches`` with
    ``token_mean="micro_batch"`` (TRL's: the micro-batches' token means averaged), its share of the generation's
    tokens with ``"generation"`` (the token mean of the whole generation)."""
    return 1.0 / micro_batches if token_mean == "micro_batch" else tokens / max(total_tokens, 1.0)


class GRPOLoss(nn.Module):
    """``nn.Module`` wrapper: ``GRPOLoss(config)(hidden, weight, target_ids, advantages, completion_mask, ...)``."""

    def __init__(self, config: GRPOLossConfig = GRPOLossConfig(), impl: str = "auto"):
        super().__init__()
        if not isinstance(config, GRPOLossConfig):
            raise TypeError(f"GRPOLoss: config must be a GRPOLossConfig, got {type(config).__name__}")
        self.config = config
        self.impl = impl

    def forward(self, hidden, weight, target_ids, advantages, completion_mask, **kwargs) -> LossOutput:
        kwargs.setdefault("impl", self.impl)
        return grpo_loss(hidden, weight, target_ids, advantages, completion_mask, config=self.config, **kwargs)

    def extra_repr(self) -> str:
        return f"config={self.config}, impl={self.impl!r}"
