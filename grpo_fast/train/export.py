"""Trained models that leave the trainer: a ``save_pretrained`` directory any transformers user can load.

At the end of every run ``output_dir/model/`` holds the trained model (``save_model``), and ``grpo-fast export
CHECKPOINT OUT_DIR`` makes the same directory from any checkpoint (``export_checkpoint``):

- full fine-tuning: ``model.safetensors`` (float32, the trained master weights), ``config.json``,
  ``generation_config.json`` and the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with its chat template,
  if it has one): ``AutoModelForCausalLM.from_pretrained(DIR)``, ``AutoTokenizer.from_pretrained(DIR)``,
  ``vllm.LLM(model=DIR)``.
- LoRA: the adapter in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``) and the tokenizer:
  ``PeftModel.from_pretrained(base, DIR)``; ``adapter_config.json`` names the base model's directory (for the built-in
  tiny model, which has none, ``base_model_name_or_path`` is empty). ``merge_lora`` writes the merged full weights
  instead, a plain model directory like the one above; over a 4-bit base (``load_in_4bit``) they are the dequantized
  4-bit weights plus the adapters, in float32, with a warning that they are not the original weights plus the
  adapters. A checkpoint of a 4-bit run holds the adapters only (the base is rebuilt from ``--model``).
- FSDP2: the sharded parameters are gathered into a full state dict on rank 0 (``get_model_state_dict`` with
  ``full_state_dict=True, cpu_offload=True``), which rank 0 writes.

The directory is written under a temporary name and renamed when complete, so a stopped run never leaves half a
model; an earlier ``model/`` in the same place is replaced, but for the files no save writes (``grpo-fast eval``'s
``eval.json``, anything the user put there), which are kept. Files get the modes the umask gives. The tokenizer files
are the same in a run's ``model/`` and an export of its checkpoint; where ``AutoTokenizer`` would load them otherwise
than they trained (the tiny model's: transformers 5 reads any ``qwen2`` directory with ``Qwen2Tokenizer``), the log
says what loads them (``PreTrainedTokenizerFast.from_pretrained(DIR)``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.forward import unwrap
from grpo_fast.train.model import is_4bit, merge_4bit_lora

MODEL_DIR = "model"  # inside output_dir
logger = logging.getLogger("grpo_fast.train")


def is_peft(model) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def full_state_dict(model, world) -> dict[str, torch.Tensor] | None:
    """Under FSDP2, the full (unsharded) model state dict on the CPU of rank 0 (None on the other ranks);
    collective: every rank calls it. None for a model that is not sharded (its own parameters are whole).

    A tied parameter (the lm_head sharing the embedding) appears once, under its first name, as ``save_pretrained``
    writes it from an unsharded model: the gathered copies no longer share storage, which is how
    ``save_pretrained`` would recognise them."""
    if world.strategy != "fsdp2" or not world.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            state.pop(name, None)
    return state if world.is_main else None


def save_model(model, tokenizer, directory: str | Path, *, merge_lora: bool = False,
               state_dict: dict[str, torch.Tensor] | None = None, base_model: str | None = None,
               max_new_tokens: int | None = None) -> Path:
    """Writes ``model`` (a transformers causal LM or a PEFT model around one) and ``tokenizer`` to ``directory`` with
    ``save_pretrained``; returns the directory.

    ``state_dict``: the weights to write instead of the model's own (FSDP2's gathered full state dict).
    ``merge_lora``: a PEFT model is merged into its base (in place: the model then has no adapters) and written as
    full weights; otherwise a PEFT model writes its adapter only, and ``base_model`` (a directory) is recorded as its
    ``base_model_name_or_path``. ``max_new_tokens``: the completion length the model was trained with, written to
    its generation config (the default length of ``generate``, vLLM and ``grpo-fast eval``). A full disk raises
    ``checkpoint.DiskFull`` (one line: the directory, the space left) once the partial directory is removed.
    """
    directory = Path(directory)
    try:
        _save_model(model, tokenizer, directory, merge_lora, state_dict, base_model, max_new_tokens)
    except Exception as e:  # the temporary directory is gone: the message can say so, with the space it freed
        if not ckpt.is_disk_full(e):
            raise
        earlier = f"; the earlier {directory} is intact" if directory.exists() else ""
        raise ckpt.disk_full(directory, f"the partial export was removed{earlier}") from None
    return directory


def _save_model(model, tokenizer, directory: Path, merge_lora: bool, state_dict, base_model, max_new_tokens) -> None:
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if is_peft(model) and merge_lora:
            if state_dict is not None:
                raise ValueError("save_model: merge_lora with a gathered state_dict is not supported")
            if is_4bit(model):
                logger.warning("--merge-lora with a 4-bit base: the merged float32 weights are the base's 4-bit "
                               "values, dequantized, plus the adapters (the model that was trained); they differ from "
                               "the original full-precision weights by the 4-bit rounding. To apply the adapters to the "
                               "original weights instead, keep the adapter (no --merge-lora) and load it with "
                               "PeftModel.from_pretrained on the full-precision base")
                model = merge_4bit_lora(model)
            else:
                model = model.merge_and_unload()
        if is_peft(model):
            for config in model.peft_config.values():
                config.base_model_name_or_path = base_model or ""
            model.save_pretrained(tmp)
            _set_generation_config(model, tokenizer, max_new_tokens)
            unwrap(model).generation_config.save_pretrained(tmp)  # PEFT ignores it; grpo-fast eval reads it
        else:
            _set_generation_config(model, tokenizer, max_new_tokens)
            model.save_pretrained(tmp, state_dict=state_dict)
        _save_tokenizer(tokenizer, tmp)
        _umask_modes(tmp)
        _check_auto_tokenizer(tmp, tokenizer, directory)
        if directory.exists():
            kept = _carry_over(directory, tmp)
            if kept:
                logger.info("kept in %s what no save writes there: %s", directory, ", ".join(kept))
            old = directory.with_name(f".{directory.name}.{os.getpid()}.old")  # never a *.tmp: a resume removes those
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old)  # what it held that was not a save's is in directory now
        else:
            os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# the files a save_pretrained of a model, an adapter or a tokenizer writes: an earlier save's are replaced whole;
# anything else in the directory (grpo-fast eval's eval.json, the user's notes) is kept
_SAVED_FILE = re.compile(r"(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
                         r"|(adapter_|generation_)?config\.json|(tokenizer|special_tokens_map|added_tokens|vocab|merges"
                         r"|spiece|chat_template).*|.*\.tiktoken")


def _carry_over(old: Path, new: Path) -> list[str]:
    """Links (else copies) into ``new`` every entry of ``old`` that is not a saved model's file
    (:data:`_SAVED_FILE`) and that ``new`` does not hold: a save never deletes what it did not write. Returns their
    names."""
    kept = []
    for entry in sorted(old.iterdir()):
        target = new / entry.name
        if _SAVED_FILE.fullmatch(entry.name) or target.exists() or target.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)
        kept.append(entry.name)
    return kept


def _link_or_copy(source, target) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def _umask_modes(directory: Path) -> None:
    """Every file in ``directory`` gets the mode a plain ``open`` gives under this process's umask (safetensors
    writes its file through a private temporary, mode 600, that it renames into place)."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _save_tokenizer(tokenizer, directory: Path) -> None:
    """``tokenizer.save_pretrained``, its ``tokenizer.json`` without the padding and truncation the run's batches left
    set on the fast tokenizer (transformers sets them again on each call, from ``tokenizer_config.json``'s
    ``padding_side``): a run's ``model/`` and an export of its checkpoint hold the same tokenizer files."""
    backend = getattr(tokenizer, "_tokenizer", None)
    padding, truncation = getattr(backend, "padding", None), getattr(backend, "truncation", None)
    if padding is None and truncation is None:
        tokenizer.save_pretrained(directory)
        return
    backend.no_padding()
    backend.no_truncation()
    try:
        tokenizer.save_pretrained(directory)
    finally:
        if padding is not None:  # (both are enable_*'s keyword arguments)
            backend.enable_padding(**padding)
        if truncation is not None:
            backend.enable_truncation(**truncation)


