"""Loading the policy and its reference, and the precision they run in.

Mixed precision the usual way: the trained parameters and AdamW's states stay float32 (a bf16 weight cannot take an
update smaller than half its spacing, ~1e-4 for a weight of 0.02, so learning rates like 1e-6 would be rounded away)
and the forward passes run under ``torch.autocast`` in the compute dtype. The frozen reference copy and, with LoRA,
the frozen base weights are stored in the compute dtype directly.

QLoRA (``load_in_4bit``): the base's decoder linear layers are loaded through transformers' bitsandbytes integration
(``BitsAndBytesConfig``: NF4 or FP4 blocks of 64 weights, their scales quantized again with double quantization,
matmuls in the compute dtype); the embeddings and the lm_head (transformers leaves the output embedding and what is
tied to it unquantized) and the norms stay in the compute dtype, so the fused loss reads a floating-point lm_head.
The LoRA adapters stay float32, as with a bf16 base (TRL casts QLoRA adapters to bfloat16). A model built from a
config (the tiny one, a directory without weights) is saved to a temporary directory and loaded back quantized, so
every base goes through the same loader. The optimizer: torch's AdamW, or bitsandbytes' 8-bit / paged AdamW
(:func:`make_optimizer`, transformers' names and construction).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import tempfile
from pathlib import Path

import torch

from grpo_fast import fused_logprobs
from grpo_fast.bnb_layout import keep_training_layout
from grpo_fast.dtypes import DTYPES
from grpo_fast.train.checkpoint import check_weights
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
    return DTYPES[name]  # one of torch's names: TrainConfig validated it


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


def tokenizer_of(config: TrainConfig):
    """The run's tokenizer, left-padded, its pad token the EOS when it has none: the tiny model's, or the one saved
    in ``--tokenizer`` or ``--model`` (a ``FileNotFoundError`` naming ``TrainConfig.model`` when that is no
    directory). Cheap: the trainer reads it, and checks the prompts with it, before the weights load."""
    if config.model == "tiny":  # a tool task's has its tool's characters and the <call> token
        tokenizer = tiny_tokenizer(config.dataset.removeprefix("builtin:"))
    else:
        if not Path(config.model).is_dir():
            raise FileNotFoundError(
                f"TrainConfig.model: expected 'tiny' or a local model directory, got {config.model!r} (not a "
                "directory; grpo-fast never downloads models: save one with save_pretrained first)"
            )
        tokenizer = load_tokenizer(config.tokenizer or config.model,
                                   "TrainConfig.tokenizer" if config.tokenizer else "TrainConfig.model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def saved_model_config(config: TrainConfig):
    """``--model``'s config.json as transformers reads it, without the weights; None for the tiny model (built, not
    read) and for a directory whose config.json transformers cannot read (the model's load then says why)."""
    if config.model == "tiny":
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model)
    except (OSError, ValueError, KeyError):
        return None


