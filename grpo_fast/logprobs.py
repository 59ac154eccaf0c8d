"""Public ``fused_logprobs``: per-token log-probs (and entropy) straight from hidden states and the lm_head weight."""

from __future__ import annotations

import torch

from grpo_fast import checks
from grpo_fast.dispatch import resolve_impl
from grpo_fast.logprob_contract import LogprobParams
from grpo_fast.ops import logprobs_op
from grpo_fast.reference import logprobs_reference


def validate_logprob_inputs(fn, hidden, weight, target_ids, bias, temperature, softcap):
    """Checks shared by ``fused_logprobs`` and ``grpo_loss``; returns ``temperature`` (in
    ``checks.TEMPERATURE_RANGE``) and ``softcap`` as Python floats (numpy scalars are accepted)."""
    checks.check_tensor(fn, "hidden", hidden, dtypes="float")
    if hidden.dim() < 2:
        raise ValueError(f"{fn}: hidden must be [..., H] with at least 2 dimensions, got {checks.describe(hidden)}")
    if hidden.shape[-1] == 0:
        raise ValueError(
            f"{fn}: hidden must have a hidden size H >= 1 (its last dimension), got {checks.describe(hidden)}"
        )
    checks.check_tensor(fn, "weight", weight, shape=(None, hidden.shape[-1]), dtypes="float", device=hidden.device)
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{fn}: weight must have the dtype of hidden ({hidden.dtype}), got {checks.describe(weight)}; "
            "cast one of them explicitly (e.g. hidden.to(weight.dtype))"
        )
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError(
            f"{fn}: weight must have at least one row (a vocabulary V >= 1), got {checks.describe(weight)}"
        )
    checks.check_tensor(fn, "target_ids", target_ids, shape=tuple(hidden.shape[:-1]), dtypes="int", device=hidden.device)
    checks.check_tensor(fn, "bias", bias, shape=(vocab,), dtypes="float", device=hidden.device, optional=True)
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"{fn}: bias must have the dtype of hidden ({hidden.dtype}), got {checks.describe(bias)}")
    temperature = checks.temperature_value(f"{fn}: temperature", temperature)
    softcap = checks.check_softcap(f"{fn}: softcap", softcap)
    checks.check_token_ids(fn, "target_ids", target_ids, vocab)
    checks.check_finite(fn, "hidden", hidden)
    checks.check_finite(fn, "weight", weight)
    checks.check_finite(fn, "bias", bias)
    return temperature, softcap


def logprobs_and_entropy(hidden, weight, target_ids, bias, temperature, softcap, return_entropy, impl):
    """Unchecked dispatch: ``[..., H]`` -> logps ``[...]`` and entropy ``[...]`` (or None)."""
    if impl == "reference":
        out = logprobs_reference(hidden, weight, target_ids, bias, temperature, softcap, return_entropy)
        return out if return_entropy else (out, None)
    lead = target_ids.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    y = target_ids.reshape(-1).long()
    params = LogprobParams(temperature=temperature, softcap=softcap, return_entropy=return_entropy)
    if impl == "triton":
        h2, y = (h2 if h2.stride(-1) == 1 else h2.contiguous()), y.contiguous()
    logps, entropy = logprobs_op(h2, weight, y, bias, params, impl)
    return logps.reshape(lead), None if entropy is None else entropy.reshape(lead)


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, bias: torch.Tensor | None,
    params: LogprobParams,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The "torch" path, unchecked: per-token ``log_softmax(z)[y]`` and entropy without materialising ``z``, through
    the custom op around ``grpo_fast.logprobs_torch``'s chunked forward and backward; equals ``logprobs_reference``.

    hidden: ``[N, H]``; weight: ``[V, H]``; target_ids: ``[N]`` int64 in ``[0, V)``; bias: ``[V]`` or None.
    Returns ``(logps [N], entropy [N] or None)``, float32 (float64 for float64 inputs), differentiable w.r.t. hidden,
    weight and bias. Inputs are validated by the caller.
    """
    assert hidden.dim() == 2 and weight.dim() == 2, "hidden [N, H], weight [V, H]"
    assert hidden.shape[1] == weight.shape[1], "hidden and weight disagree on H"
    assert target_ids.shape == hidden.shape[:1], "target_ids [N]"
    return logprobs_op(hidden, weight, target_ids, bias, params, impl="torch")


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    impl: str = "auto",
):
    """Per-token log-probs of ``target_ids`` without materialising the ``[..., V]`` logits.

    Equals ``torch.log_softmax(z.float(), -1).gather(-1, target_ids[..., None])[..., 0]`` with
    ``z = hidden @ weight.T (+ bias)``, then ``softcap * tanh(z / softcap)`` when ``softcap``, then ``z / temperature``.

    hidden: ``[..., H]`` (float32, bfloat16, float16 or float64); weight: ``[V, H]`` of the same dtype (an lm_head
    or a tied embedding); target_ids: ``[...]``; bias: ``[V]``. Returns ``logps`` ``[...]`` in float32 (float64 for
    float64 inputs) and, with ``return_entropy``, also ``entropy`` ``[...]``, the entropy of ``softmax(z)``, which
    has its own gradient. Both are differentiable w.r.t. hidden, weight and bias. ``temperature`` must be in
    ``[0.01, 3.4e38]`` (``grpo_fast.checks.MIN_TEMPERATURE`` says why); ``return_entropy`` a bool (numpy's too).

    float16: the matmul runs in float16, as the lm_head it replaces would, so a logit beyond float16's +-65504
    overflows to inf and its row's log-prob and entropy come out NaN, without an error: finding it would take a look
    at the output, a device sync after the op on every call. Check ``torch.isfinite`` on the result where that can
    happen, or run such a model in bfloat16 (float32's range). The trainer looks: a non-finite loss (at the check it
    makes anyway) or old/reference log-prob (one check per pass) skips the update with a warning naming float16.
    """
    fn = "fused_logprobs"
    return_entropy = checks.check_bool(f"{fn}: return_entropy", return_entropy)
    temperature, softcap = validate_logprob_inputs(fn, hidden, weight, target_ids, bias, temperature, softcap)
    impl = resolve_impl(impl, hidden.device, fn, hidden.dtype)
    logps, entropy = logprobs_and_entropy(
        hidden, weight, target_ids, bias, temperature, softcap, return_entropy, impl
    )
    return (logps, entropy) if return_entropy else logps
