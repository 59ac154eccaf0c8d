"""Atomic checkpoints: ``checkpoint-000050.pt`` (or ``checkpoint-000050.dcp/``) appears whole or not at all.

A checkpoint is one file written to a temporary name in the same directory, flushed to disk, then renamed over
(``os.replace`` is atomic on POSIX). Under FSDP2 it is a directory in torch.distributed.checkpoint's format (every
rank writes its shards; ``trainer_state.pt`` beside them), written under a temporary name and renamed once every
rank has finished. A run killed in the middle of a save leaves a ``.checkpoint-*.tmp`` file or directory that the
next resume ignores and removes; the previous checkpoint is untouched. A checkpoint damaged in another way (a
truncated copy, a full disk, a file overwritten by something else) is found when it is read: :func:`read_state` raises
:class:`DamagedCheckpoint` naming it, and resume falls back to the newest intact one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

_NAME = re.compile(r"^checkpoint-(\d{6,})\.(pt|dcp)$")
TRAINER_STATE = "trainer_state.pt"  # inside a sharded checkpoint: step, scheduler, sampler, RNG, config
TRAINER_KEYS = ("step", "skipped_updates", "scheduler", "sampler", "rng", "config")
DAMAGED_SUFFIX = ".damaged"


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be read back; the message names the file and what went wrong."""


def checkpoint_path(directory: Path, step: int, sharded: bool = False) -> Path:
    return Path(directory) / f"checkpoint-{step:06d}.{'dcp' if sharded else 'pt'}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def save_atomic(state: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(path: Path) -> dict:
    """A checkpoint's state on the CPU: the whole of a ``.pt`` file (model and optimizer included), the
    ``trainer_state.pt`` of a ``.dcp`` directory (whose shards :func:`load_sharded` reads). Raises
    :class:`DamagedCheckpoint` when the file is missing, truncated, empty, not a checkpoint or lacks a part."""
    path = Path(path)
    file = path / TRAINER_STATE if path.suffix == ".dcp" else path
    try:
        # on the CPU: RNG states must stay CPU byte tensors; load_state_dict moves the rest where it belongs
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or garbage bytes raise anything from EOFError to UnpicklingError
        reason = (str(e).strip().splitlines() or [""])[0]
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise DamagedCheckpoint(f"{file} cannot be read ({type(e).__name__}: {reason})") from None
    needed = TRAINER_KEYS if path.suffix == ".dcp" else (*TRAINER_KEYS, "model", "optimizer")
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{file} holds a {type(state).__name__}, not a checkpoint")
    missing = [k for k in needed if k not in state]
    if missing:
        raise DamagedCheckpoint(f"{file} lacks {', '.join(missing)}")
    return state


def set_aside(path: Path) -> Path:
    """Renames a damaged checkpoint to ``<name>.damaged`` (out of :func:`list_checkpoints`' sight, kept for the
    user to inspect); returns the new path."""
    path = Path(path)
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    remove(target)
    os.replace(path, target)
    return target


def remove(path: Path) -> None:
    """Deletes a checkpoint file or directory."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Deletes the ``.checkpoint-*.tmp`` files and directories an interrupted save left behind; returns them."""
    directory = Path(directory)
    stale = list(directory.glob(".checkpoint-*.tmp")) if directory.is_dir() else []
    for p in stale:
        remove(p)
    return stale


def prune(directory: Path, keep: int) -> None:
    """Keeps the newest ``keep`` checkpoints (all of them when ``keep`` is 0)."""
    if keep > 0:
        for _, p in list_checkpoints(directory)[:-keep]:
            remove(p)


def save_sharded(model, optimizer, trainer_state: dict, path: Path, is_main: bool, barrier) -> None:
    """A torch.distributed.checkpoint directory of the (FSDP2-sharded) model and optimizer; collective: every rank
    calls it. ``barrier()`` synchronises the ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        remove(tmp)
        tmp.mkdir(parents=True)
    barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
    barrier()
    if is_main:
        save_atomic(trainer_state, tmp / TRAINER_STATE)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    barrier()


def load_sharded(model, optimizer, path: Path) -> None:
    """Loads :func:`save_sharded`'s model and optimizer state into the (sharded) ``model`` and ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional; a run without it has no numpy generator to save
        return None
    return numpy


def seed_rngs(seed: int) -> None:
    """Seeds every generator :func:`rng_state` saves (torch's seeds the CUDA devices' too)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """The global generators a step may draw from (a reward function, say): Python's ``random``, numpy's global
    one (when numpy is installed), torch's CPU generator and every CUDA device's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state` (sampling has no RNG state to restore: its seeds follow the step)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
