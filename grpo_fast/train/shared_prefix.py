"""One prompt forward per group: the G completions of a prompt share its activations in the training forward.

GRPO samples G completions per prompt, and a plain training forward runs ``[prompt | completion]`` G times, so the
prompt's tokens go through every layer G times. :func:`shared_prefix_forward` packs each group into one row,

    [prompt (P, left-padded) | c_1 (T) | c_2 (T) | ... | c_G (T)]

with positions restarting after the prompt for every completion, and an attention pattern in which ``c_j`` sees the
prompt and its own earlier tokens only. Projections, MLPs and norms then see ``P + G*T`` tokens per group instead of
``G * (P + T)``; the prompt's activations receive the gradients of all G completions.

The attention pattern goes through transformers' attention-function registry, not through patched model code: the
model's attention implementation is switched to ``"grpo_fast_prefix|<inner>"`` (inner: ``sdpa`` or a flash-attention
one), a function that behaves exactly as ``<inner>`` for every ordinary call (generation included) and computes the
shared pattern only when the forward carries a :class:`PrefixLayout`. The shared pattern itself runs on
``torch.nn.functional.scaled_dot_product_attention`` (every device, every dtype) or on FlexAttention
(``backend="flex"``, for CUDA, no copies of the prompt's keys and values).

Exactness: hidden states, log-probs and gradients equal the unshared forward's up to summation order (tested in
float64 against :func:`grpo_fast.train.forward.completion_hidden` for Llama, Qwen2, Qwen3 and Mistral).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grpo_fast import checks
from grpo_fast.train.forward import decoder_of, position_ids_from_mask, unwrap

logger = logging.getLogger("grpo_fast.train")

PREFIX = "grpo_fast_prefix|"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
INNER_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
BACKENDS = ("sdpa", "flex")


class SharedPrefixUnsupported(ValueError):
    """The model or its options cannot run the shared-prefix forward; the message says why and what would work."""


@dataclass
class PrefixLayout:
    """Where the prompt and each completion sit in a packed row, and the two attention masks built once per forward
    (every layer reuses them). ``calls`` counts the attention layers that consumed the layout: the forward checks
    that every layer did, so a model whose layers bypass the registry cannot silently attend to everything."""

    prompt_len: int
    completion_len: int
    group_size: int
    backend: str
    prompt_attend: torch.Tensor | None = None  # [B, 1, P, P] bool
    completion_attend: torch.Tensor | None = None  # [B*G, 1, T, P+T] bool
    block_mask: object = None  # FlexAttention BlockMask over the packed row
    calls: int = field(default=0)


# ----------------------------------------------------------------------------------------------- registry


def _wrapped(inner: str):
    """The registered attention function for ``inner``: ``inner`` itself unless the call carries a layout."""
    from transformers import AttentionInterface

    inner_fn = AttentionInterface._global_mapping[inner]

    def attention(module, query, key, value, attention_mask, *args, grpo_fast_prefix: PrefixLayout | None = None,
                  **kwargs):
        if grpo_fast_prefix is None:
            return inner_fn(module, query, key, value, attention_mask, *args, **kwargs)
        grpo_fast_prefix.calls += 1
        return _shared_attention(module, query, key, value, grpo_fast_prefix, scaling=kwargs.get("scaling"))

    attention.__name__ = f"grpo_fast_prefix_{inner}"
    return attention


def _register(inner: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = PREFIX + inner
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapped(inner))
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[inner])
    return name


def unsupported_reason(model, backend: str = "sdpa") -> str | None:
    """Why ``model`` cannot run :func:`shared_prefix_forward` (None when it can)."""
    from transformers import PreTrainedModel

    base = unwrap(model)
    if not isinstance(base, PreTrainedModel):
        return (f"model: expected a transformers PreTrainedModel (or a PEFT wrapper of one), got "
                f"{type(model).__name__}")
    config = base.config
    if backend not in BACKENDS:
        return f"backend: expected one of {BACKENDS}, got {backend!r}"
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {model_type!r} is not one whose shared-prefix forward is tested "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    implementation = (config._attn_implementation or "eager").removeprefix(PREFIX)
    if implementation not in INNER_IMPLEMENTATIONS:
        return (f"attention implementation {implementation!r} cannot be wrapped (supported: "
                f"{', '.join(INNER_IMPLEMENTATIONS)}); load the model with attn_implementation='sdpa'")
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if "sliding_attention" in layer_types or (model_type == "mistral" and sliding is not None):
        return "sliding-window attention layers are not supported by the shared-prefix forward"
    if getattr(config, "attention_dropout", 0.0) and base.training:
        return f"attention dropout {config.attention_dropout} is on (the shared pattern has no dropout)"
    return None


def enable(model, backend: str = "sdpa") -> None:
    """Switch ``model`` to the wrapping attention implementation (idempotent); raises
    :class:`SharedPrefixUnsupported` when :func:`unsupported_reason` gives a reason."""
    _check_supported(model, backend)
    _switch(model, backend)


def _check_supported(model, backend: str) -> None:
    reason = unsupported_reason(model, backend)
    if reason is not None:
        raise SharedPrefixUnsupported(f"shared_prefix_forward: {reason}")


def _switch(model, backend: str) -> None:
    config = unwrap(model).config
    if not config._attn_implementation.startswith(PREFIX):
        name = _register(config._attn_implementation)
        unwrap(model).set_attn_implementation(name)
        _announce(name, backend)


@functools.cache  # once a process: the trainer switches both the policy and its reference
def _announce(name: str, backend: str) -> None:
    logger.info("shared prefix: attention implementation %s (the shared pattern runs on %s)", name, backend)


# ---------------------------------------------------------------------------------------------- attention


def _shared_attention(module, query, key, value, layout: PrefixLayout, scaling: float | None):
    """Attention over packed rows; returns ``[B, L, heads, d]`` like transformers' attention functions."""
    if layout.backend == "flex":
        out = _flex(query, key, value, layout, scaling)
        return out.transpose(1, 2).contiguous(), None
    B, heads, L, d = query.shape
    kv_heads = key.shape[1]
    P, T, G = layout.prompt_len, layout.completion_len, layout.group_size
    gqa = {"enable_gqa": True} if kv_heads != heads else {}

    def per_completion(x):  # [B, h, G*T, d] -> [B*G, h, T, d]
        return x[:, :, P:].unflatten(2, (G, T)).transpose(1, 2).flatten(0, 1)

    prompt_out = F.scaled_dot_product_attention(
        query[:, :, :P], key[:, :, :P], value[:, :, :P], attn_mask=layout.prompt_attend, scale=scaling, **gqa)
    # each completion attends to [prompt | itself]: the prompt's keys and values are repeated per completion (a
    # K/V-sized copy; the FlexAttention backend needs none)
    k = torch.cat([key[:, :, :P].repeat_interleave(G, dim=0), per_completion(key)], dim=2)
    v = torch.cat([value[:, :, :P].repeat_interleave(G, dim=0), per_completion(value)], dim=2)
    completion_out = F.scaled_dot_product_attention(
        per_completion(query), k, v, attn_mask=layout.completion_attend, scale=scaling, **gqa)
    completion_out = completion_out.unflatten(0, (B, G)).transpose(1, 2).flatten(2, 3)  # [B, h, G*T, d]
    return torch.cat([prompt_out, completion_out], dim=2).transpose(1, 2).contiguous(), None


