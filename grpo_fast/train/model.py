"""Loading the policy and its reference, and the precision they run in.

Mixed precision the usual way: the trained parameters and AdamW's states stay float32 (a bf16 weight cannot take an
update smaller than half its spacing, ~1e-4 for a weight of 0.02, so learning rates like 1e-6 would be rounded away)
and the forward passes run under ``torch.autocast`` in the compute dtype. The frozen reference copy and, with LoRA,
the frozen base weights are stored in the compute dtype directly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from pathlib import Path

import torch

from grpo_fast import fused_logprobs
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.forward import decoder_of, head_of, position_ids_from_mask, unwrap
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

logger = logging.getLogger("grpo_fast.train")

# LoRA on these would change the logits through an adapter the fused loss does not see
_HEAD_MODULES = ("lm_head", "embed_tokens", "wte", "output")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device: {name!r} asked for, but torch.cuda.is_available() is False")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype: bfloat16 on CUDA and float32 on CPU for "auto"."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def autocast(device: torch.device, dtype: torch.dtype):
    """The forward-pass context for ``dtype`` (nothing for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.safetensors.index.json"))


# what a saved tokenizer leaves in its directory (tokenizer.json, tokenizer_config.json, tokenizer.model,
# vocab.json, vocab.txt, merges.txt, spiece.model, *.tiktoken): a directory with none of them holds no tokenizer
_TOKENIZER_FILE = re.compile(r"(tokenizer|vocab|merges|spiece).*|.*\.tiktoken")
_PROBE_TEXT = "max 3 8 1 6= Hello"  # any tokenizer with a vocabulary encodes it to at least one token


def load_tokenizer(path: str | Path, option: str = "tokenizer"):
    """The tokenizer saved in directory ``path``, left-padded: ``AutoTokenizer``, except where the directory's
    tokenizer_config.json names the generic fast tokenizer (``TokenizersBackend`` / ``PreTrainedTokenizerFast``, as
    the tiny model's does), which is loaded as such. transformers 5's ``AutoTokenizer`` maps every ``qwen2``
    directory to ``Qwen2Tokenizer``, which rebuilds a byte-level BPE around the vocabulary and drops the tiny
    character tokenizer's spaces.

    A directory without a tokenizer is a ``ValueError`` that starts with ``option`` and names the directory:
    ``AutoTokenizer`` would build an empty tokenizer from its config.json alone, which encodes every prompt to no
    tokens at all."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{option}: expected a directory holding a tokenizer, got {str(path)!r} (not a "
                                "directory; grpo-fast never downloads)")
    hint = f"save the model's tokenizer there with tokenizer.save_pretrained({str(path)!r})"
    if not any(_TOKENIZER_FILE.fullmatch(f.name) for f in path.iterdir()):
        raise ValueError(f"{option}: {path} holds no tokenizer (no tokenizer.json, tokenizer_config.json, "
                         f"tokenizer.model or vocab file); {hint}")
    config_file = path / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, padding_side="left")
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if not tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]:
        raise ValueError(f"{option}: the tokenizer in {path} has no vocabulary ({type(tokenizer).__name__} encodes "
                         f"{_PROBE_TEXT!r} to no tokens); {hint}")
    return tokenizer


def load_model_and_tokenizer(config: TrainConfig, device: torch.device, storage_dtype: torch.dtype):
    """The model (parameters in ``storage_dtype``, on ``device``, in train mode, dropout off) and its tokenizer."""
    if config.model == "tiny":
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, config.seed)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(config.model)
        if not path.is_dir():
            raise FileNotFoundError(
                f"TrainConfig.model: expected 'tiny' or a local model directory, got {config.model!r} (not a "
                "directory; grpo-fast never downloads models: save one with save_pretrained first)"
            )
        tokenizer = load_tokenizer(config.tokenizer or config.model,
                                   "TrainConfig.tokenizer" if config.tokenizer else "TrainConfig.model")
        if _has_weights(path):
            model = AutoModelForCausalLM.from_pretrained(config.model, dtype=storage_dtype)
        else:  # a config.json alone: the architecture with fresh weights from the seed
            logger.warning("model %s has no weights: building it from its config.json with random weights (seed %d)",
                           path, config.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = model.to(device=device, dtype=storage_dtype)
    model.train()  # from_pretrained returns eval mode, in which transformers skips activation checkpointing
    if config.disable_dropout:
        disable_dropout(model)
    if config.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    return model, tokenizer


def disable_dropout(model) -> None:
    """Dropout off everywhere (as TRL's ``disable_dropout``): the old, reference and policy passes of one sample
    must see the same function, or the importance ratio measures dropout noise."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p != 0:
            module.p, changed = 0.0, changed + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout != 0:
            module.attention_dropout, changed = 0.0, changed + 1
    if changed:
        logger.info("dropout switched off in %d modules", changed)


def attach_lora(model, config: TrainConfig):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("TrainConfig.lora_r > 0 needs peft (pip install peft)") from None
    bad = [m for m in config.lora_target_modules if m in _HEAD_MODULES]
    if bad:
        raise ValueError(
            f"TrainConfig.lora_target_modules: {bad} would put an adapter on the lm_head or the embedding, which the "
            "fused loss reads as a plain weight; target the decoder's projections (q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj)"
        )
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, target_modules=config.lora_target_modules,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def frozen_copy(model, dtype: torch.dtype):
    """The reference policy: a copy of the initial model in ``dtype``, eval mode, no gradients."""
    ref = copy.deepcopy(model).to(dtype).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@torch.no_grad()
def check_head(model, vocab_size: int, device: torch.device) -> float:
    """Refuses a model whose logits are not ``softcap(lm_head(last hidden state))``: the fused ops compute log-probs
    from exactly that, so an architecture that scales or post-processes its logits otherwise (Cohere's
    ``logit_scale``, Granite's ``logits_scaling``, ...) would train on other log-probs than it samples from.

    Compares, on a short probe sequence, the model's own ``log_softmax(logits)`` with ``fused_logprobs``; returns the
    largest difference.
    """
    was_training = model.training
    model.eval()
    try:
        ids = (torch.arange(12, device=device) * 7 + 3) % vocab_size
        ids, mask = ids[None], torch.ones(1, 12, dtype=torch.long, device=device)
        pos = position_ids_from_mask(mask)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, :-1].float()
        expected = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        hidden = decoder_of(model)(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[0, :-1]
        head = head_of(model)
        got = fused_logprobs(hidden, head.weight.to(hidden.dtype), ids[0, 1:], softcap=head.softcap,
                             bias=None if head.bias is None else head.bias.to(hidden.dtype), impl="torch")
    finally:
        model.train(was_training)
    gap = float((got.float() - expected).abs().max())
    tolerance = 1e-3 if hidden.dtype in (torch.float32, torch.float64) else 5e-2
    if gap > tolerance:
        raise ValueError(
            f"model: {type(unwrap(model)).__name__}'s logits are not softcap(lm_head(last hidden state)) (the fused "
            f"log-probs differ from the model's own by {gap:.3g} > {tolerance}); the architecture post-processes its "
            "logits in a way grpo-fast does not model, so it is not supported"
        )
    return gap
