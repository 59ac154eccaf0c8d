"""grpo-fast inside verl 0.9.1: log-probs and entropy from the hidden states, and verl's policy losses.

Switched on by verl's own config, with nothing to import in the entry script. Installing grpo-fast next to verl adds
a ``verl.plugins`` entry point; ``import verl`` loads it in every process, Ray workers included (verl imports its
plugins in ``verl/__init__.py``), and it calls ``install()``, which

- teaches verl's ``patch_forward_with_backends`` a fused-kernel backend ``grpo_fast``: with
  ``actor_rollout_ref.model.use_fused_kernels=True`` and
  ``actor_rollout_ref.model.fused_kernel_options.impl_backend=grpo_fast`` the actor's and the reference's forward
  return ``log_probs`` and ``entropy`` from ``grpo_fast.fused_logprobs(hidden, lm_head.weight, labels)``, never the
  ``[tokens, V]`` logits. An untied lm_head that FSDP2 shards as a unit of its own is gathered through
  ``register_fsdp_forward_method`` (verl's own fused path fails there: "got mixed torch.Tensor and DTensor");
- registers grpo-fast's one-pass versions of verl's policy losses as ``grpo_fast.<name>`` (select one with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=grpo_fast.vanilla``; ``LOSS_MODES``), and names those it refuses.

Why an entry point and not a call in the entry script: verl builds the actor in Ray worker processes, which never run
the driver script; an entry point is imported wherever verl is. It changes nothing until a config selects the backend
or a loss (``VERL_USE_EXTERNAL_PLUGINS=none`` turns verl's plugin loading off altogether). ``install()`` is idempotent
and may also be called by hand. Docs: docs/verl.md.
"""

from __future__ import annotations

import functools
import logging
import os
import types

import torch

from grpo_fast.integrations import heads

BACKEND = "grpo_fast"
TESTED_VERL = "0.9.1"
IMPL_ENV = "GRPO_FAST_VERL_IMPL"  # fused_logprobs' impl: auto (default), triton or torch; read in each process
LOSS_PREFIX = "grpo_fast."
_HEAD_METHOD = "_grpo_fast_logprobs"

# verl's model types whose forward verl replaces with a model-specific one (vision-language inputs, rope deltas):
# grpo-fast's forward is the dense text model's, so these are refused rather than run through the wrong forward
_OWN_FORWARD_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe")

logger = logging.getLogger(__name__)
_installed = False


def install() -> None:
    """Adds the ``grpo_fast`` fused-kernel backend and the ``grpo_fast.*`` policy losses to verl (idempotent)."""
    global _installed
    if _installed:
        return
    import verl
    from verl.models.transformers import monkey_patch

    if verl.__version__ != TESTED_VERL:
        logger.warning("grpo-fast: its verl backend and losses are tested with verl %s; this is verl %s",
                       TESTED_VERL, verl.__version__)
    original = monkey_patch.patch_forward_with_backends
    monkey_patch.patch_forward_with_backends = _with_grpo_fast_backend(original)
    _register_losses()
    _installed = True


def _with_grpo_fast_backend(original):
    @functools.wraps(original)
    def patch_forward_with_backends(model, *args, **kwargs):
        # verl 0.9.1's signature is (model, use_fused_kernels=False, fused_kernels_backend=None); anything else is
        # handed to verl's own function as it came
        bound = dict(zip(("use_fused_kernels", "fused_kernels_backend"), args), **kwargs)
        if not bound.get("use_fused_kernels") or bound.get("fused_kernels_backend") != BACKEND:
            return original(model, *args, **kwargs)
        model_type = getattr(model.config, "model_type", None)
        if model_type in _OWN_FORWARD_MODEL_TYPES:
            raise NotImplementedError(
                f"fused_kernel_options.impl_backend={BACKEND!r}: model_type {model_type!r} has a forward of its own "
                "in verl (vision-language inputs), which grpo-fast does not cover yet; use impl_backend='torch' or "
                "use_fused_kernels=False for it"
            )
        model._verl_fused_kernels_backend = BACKEND
        # this model's forward, not its class's (verl's backends patch the class: every model of the class in the
        # process, a reference or a reward model of another config included)
        model.forward = forward_with_grpo_fast.__get__(model)
        logger.warning("grpo-fast: %s computes log-probs and entropy with grpo_fast.fused_logprobs (impl=%s; no "
                       "[tokens, V] logits)", model.__class__.__name__, _impl())

    patch_forward_with_backends.grpo_fast_backend = BACKEND  # what install() added (functools.wraps copies the rest)
    return patch_forward_with_backends


