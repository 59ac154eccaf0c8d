"""Atomic checkpoints: ``checkpoint-000050.pt`` (or ``checkpoint-000050.dcp/``) appears whole or not at all.

A checkpoint is one file written to a temporary name in the same directory, flushed to disk, then renamed over
(``os.replace`` is atomic on POSIX). Under FSDP2 it is a directory in torch.distributed.checkpoint's format (every
rank writes its shards; ``trainer_state.pt`` beside them), written under a temporary name and renamed once every
rank has finished. A run killed in the middle of a save leaves a ``.checkpoint-*.tmp`` file or directory that the
next resume ignores and removes; the previous checkpoint is untouched.
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


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state` (sampling has no RNG state to restore: its seeds follow the step)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
