"""What a model does to its logits after the lm_head matmul, read from its config: what a drop-in that computes
log-probs from the hidden states and the lm_head weight must apply itself (the TRL and verl integrations)."""

from __future__ import annotations


def logit_scale(text_config) -> float:
    """The logit multiplier a model applies before softcap and temperature: Cohere ``logit_scale``,
    ``output_multiplier``, Falcon-H1 ``lm_head_multiplier``, ``1 / logits_scaling`` (Granite, MiniCPM3; HyperCLOVA X
    multiplies by it); 1.0 for the rest. TRL 1.16's fused head applies the same factor (``add_fused_lm_head``)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def scaled(hidden, bias, scale: float):
    """``(hidden, bias)`` with the logit scale folded in: ``(s h) W^T + s b = s (h W^T + b)``, so the lm_head matmul
    gives the scaled logits without a ``[N, V]`` multiply."""
    if scale == 1.0:
        return hidden, bias
    return hidden * scale, None if bias is None else bias * scale


def softcap(text_config) -> float | None:
    """``final_logit_softcapping`` (Gemma 2, ...), applied after the scale and before the temperature; None: off."""
    return getattr(text_config, "final_logit_softcapping", None)