def _check_layout(model) -> None:
    """Refuses, by name, the layouts the fused head does not cover (instead of computing something else)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:
        raise NotImplementedError(
            f"fused_kernel_options.impl_backend={BACKEND!r} does not support Ulysses sequence parallelism yet "
            f"(ulysses_sequence_parallel_size={sp}); use ulysses_sequence_parallel_size=1 or impl_backend='torch'"
        )
    head = model.get_output_embeddings()
    if hasattr(head, "base_layer"):  # a PEFT adapter on the lm_head: its .weight would be the base weight alone
        raise NotImplementedError(
            f"fused_kernel_options.impl_backend={BACKEND!r}: the lm_head carries a LoRA adapter "
            f"({type(head).__name__}); fused_logprobs reads lm_head.weight, which leaves the adapter out. Keep "
            "lm_head out of lora target_modules ('all-linear' does) or use use_fused_kernels=False"
        )


def _impl() -> str:
    from grpo_fast.dispatch import IMPLS

    impl = os.environ.get(IMPL_ENV, "auto")
    allowed = tuple(i for i in IMPLS if i != "reference")  # reference materialises the logits: not a backend
    if impl not in allowed:
        raise ValueError(f"{IMPL_ENV} must be one of {', '.join(allowed)}, got {impl!r}")
    return impl


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                   text_config):
    """``(log_probs, entropy)`` of ``labels`` under the model's logits ``head(hidden)`` (its logit scale and softcap
    applied as its forward applies them, then the temperature); a method of the lm_head, so FSDP2 gathers an lm_head
    it shards as its own unit around the call (``register_fsdp_forward_method``) and reshards it after."""
    from grpo_fast import fused_logprobs

    weight, bias = head.weight, getattr(head, "bias", None)
    if hidden.dtype != weight.dtype:  # verl's mixed precision may leave the last norm's output in float32
        hidden = hidden.to(weight.dtype)
    hidden, bias = heads.scaled(hidden, bias, heads.logit_scale(text_config))
    return fused_logprobs(hidden, weight, labels.to(torch.int64), bias=bias, temperature=float(temperature),
                          softcap=heads.softcap(text_config), return_entropy=True, impl=_impl())


def _cloned_head_logprobs(head: torch.nn.Module, *args):
    return tuple(t.clone() for t in _head_logprobs(head, *args))


def _head_method(head: torch.nn.Module):
    """The lm_head's fused-log-prob method, registered once as an FSDP2 forward method when the head is an FSDP2
    unit of its own (untied heads under verl's wrap policy); a plain call otherwise."""
    method = getattr(head, _HEAD_METHOD, None)
    if method is None:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if isinstance(head, FSDPModule):
            # the outputs leave as new tensors, not views: FSDP2 hooks its pre-backward on them, and an in-place op
            # on a view would drop the hook (FSDP2 warns "returned a view tensor")
            setattr(head, _HEAD_METHOD, types.MethodType(_cloned_head_logprobs, head))
            register_fsdp_forward_method(head, _HEAD_METHOD)
        else:
            setattr(head, _HEAD_METHOD, types.MethodType(_head_logprobs, head))
        method = getattr(head, _HEAD_METHOD)
    return method


def forward_with_grpo_fast(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.FloatTensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    cache_position: torch.LongTensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    temperature: float = 1.0,
    shift_labels: torch.LongTensor | None = None,
    **loss_kwargs,
):
    """verl's ``forward_with_torch_backend`` contract (``CausalLMOutputForPPO`` with ``log_probs`` and ``entropy``
    of the rolled labels, ``shift_labels`` taking precedence), computed by ``grpo_fast.fused_logprobs``."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    if not return_dict:
        raise NotImplementedError(f"fused_kernel_options.impl_backend={BACKEND!r}: the forward has to return_dict")
    _check_layout(self)
    outputs = forward_base_model(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        cache_position=cache_position,
    )
    if shift_labels is not None:  # rolled over the whole sequence by the engine (packed batches, SP slices)
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise RuntimeError(f"impl_backend={BACKEND!r}: the forward needs labels, shift_labels or input_ids")
    text_config = self.config.get_text_config()
    log_probs, entropy = _head_method(self.get_output_embeddings())(outputs[0], rolled, temperature, text_config)
    return CausalLMOutputForPPO(
        log_probs=log_probs,
        entropy=entropy,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


# ---------------------------------------------------------------------------------------------- policy losses
def loss_params(config):
    """grpo-fast's ``VerlLossParams`` from verl's ``ActorConfig`` (the fields verl's own losses read)."""
    from grpo_fast.verl_losses import VerlLossParams

    policy = config.policy_loss
    return VerlLossParams(
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.get("clip_ratio_c", None),
        tau_pos=config.get("tau_pos", None),
        tau_neg=config.get("tau_neg", None),
        clip_cov_ratio=policy.get("clip_cov_ratio", None),
        clip_cov_lb=policy.get("clip_cov_lb", None),
        clip_cov_ub=policy.get("clip_cov_ub", None),
        kl_cov_ratio=policy.get("kl_cov_ratio", None),
        ppo_kl_coef=policy.get("ppo_kl_coef", None),
        dro_beta=policy.get("dro_beta", None),
    )


def _verl_loss(name: str):
    from grpo_fast.verl_losses import policy_loss

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        if config is None:
            raise ValueError(f"policy loss {LOSS_PREFIX + name!r}: config (verl's ActorConfig) is required")
        if log_prob.dtype in (torch.bfloat16, torch.float16):  # the one-pass path computes in float32 or float64
            log_prob = log_prob.float()
        return policy_loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                           loss_params(config), rollout_is_weights=rollout_is_weights,
                           global_batch_info=dict(getattr(config, "global_batch_info", None) or {}))

    loss_fn.__name__ = f"grpo_fast_{name}"
    loss_fn.__doc__ = f"verl's {name!r} policy loss on grpo-fast's one-pass loss path (grpo_fast.verl_losses)."
    return loss_fn


def _refused(name: str, reason: str):
    def loss_fn(*args, **kwargs):
        raise NotImplementedError(f"policy loss {LOSS_PREFIX + name!r} is not offered by grpo-fast: {reason}. "
                                  f"verl's own {name!r} (loss_mode={name}) is unaffected")

    return loss_fn


def _register_losses() -> None:
    from verl.trainer.ppo.core_algos import register_policy_loss

    from grpo_fast.verl_losses import LOSS_NAMES, REFUSED

    for name in LOSS_NAMES:
        register_policy_loss(LOSS_PREFIX + name)(_verl_loss(name))
    for name, reason in REFUSED.items():
        register_policy_loss(LOSS_PREFIX + name)(_refused(name, reason))


def loss_modes() -> tuple[str, ...]:
    """The ``policy_loss.loss_mode`` values grpo-fast offers verl."""
    from grpo_fast.verl_losses import LOSS_NAMES

    return tuple(LOSS_PREFIX + name for name in LOSS_NAMES)
