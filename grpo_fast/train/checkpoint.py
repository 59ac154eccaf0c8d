"""Atomic checkpoints: ``checkpoint-000050.pt`` appears whole or not at all.

A checkpoint is one file written to a temporary name in the same directory, flushed to disk, then renamed over
(``os.replace`` is atomic on POSIX). A run killed in the middle of a save leaves a ``*.tmp`` file that the next
resume ignores and removes; the previous checkpoint is untouched.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch

_NAME = re.compile(r"^checkpoint-(\d{6,})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint-{step:06d}.pt"


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


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Deletes the ``.checkpoint-*.tmp`` files that an interrupted save left behind; returns them."""
    directory = Path(directory)
    stale = list(directory.glob(".checkpoint-*.tmp")) if directory.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def prune(directory: Path, keep: int) -> None:
    """Keeps the newest ``keep`` checkpoints (all of them when ``keep`` is 0)."""
    if keep > 0:
        for _, p in list_checkpoints(directory)[:-keep]:
            p.unlink(missing_ok=True)


def rng_state(generator: torch.Generator) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "sampling": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generator: torch.Generator) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampling"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
