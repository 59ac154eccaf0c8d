"""The launchers as torch custom ops (``torch.library``) with fake implementations and registered autograd, so that
``torch.compile(fullgraph=True)`` traces ``fused_logprobs`` / ``grpo_loss`` as single opaque nodes on either path.

``grpo_fast::logprobs_fwd`` / ``logprobs_bwd``: the chunked log-prob forward and backward (``impl`` "torch" or
"triton"); the options cross them as one ``LogprobParams`` in JSON, and each calls the backend's ``forward`` /
``backward`` (the contract both backends implement: ``grpo_fast.logprob_contract``). ``grpo_fast::loss_terms``: the
GRPO loss, ``d loss / d logp``, ``d loss / d entropy`` and the metrics (NaN where undefined) in one call.
Absent optional outputs are empty tensors (custom ops return tensors only).

CUDA graphs. ``logprobs_bwd`` finds the rows with a non-zero upstream gradient (``nonzero``, a host sync): it is
tagged ``torch.Tag.cudagraph_unsafe`` (torch >= 2.9), so ``torch.compile(mode="reduce-overhead")`` does not capture
it: Inductor runs it between captured partitions (graph partitioning, on by default in recent torch) or skips CUDA
graphs for that graph, instead of failing at capture. The public functions validate their inputs on the host (a
sync): capture the compiled step, not a call of ``grpo_loss`` itself. ``loss_terms`` has no host sync or host-to-device
copy left that we know of (the top-entropy quantile is taken without a boolean index, scalars are made by fills), but
no GPU has captured it yet, so it keeps the tag until ``tests/test_gpu_ready.py``'s CUDA capture test has passed on
one. ``logprobs_fwd`` has no host sync and no tag.
"""

from __future__ import annotations

import functools
import json

import torch
from torch import Tensor

from grpo_fast import logprobs_torch
from grpo_fast.config import GRPOLossConfig
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats

_EMPTY = (0,)
# torch >= 2.9 has the tag (Inductor then keeps the op out of captured CUDA graphs); older torch has no such notion
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _absent(x: Tensor | None) -> bool:
    return x is None or x.numel() == 0


def _present(x: Tensor | None) -> Tensor | None:
    return None if _absent(x) else x


def logprob_backend(impl: str):
    """The module implementing ``impl``'s log-prob ``forward``, ``backward`` and ``stats_dtype``:
    ``grpo_fast.kernels.linear_logprobs`` for "triton" (imported on first use), else ``grpo_fast.logprobs_torch``."""
    if impl == "triton":
        from grpo_fast.kernels import linear_logprobs

        return linear_logprobs
    return logprobs_torch