# a rope scaling of these types stretches the positions the model was trained on by its factor (as vLLM reads it)
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def context_length(model_config) -> tuple[int, str] | None:
    """The most positions, prompt and completion together, a model's config declares, and where it says so
    (``max_position_embeddings``, or another architecture's name for it; times the factor of a linear, dynamic or
    yarn rope scaling, as vLLM counts); None when it declares none."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            break
    else:
        return None
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None)
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if kind in _STRETCHING_ROPE else None
    if isinstance(factor, (int, float)) and factor > 1:
        stretched = int((rope.get("original_max_position_embeddings") or value) * factor)
        if stretched > value:
            return stretched, f"{name} {value} with {kind} rope scaling x{factor:g}"
    return value, name


def check_context(config: TrainConfig, model_config, longest: tuple[str, int] | None, engine: str = "hf") -> None:
    """Refuses, before any generation, a run whose longest prompt (``(where, tokens)``, from ``check_prompts``) and
    ``max_new_tokens`` together take more positions than the model has: sampling would run past the positions it
    was trained on (a model with learned position embeddings fails outright, one with rope degrades), and for as
    many tokens as asked, however many that is. With the ``vllm`` engine (``engine``), a ``vllm_max_model_length``
    the model does not have, or too short for them, too (vLLM would refuse it at start, or cut completions short)."""
    if longest is None:
        return
    where, prompt = longest
    found = None if model_config is None else context_length(model_config)
    model = "the tiny model" if config.model == "tiny" else config.model
    if found is not None and prompt + config.max_new_tokens > found[0]:
        context, source = found
        room = (f"so at most {context - prompt} new tokens" if context > prompt
                else "no room for a completion: shorten the prompts")
        raise ValueError(
            f"TrainConfig.max_new_tokens {config.max_new_tokens} does not fit the model's context: {model} has "
            f"{context} positions ({source}) and the longest prompt ({where}) is {prompt} tokens once rendered, {room}"
        )
    limit = config.vllm_max_model_length
    if engine != "vllm" or limit is None:
        return
    if found is not None and limit > found[0]:
        raise ValueError(f"TrainConfig.vllm_max_model_length {limit} is more than the {found[0]} positions {model} has "
                         f"({found[1]}); vLLM refuses a longer max_model_len")
    if prompt + config.max_new_tokens > limit:
        raise ValueError(f"TrainConfig.vllm_max_model_length {limit} is less than the longest prompt ({where}, "
                         f"{prompt} tokens once rendered) plus TrainConfig.max_new_tokens {config.max_new_tokens}: "
                         f"vLLM would cut those completions short, or refuse the prompt; make it at least "
                         f"{prompt + config.max_new_tokens}, or leave it unset")


def load_model_and_tokenizer(config: TrainConfig, device: torch.device, storage_dtype: torch.dtype, tokenizer=None):
    """The model (parameters in ``storage_dtype``, on ``device``, in train mode, dropout off) and its tokenizer
    (``tokenizer``, when the caller has read it already with :func:`tokenizer_of`)."""
    tokenizer = tokenizer_of(config) if tokenizer is None else tokenizer
    if config.model == "tiny":
        model = tiny_model(tokenizer, config.seed)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(config.model)
        if _has_weights(path):
            check_weights(path, "TrainConfig.model")  # empty, truncated, or a .bin that needs more than tensors
            model = (load_4bit(config.model, config, device, storage_dtype) if config.load_in_4bit else
                     AutoModelForCausalLM.from_pretrained(config.model, dtype=storage_dtype))
        else:  # a config.json alone: the architecture with fresh weights from the seed
            logger.warning("model %s has no weights: building it from its config.json with random weights (seed %d)",
                           path, config.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model))
    if config.load_in_4bit:
        if not is_4bit(model):  # built from a config: quantized through the same loader
            from safetensors.torch import save_model

            with tempfile.TemporaryDirectory(prefix="grpo_fast_4bit_") as tmp:
                # every rank writes its own copy (save_pretrained writes on rank 0 only under a process group)
                model.config.save_pretrained(tmp)
                save_model(model, str(Path(tmp) / "model.safetensors"))  # a tied lm_head once
                model = load_4bit(tmp, config, device, storage_dtype)
        check_4bit_head(model)
    else:
        model = model.to(device=device, dtype=storage_dtype)
    model.train()  # from_pretrained returns eval mode, in which transformers skips activation checkpointing
    if config.disable_dropout:
        disable_dropout(model)
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model, tokenizer


def enable_activation_checkpointing(model) -> None:
    """transformers >= 5.2x calls it ``activation_checkpointing_enable``; earlier releases
    ``gradient_checkpointing_enable``."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def checkpointing_arguments(enabled: bool) -> dict:
    """``TrainingArguments``' activation-checkpointing switch under each name this transformers knows
    (``activation_checkpointing`` from 5.2x on; ``gradient_checkpointing``, whose default TRL sets to True)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {name: enabled for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}


def import_bitsandbytes(option: str):
    """bitsandbytes, or an ImportError that starts with ``option`` (what needed it)."""
    try:
        import bitsandbytes
    except ImportError:
        raise ImportError(f"{option} needs bitsandbytes >= 0.50, which is not installed: pip install "
                          "'grpo-fast[quant]' (or pip install 'bitsandbytes>=0.50')") from None
    return bitsandbytes


def bnb_4bit_config(config: TrainConfig, compute_dtype: torch.dtype):
    """transformers' ``BitsAndBytesConfig`` of a ``load_in_4bit`` run (what TRL's ``model_init_kwargs`` take as
    ``quantization_config``). No ``llm_int8_skip_modules``: transformers then leaves the output embedding, and what is
    tied to it, unquantized."""
    import_bitsandbytes("TrainConfig.load_in_4bit")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=config.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=config.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_4bit(path, config: TrainConfig, device: torch.device, dtype: torch.dtype):
    """The model saved in ``path`` with its decoder's linear weights in 4 bits, the rest in ``dtype``, on
    ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_4bit_config(config, dtype),
                                                 dtype=dtype, device_map={"": str(device)})
    keep_training_layout(model)  # no repacking for CPU inference behind the trainer's back (bnb_layout's docstring)
    return model


def is_4bit(model) -> bool:
    return bool(getattr(unwrap(model), "is_loaded_in_4bit", False))


def check_4bit_head(model) -> None:
    """Refuses a 4-bit model whose lm_head or input embedding was quantized: the fused loss and log-probs need the
    lm_head as a floating-point ``[V, H]`` weight."""
    inner = unwrap(model)
    for what, module in (("lm_head", inner.get_output_embeddings()), ("input embedding", inner.get_input_embeddings())):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
            raise ValueError(
                f"TrainConfig.load_in_4bit: {type(inner).__name__}'s {what} ({type(module).__name__}) was quantized "
                f"(weight dtype {getattr(weight, 'dtype', None)}); the fused loss needs a floating-point lm_head, so "
                "this architecture cannot be trained with a 4-bit base")