def _flex(query, key, value, layout: PrefixLayout, scaling):
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if query.is_cuda else flex_attention
    return fn(query, key, value, block_mask=layout.block_mask, scale=scaling,
              enable_gqa=key.shape[1] != query.shape[1])


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _masks(layout: PrefixLayout, prompt_mask: torch.Tensor) -> None:
    """Fill the layout's masks. Prompt: causal over real tokens (a padding query sees itself, so no row is empty).
    Completion: the prompt's real tokens, then causal over its own tokens."""
    B, P = prompt_mask.shape
    T, G, device = layout.completion_len, layout.group_size, prompt_mask.device
    real = prompt_mask.bool()
    if layout.backend == "flex":
        layout.block_mask = _block_mask(real, P, T, G)
        return
    eye = torch.eye(P, dtype=torch.bool, device=device)
    causal_p = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    layout.prompt_attend = ((causal_p & real[:, None, :]) | eye)[:, None]
    causal_c = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    to_prompt = real[:, None, :].expand(B, T, P)
    completion = torch.cat([to_prompt, causal_c.expand(B, T, T)], dim=2)  # [B, T, P+T]
    layout.completion_attend = completion.repeat_interleave(G, dim=0)[:, None]


def _block_mask(real: torch.Tensor, P: int, T: int, G: int):
    from torch.nn.attention.flex_attention import create_block_mask

    B = real.shape[0]
    L = P + G * T

    def mask_mod(b, h, q, kv):
        q_prompt, kv_prompt = q < P, kv < P
        kv_real = real[b, kv.clamp(max=P - 1)]
        prompt_rule = kv_prompt & (kv <= q) & (kv_real | (kv == q))
        same_completion = ((q - P) // T) == ((kv - P) // T)
        completion_rule = (kv_prompt & kv_real) | (~kv_prompt & same_completion & (kv <= q))
        return torch.where(q_prompt, prompt_rule, completion_rule)

    return create_block_mask(mask_mod, B, None, L, L, device=real.device)


# ------------------------------------------------------------------------------------------------ forward


def check_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size) -> None:
    """Types, shapes and values of :func:`shared_prefix_forward`'s arguments (``model`` already supported); the
    value checks cost a host sync each (mask values, left padding, the two id ranges)."""
    fn = "shared_prefix_forward"
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    checks.check_tensor(fn, "prompt_ids", prompt_ids, ndim=2, dtypes="int")
    device = prompt_ids.device
    checks.check_tensor(fn, "prompt_mask", prompt_mask, device=device, like="prompt_ids")
    checks.check_tensor(fn, "completion_ids", completion_ids, ndim=2, dtypes="int", device=device, like="prompt_ids")
    checks.check_tensor(fn, "completion_mask", completion_mask, device=device, like="prompt_ids")
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids, prompt_mask: expected two [B, P] tensors, got {tuple(prompt_ids.shape)} "
                         f"and {tuple(prompt_mask.shape)}")
    B = prompt_ids.shape[0]
    if B == 0:
        raise ValueError(f"{fn}: prompt_ids must hold at least one prompt (B >= 1), got {checks.describe(prompt_ids)}")
    if completion_mask.shape != completion_ids.shape:
        raise ValueError(f"completion_ids, completion_mask: expected two [B*G, T] tensors, got "
                         f"{tuple(completion_ids.shape)} and {tuple(completion_mask.shape)}")
    if completion_ids.shape[0] != B * group_size:
        raise ValueError(f"completion_ids: expected B*G = {B}*{group_size} = {B * group_size} rows (G completions per "
                         f"prompt, grouped by prompt), got {completion_ids.shape[0]}")
    meta = next((name for name, p in unwrap(model).named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"{fn}: model must hold data, got its parameter {meta} on the meta device; materialise the "
                         "model first (e.g. model.to_empty(device=...) and load its weights)")
    real = checks.check_mask(fn, "prompt_mask", prompt_mask)
    if prompt_ids.shape[1] == 0 or not bool(real[:, -1].all()):
        raise ValueError("prompt_mask: expected left-padded prompts (the last column real in every row), got a row "
                         "whose last token is padding or an empty prompt")
    vocab = unwrap(model).get_input_embeddings().weight.shape[0]
    for name, ids in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        checks.check_token_ids(fn, name, ids, vocab, rows="the rows of the model's input embedding")


def packed_inputs(prompt_ids, prompt_mask, completion_ids, group_size):
    """Input ids and position ids ``[B, P + G*T]`` of the packed rows."""
    B, P = prompt_ids.shape
    T = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids.reshape(B, group_size * T)], dim=1)
    lengths = prompt_mask.long().sum(dim=1, keepdim=True)
    completion_pos = (lengths + torch.arange(T, device=lengths.device)).repeat(1, group_size)
    position_ids = torch.cat([position_ids_from_mask(prompt_mask), completion_pos], dim=1)
    return input_ids, position_ids


def shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size: int,
                          backend: str = "sdpa") -> torch.Tensor:
    """Completion hidden states ``[B*G, T, H]`` with each group's prompt run once; ``hidden[:, t]`` predicts
    ``completion_ids[:, t]``, as :func:`grpo_fast.train.forward.completion_hidden` returns for the unshared rows.

    Args:
        model: a transformers causal LM (or a PEFT wrapper of one) of a supported architecture (Llama, Qwen2, Qwen3,
            Mistral without sliding windows) with an ``sdpa`` or flash-attention implementation. The first call
            whose arguments pass the checks switches it to the wrapping implementation (ordinary calls are
            unchanged).
        prompt_ids, prompt_mask: ``[B, P]`` (B >= 1), left-padded, one row per group; the mask holds only 0 and 1.
        completion_ids, completion_mask: ``[B*G, T]``, right-padded; rows ``b*G .. b*G+G-1`` belong to prompt ``b``.
            Ids (prompts' padding included) must be rows of the model's input embedding. ``T = 0`` gives
            ``[B*G, 0, H]``.
        group_size: G.
        backend: ``"sdpa"`` (any device) or ``"flex"`` (FlexAttention; its backward needs CUDA).

    Raises:
        SharedPrefixUnsupported: for an architecture or option the packed pattern would get wrong.
        ValueError (TypeError for a wrong type): for inconsistent shapes, a mask other than 0/1, ids outside the
            vocabulary, meta tensors or a model on the meta device; the message names the argument.
    """
    _check_supported(model, backend)
    check_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size)
    _switch(model, backend)  # only for inputs it will run: a refused call leaves the model as it was
    B, P = prompt_ids.shape
    T, G = completion_ids.shape[1], group_size
    input_ids, position_ids = packed_inputs(prompt_ids, prompt_mask, completion_ids, G)
    layout = PrefixLayout(prompt_len=P, completion_len=T, group_size=G, backend=backend)
    _masks(layout, prompt_mask)
    # A 4D mask is passed through transformers' mask preparation untouched; only the wrapped attention sees it, and
    # it reads the layout instead. (A 2D mask or none would make transformers build an L x L mask it never needs.)
    placeholder = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    decoder = decoder_of(model)
    out = decoder(input_ids=input_ids, attention_mask=placeholder, position_ids=position_ids, use_cache=False,
                  grpo_fast_prefix=layout)
    layers = unwrap(model).config.num_hidden_layers
    if layout.calls != layers:
        raise SharedPrefixUnsupported(
            f"shared_prefix_forward: {layout.calls} of the model's {layers} attention layers used the shared-prefix "
            f"attention; this architecture does not pass the forward's keyword arguments to its attention function")
    hidden = out.last_hidden_state  # [B, P + G*T, H]
    last_prompt = hidden[:, P - 1, None, None, :].expand(B, G, 1, hidden.shape[-1])
    completions = hidden[:, P:].unflatten(1, (G, T))[:, :, : T - 1]
    return torch.cat([last_prompt, completions], dim=2)[:, :, :T].flatten(0, 1)  # [:T]: T = 0 has no last_prompt


def token_counts(prompt_len: int, completion_len: int, groups: int, group_size: int) -> tuple[int, int]:
    """Tokens through the model per forward, (unshared, shared), for ``groups`` padded groups."""
    return groups * group_size * (prompt_len + completion_len), groups * (prompt_len + group_size * completion_len)