# ---------------------------------------------------------------------------------------------------- log-probs
@torch.library.custom_op("grpo_fast::logprobs_fwd", mutates_args=())
def logprobs_fwd(
    hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Tensor | None, params: str, impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden ``[N, H]`` -> (logps ``[N]``, entropy ``[N]`` or empty, m ``[N]``, log_s ``[N]``); ``params``: a
    ``LogprobParams.to_json()``."""
    options = LogprobParams.from_json(params)
    logps, ent, m, log_s = logprob_backend(impl).forward(hidden, weight, target_ids, bias, options)
    return logps, (ent if ent is not None else logps.new_empty(_EMPTY)), m, log_s


@logprobs_fwd.register_fake
def _(hidden, weight, target_ids, bias, params, impl):
    n = hidden.shape[0]
    acc = logprob_backend(impl).stats_dtype(hidden.dtype)
    out = hidden.new_empty((n,), dtype=acc)
    ent = hidden.new_empty((n,) if LogprobParams.from_json(params).return_entropy else _EMPTY, dtype=acc)
    return out, ent, hidden.new_empty((n,), dtype=acc), hidden.new_empty((n,), dtype=acc)


@torch.library.custom_op("grpo_fast::logprobs_bwd", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def logprobs_bwd(
    hidden: Tensor, weight: Tensor, target_ids: Tensor, bias: Tensor | None, m: Tensor, log_s: Tensor,
    entropy: Tensor | None, g: Tensor | None, ge: Tensor | None, need_hidden: bool, need_weight: bool,
    need_bias: bool, params: str, impl: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (d hidden, d weight, d bias; empty where not needed): the Triton launcher (cuBLAS GEMMs over
    vocabulary chunks) or the chunked torch backward. The tensors after ``bias`` and the ``need_*`` flags are a
    ``BackwardInputs``' fields (a custom op's schema takes tensors and scalars, not objects)."""
    grads = BackwardInputs(SavedStats(m, log_s, _present(entropy)), _present(g), _present(ge), need_hidden,
                           need_weight, need_bias and bias is not None)
    gh, gw, gb = logprob_backend(impl).backward(hidden, weight, target_ids, bias, LogprobParams.from_json(params),
                                                grads)
    empty = lambda: hidden.new_empty(_EMPTY)  # noqa: E731 (outputs must not alias each other)
    return (empty() if gh is None else gh), (empty() if gw is None else gw), (empty() if gb is None else gb)


@logprobs_bwd.register_fake
def _(hidden, weight, target_ids, bias, m, log_s, entropy, g, ge, need_hidden, need_weight, need_bias, params, impl):
    return (hidden.new_empty(hidden.shape if need_hidden else _EMPTY),
            weight.new_empty(weight.shape if need_weight else _EMPTY),
            (bias if bias is not None else hidden).new_empty(bias.shape if need_bias and bias is not None else _EMPTY))


def _logprobs_setup(ctx, inputs, output):
    hidden, weight, target_ids, bias, params, impl = inputs
    _, ent, m, log_s = output
    ctx.save_for_backward(hidden, weight, target_ids, bias, m, log_s, ent)
    ctx.params, ctx.impl = params, impl
    # an output nobody differentiated arrives as None, not as zeros: an unused entropy must not select the
    # entropy-gradient kernel variant (or its extra work) for nothing
    ctx.set_materialize_grads(False)


def _logprobs_backward(ctx, g, ge, _gm, _gl):
    hidden, weight, target_ids, bias, m, log_s, ent = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    if g is None and ge is None:
        return None, None, None, None, None, None
    gh, gw, gb = logprobs_bwd(hidden, weight, target_ids, bias, m, log_s, ent, g, ge if not _absent(ent) else None,
                              need_h, need_w, need_b, ctx.params, ctx.impl)
    return (gh if need_h else None), (gw if need_w else None), None, (gb if need_b else None), None, None


logprobs_fwd.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


def logprobs_op(hidden, weight, target_ids, bias, params: LogprobParams, impl: str):
    """``(logps [N], entropy [N] or None)`` through the custom ops; hidden ``[N, H]``."""
    logps, ent, _, _ = logprobs_fwd(hidden, weight, target_ids, bias, params.to_json(), impl)
    return logps, (ent if params.return_entropy else None)


# ---------------------------------------------------------------------------------------------------- GRPO loss
@functools.lru_cache(maxsize=256)
def config_from_json(text: str) -> GRPOLossConfig:
    return GRPOLossConfig(**json.loads(text))


def _terms_fn(impl: str):
    if impl == "triton":
        from grpo_fast.kernels.grpo_loss import grpo_loss_terms_triton

        return grpo_loss_terms_triton
    from grpo_fast.loss_torch import grpo_loss_terms

    return grpo_loss_terms


@torch.library.custom_op("grpo_fast::loss_terms", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def loss_terms(
    logp: Tensor, entropy: Tensor | None, advantages: Tensor, mask: Tensor, old_logps: Tensor | None,
    ref_logps: Tensor | None, sampling_ratio: Tensor | None, num_items_in_batch: Tensor | None, config_json: str,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss ``[]``, d loss / d logp ``[B, T]``, d loss / d entropy ``[B, T]`` or empty, metrics ``[5]``: kl, entropy,
    clip_ratio_low, clip_ratio_high, clip_ratio_region, NaN where undefined)."""
    config = config_from_json(config_json)
    terms = _terms_fn(impl)(
        logp, advantages, mask, old_logps=old_logps, ref_logps=ref_logps, sampling_ratio=sampling_ratio,
        num_items_in_batch=num_items_in_batch, entropy=entropy, config=config,
    )
    nan = torch.full((), float("nan"), dtype=logp.dtype, device=logp.device)
    metrics = torch.stack([nan if t is None else t.to(logp.dtype) for t in terms[3:]])
    dent = terms.dentropy if terms.dentropy is not None else logp.new_empty(_EMPTY)
    return terms.loss.to(logp.dtype), terms.dlogp, dent, metrics


@loss_terms.register_fake
def _(logp, entropy, advantages, mask, old_logps, ref_logps, sampling_ratio, num_items_in_batch, config_json, impl):
    has_dent = config_from_json(config_json).entropy_coef != 0.0
    return (logp.new_empty(()), torch.empty_like(logp), torch.empty_like(logp) if has_dent else logp.new_empty(_EMPTY),
            logp.new_empty((5,)))


def _loss_setup(ctx, inputs, output):
    _, dlogp, dent, _ = output
    ctx.save_for_backward(dlogp, dent)
    ctx.set_materialize_grads(False)


def _loss_backward(ctx, g_loss, _g_dlogp, _g_dent, _g_metrics):
    if g_loss is None:
        return None, None, None, None, None, None, None, None, None, None
    dlogp, dent = ctx.saved_tensors
    g_ent = None if _absent(dent) or not ctx.needs_input_grad[1] else dent * g_loss
    return (dlogp * g_loss if ctx.needs_input_grad[0] else None), g_ent, None, None, None, None, None, None, None, None


loss_terms.register_autograd(_loss_backward, setup_context=_loss_setup)
