"""Training forward: completion hidden states for the fused loss, never the ``[B, T, V]`` logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Head:
    """What the fused ops need from a causal LM's output layer: the lm_head weight (``[V, H]``, possibly tied to
    the input embedding), its bias, and the final-logit softcap (Gemma-2) of the architecture."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    softcap: float | None


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that start at 0 on the first real token of each (left-padded) row; padding gets 0."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def unwrap(model):
    """The transformers ``PreTrainedModel`` inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_of(model):
    """The module that maps input ids to the last (normed) hidden states: ``model.model`` for Llama/Qwen/Gemma."""
    decoder = unwrap(model).get_decoder()
    if decoder is unwrap(model):
        raise ValueError(
            f"model: expected a causal LM with a separate decoder (e.g. LlamaForCausalLM.model), got "
            f"{type(unwrap(model)).__name__} whose get_decoder() returns itself"
        )
    return decoder


def head_of(model) -> Head:
    base = unwrap(model)
    lm_head = base.get_output_embeddings()
    if lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(f"model: expected a causal LM with an lm_head, got {type(base).__name__} without one")
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return Head(weight=lm_head.weight, bias=getattr(lm_head, "bias", None), softcap=softcap)


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """Hidden states ``[R, T, H]`` where ``hidden[:, t]`` predicts ``completion_ids[:, t]``.

    Prompts ``[R, P]`` left-padded, completions ``[R, T]`` right-padded: one forward over ``[prompt | completion]``.
    """
    P = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    out = decoder_of(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, P - 1 : -1]