# characters a model's prompts and answers hold (the tiny model's vocabulary among them, and some it lacks)
_TOKENIZER_PROBE = "max 3 8 1 6= min 4 0 7= 37*408+1-2 Hello, world!"


def _check_auto_tokenizer(saved: Path, tokenizer, directory: Path) -> None:
    """Says in the log when ``AutoTokenizer.from_pretrained`` on the saved directory gives a tokenizer that encodes
    otherwise than the one trained with, naming what loads it as trained: transformers 5 maps every ``qwen2`` directory
    (the tiny model's among them) to ``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` names, and that one
    rebuilds a byte-level BPE that drops the tiny vocabulary's spaces and ``+``."""
    from transformers import AutoTokenizer

    want = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    try:
        auto = AutoTokenizer.from_pretrained(saved)
        got = auto(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - whatever stops AutoTokenizer is what the user would meet
        what = f"AutoTokenizer.from_pretrained({str(directory)!r}) fails ({type(e).__name__}: {e})"
    else:
        if got == want:
            return
        what = (f"AutoTokenizer.from_pretrained({str(directory)!r}) gives a {type(auto).__name__} that encodes "
                f"otherwise than the tokenizer trained with ({_TOKENIZER_PROBE!r} reads back as "
                f"{auto.decode(got)!r})")
    generic = type(tokenizer).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    # the generic fast tokenizer read as a model's own class is transformers' known remapping (an info, said on every
    # save of the tiny model); any other difference is a surprise (a warning)
    logger.log(logging.INFO if generic else logging.WARNING, "%s: load the tokenizer with %s.from_pretrained(%r, "
               "padding_side='left') (grpo-fast eval does)", what,
               "PreTrainedTokenizerFast" if generic else type(tokenizer).__name__, str(directory))


def _set_generation_config(model, tokenizer, max_new_tokens: int | None) -> None:
    """A generation config that stops where the trainer stopped: at the tokenizer's EOS (a model built from a
    config alone may have none) and, when given, after ``max_new_tokens``."""
    generation = getattr(unwrap(model), "generation_config", None)
    if generation is None:
        return
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    if max_new_tokens is not None:
        generation.max_new_tokens = max_new_tokens


def base_model_path(config: TrainConfig) -> str | None:
    """The base model's directory as an absolute path (what a LoRA adapter records); None for the tiny model."""
    return None if config.model == "tiny" else str(Path(config.model).resolve())


# ------------------------------------------------------------------------------------------------ export


def _trainer_state(path: Path) -> tuple[dict, bool]:
    """(the checkpoint's saved state, whether it is an FSDP2 directory), read by ``checkpoint.read_state``: a file
    that needs more than a checkpoint holds is refused unread."""
    sharded = path.is_dir()
    if not (path.is_file() or (sharded and (path / ckpt.TRAINER_STATE).is_file())):
        raise FileNotFoundError(f"CHECKPOINT: expected a checkpoint-*.pt file or a checkpoint-*.dcp directory "
                                f"(holding {ckpt.TRAINER_STATE}), got {str(path)!r}")
    try:
        return ckpt.read_state(path), sharded
    except (ckpt.DamagedCheckpoint, ckpt.UnsafeCheckpoint) as e:
        raise ValueError(f"CHECKPOINT: {e}") from None


def checkpoint_config(saved: dict) -> TrainConfig:
    """The run's ``TrainConfig`` from a checkpoint's saved dict, on the CPU (fields this version lacks are dropped;
    the thread count is this machine's, not the one the run had)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in saved.items() if k in known}
    try:
        return TrainConfig(**{**values, "device": "cpu", "dtype": "float32", "resume": False, "threads": None})
    except (TypeError, ValueError) as e:  # options this version refuses (a temperature below its bound, say)
        raise ValueError(f"CHECKPOINT: its run's options do not make a run of this version: {e}") from None


def load_checkpoint_model(checkpoint: str | Path):
    """(model, tokenizer, config) of a checkpoint, on the CPU in float32: the run's model rebuilt from its config
    (the tiny model from its seed, or the ``--model`` directory, which must still exist) with the checkpoint's
    weights, LoRA adapters included."""
    from grpo_fast.train.model import attach_lora, load_model_and_tokenizer, load_trained_state

    path = Path(checkpoint)
    state, sharded = _trainer_state(path)
    config = checkpoint_config(state["config"])
    model, tokenizer = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    if config.lora_r > 0:
        model = attach_lora(model, config)
    if sharded:
        weights = {"model": model.state_dict()}
        try:
            ckpt.read_sharded(weights, path, no_dist=True)  # only the model's entries are read
        except (ckpt.DamagedCheckpoint, ckpt.UnsafeCheckpoint) as e:
            raise ValueError(f"CHECKPOINT: {e}") from None
        model.load_state_dict(weights["model"])
    else:
        load_trained_state(model, state["model"], config)
    model.eval()
    return model, tokenizer, config


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merge_lora: bool = False) -> Path:
    """``grpo-fast export``: the ``save_pretrained`` directory (what ``output_dir/model/`` holds at the end of a run)
    of a single-file or FSDP2 checkpoint. ``out_dir`` is checked (new or empty, creatable, writable) before the
    model is loaded; errors name it as given."""
    if not str(out_dir).strip():
        raise ValueError(f"OUT_DIR: expected the directory to write, got {str(out_dir)!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"OUT_DIR: {out_dir} exists and is not an empty directory; choose a new one")
    ckpt.check_writable(out_dir, "OUT_DIR")
    model, tokenizer, config = load_checkpoint_model(checkpoint)
    if merge_lora and not is_peft(model):
        raise ValueError(f"--merge-lora: {checkpoint} is not a LoRA run (lora_r=0): there is nothing to merge")
    try:
        return save_model(model, tokenizer, out, merge_lora=merge_lora, base_model=base_model_path(config),
                          max_new_tokens=config.max_new_tokens)
    except ckpt.DiskFull as e:
        raise ckpt.DiskFull(f"OUT_DIR: {e}") from None
    except OSError as e:  # what the check cannot foresee: about OUT_DIR, not its temporary name
        raise OSError(f"OUT_DIR: writing {out_dir} failed ({e.strerror or e})") from None