def trained_state(model, config: TrainConfig) -> dict:
    """What a checkpoint keeps of the model: its whole state dict, or with ``load_in_4bit`` the trained parameters
    only. The 4-bit base is frozen and rebuilt exactly from ``--model`` on resume (NF4/FP4 quantization is
    deterministic), and bitsandbytes' packed weights do not load back through ``load_state_dict``."""
    state = model.state_dict()
    if not config.load_in_4bit:
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def load_trained_state(model, state: dict, config: TrainConfig) -> None:
    """Loads what :func:`trained_state` saved; a state that is not this model's raises ``RuntimeError``."""
    if not config.load_in_4bit:
        model.load_state_dict(state)
        return
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(trained - set(state)), sorted(set(state) - trained)
    if missing or unexpected:
        raise RuntimeError(f"the 4-bit run's trained parameters do not match: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]}")
    model.load_state_dict(state, strict=False)


def merge_4bit_lora(model) -> torch.nn.Module:
    """A PEFT model over a 4-bit base as a plain float32 transformers model: every 4-bit weight dequantized and each
    adapter's ``scaling * B @ A`` added to its layer. (PEFT's own ``merge_and_unload`` quantizes the merged weight
    again, which rounds most of the adapters' change away.) The merged weights are the dequantized 4-bit values plus
    the adapters: the function that was trained, not the original full-precision weights plus the adapters."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            deltas[name] = sum(module.get_delta_weight(a).float() for a in module.active_adapters)
    base = model.unload()  # the base model with its 4-bit layers back, adapters dropped
    base = base.dequantize(dtype=torch.float32).to(torch.float32)
    with torch.no_grad():
        for name, delta in deltas.items():
            base.get_submodule(name).weight += delta.to(base.device)
    return base


def make_optimizer(params, config: TrainConfig, lr: float, device: torch.device, model=None):
    """``config.optim`` over ``params``, built as transformers' ``Trainer`` builds it (``TrainingArguments.optim``):
    torch's AdamW (``adamw_torch_fused``: ``fused=True``), or bitsandbytes' ``AdamW`` with ``optim_bits`` 8 or 32 and
    ``is_paged``; with 8-bit states the embeddings of ``model`` keep 32-bit ones (transformers' override)."""
    betas = tuple(config.adam_betas)
    if config.optim in ("adamw_torch", "adamw_torch_fused"):
        fused = {"fused": True} if config.optim == "adamw_torch_fused" else {}
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=config.weight_decay, **fused)
    paged = config.optim.startswith("paged_")
    if paged and device.type != "cuda":
        raise ValueError(f"TrainConfig.optim: {config.optim} pages its states through CUDA unified memory, so it needs "
                         f"a CUDA device, got {device.type}; use adamw_8bit (the same 8-bit states, not paged) or "
                         "adamw_torch_fused")
    bnb = import_bitsandbytes(f"TrainConfig.optim {config.optim}")
    bits = 8 if "8bit" in config.optim else 32
    optimizer = bnb.optim.AdamW(params, lr=lr, betas=betas, eps=1e-8, weight_decay=config.weight_decay,
                                optim_bits=bits, is_paged=paged)
    # bitsandbytes keeps its overrides in one process-wide manager keyed by (group, index) and id(parameter), so an
    # earlier optimizer's override (another run's embedding at index 0) would apply to this one's parameters: this
    # optimizer gets a manager of its own
    manager = bnb.optim.GlobalOptimManager.__new__(bnb.optim.GlobalOptimManager)
    manager.initialize()
    optimizer.mng = manager
    if bits == 8 and model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer



# TrainConfig.lr_schedule -> transformers' scheduler name (linear: lr_scheduler's own factor)
LR_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine"}


def lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_updates: int):
    """The learning-rate schedule of ``total_updates`` optimizer updates: ``transformers.get_scheduler``'s (TRL's
    ``lr_scheduler_type``), so update ``k < warmup_steps`` (counted from 0) uses ``k / warmup_steps`` of the rate (the
    first update lr 0) and update ``warmup_steps`` the full one. The linear decay is grpo-fast's own factor ``1 - (k -
    warmup) / (total - warmup)``, as it always was: transformers' ``(total - k) / (total - warmup)`` differs from it in
    the last bit, and gives 0, not 1, at ``k == warmup_steps == total`` (the rate a final checkpoint keeps)."""
    from transformers import get_scheduler

    warmup = config.warmup_steps
    if config.lr_schedule != "linear":
        return get_scheduler(LR_SCHEDULERS[config.lr_schedule], optimizer, num_warmup_steps=warmup,
                             num_training_steps=total_updates)

    def factor(update: int) -> float:
        if update < warmup:
            return update / warmup
        return 1.0 - min(1.0, (update - warmup) / max(1, total_updates - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

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
