"""Atomic checkpoints that cannot run code: ``checkpoint-000050.pt`` (or ``checkpoint-000050.dcp/``) appears whole
or not at all, and reading one never unpickles anything but tensors and plain values.

A checkpoint is one file written to a temporary name in the same directory, flushed to disk, then renamed over
(``os.replace`` is atomic on POSIX). Under FSDP2 it is a directory in torch.distributed.checkpoint's format (every
rank writes its shards; ``trainer_state.pt`` beside them), written under a temporary name and renamed once every
rank has finished. A run killed in the middle of a save leaves a ``.checkpoint-*.tmp`` file or directory that the
next resume ignores and removes; the previous checkpoint is untouched. A save that fills the disk removes its
temporary file and raises :class:`DiskFull`, one line naming the file and the space left. A checkpoint damaged in
another way (a truncated copy, flipped or overwritten bytes, a file overwritten by something else) is found when it
is read: every record of the archive (the pickle, each tensor's storage) must match the CRC-32 ``torch.save``
stored for it (torch's own reader does not check them), and :func:`read_state` raises :class:`DamagedCheckpoint`
naming the file and the record; resume falls back to the newest intact one. The checksums are part of the file, so
a checkpoint is verified wherever it is copied, and one written by an earlier grpo-fast is verified the same way.

Checkpoints are files people download and share, and a pickle can call any function while it is read. So a
checkpoint holds only tensors, numbers, strings, None and lists, tuples and dicts of them (the RNG states as
tensors and numbers, see :func:`rng_state`), and every file is read by :func:`load`: its checksums verified, then
its pickle walked opcode by opcode (:func:`~grpo_fast.train.pickle_walk.walk_pickle`, every way a pickle names a global: ``GLOBAL``, ``INST``,
``STACK_GLOBAL`` of strings pushed or fetched from the memo, the ``EXT`` codes of copyreg's registry) for globals
outside torch's ``weights_only`` set, then ``torch.load(weights_only=True)``; a pickle of protocol 3 to 5 is first
rewritten into the protocol-2 opcodes torch's weights-only unpickler takes. A file that needs anything more is
refused before it is unpickled (:class:`UnsafeCheckpoint`, naming the file and the global): resume stops there
rather than skip it as damaged, and ``grpo-fast export`` stops too. The ``.metadata`` of a ``.dcp`` directory is
unpickled with an allow-list of torch.distributed.checkpoint's metadata classes, its non-tensor entries by
:func:`load`. A save_pretrained directory (``--model``) is checked by :func:`check_weights` before transformers reads
it: safetensors headers that cover their files, ``.bin`` weights that pass the same checks.

Checkpoints of grpo-fast before this format pickled numpy's RNG state as a numpy array; :func:`convert`
(``grpo-fast convert-checkpoint OLD NEW --trust``) re-saves one you trust, and is the one place a checkpoint is
unpickled without the allow-list.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import random
import re
import shlex
import shutil
import stat
import tempfile
import zipfile
from contextlib import nullcontext
from pathlib import Path
from typing import IO, Any

import torch
from torch import _weights_only_unpickler  # torch's own allow-list of globals, and its unpickler

from grpo_fast.train.pickle_walk import walk_pickle

_NAME = re.compile(r"^checkpoint-(\d{6,})\.(pt|dcp)$")
TRAINER_STATE = "trainer_state.pt"  # inside a sharded checkpoint: step, scheduler, sampler, RNG, config
TRAINER_KEYS = ("step", "skipped_updates", "scheduler", "sampler", "rng", "config")
DAMAGED_SUFFIX = ".damaged"
CONVERT_COMMAND = "grpo-fast convert-checkpoint"

# what a loaded checkpoint may hold (dict covers OrderedDict, Tensor covers Parameter); anything else is refused
PLAIN_TYPES = (torch.Tensor, dict, list, tuple, str, int, float, bool, type(None))
# the globals a checkpoint of the format before this one needs: numpy's RNG state as an array (numpy 1 and 2 names)
_OLD_FORMAT_GLOBALS = frozenset({"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
                                 "numpy.ndarray", "numpy.dtype"})
# what torch.distributed.checkpoint pickles into a .dcp's .metadata (torch dtypes are allowed besides)
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),  # StorageMeta's path
})
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
# torch.save's format before torch 1.6 (_use_new_zipfile_serialization=False) starts with a pickled magic number,
# a 10-byte long after the pickle's protocol (and frame) opcodes
_LEGACY_MAGIC = torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")
_HEAD_BYTES = 32
_CHUNK = 1 << 20  # the checksums are computed over reads of this size: memory stays flat whatever the file
logger = logging.getLogger("grpo_fast.train")


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be read back; the message names the file and what went wrong."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint refused before it was unpickled: reading it would take a pickle global (a class or a function)
    beyond what a checkpoint holds, which is how a pickle runs code. The message names the file and the global."""


class DiskFull(OSError):
    """A write that ran out of disk space (``ENOSPC`` or ``EDQUOT``, or what torch's zip writer and safetensors make
    of them): the message names what was being written, the space left and what was kept. An OSError (errno
    ENOSPC), so the CLI reports it in one line."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # one argument, not OSError's two (an error crosses processes pickled)
        return DiskFull, (self.strerror,)


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
    """Writes ``state`` to ``path`` with ``torch.save`` (the CRC-32 of every record included, which :func:`load`
    verifies), all or nothing. ``state`` must hold only what :func:`load` reads back (:data:`PLAIN_TYPES`): anything
    else is refused here rather than at the resume. A full disk raises :class:`DiskFull` once the temporary file is
    removed; ``path``, if it existed, is as it was."""
    where = _not_plain(state)
    if where is not None:
        raise ValueError(f"save_atomic: the state holds {where}, which a checkpoint cannot hold (only "
                         f"{_PLAIN_NAMES}); nothing was written")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                _torch_save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise disk_full(path, "its partial file was removed and nothing else was changed") from None


def _torch_save(state: Any, f: IO[bytes]) -> None:
    """``torch.save(state, f)`` with the CRC-32 of every record written, whatever
    ``torch.serialization.set_crc32_options`` says elsewhere in the process (:func:`load` verifies them)."""
    computed = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        torch.save(state, f)
    finally:
        torch.serialization.set_crc32_options(computed)


_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# a full disk once it is wrapped: torch's zip writer swallows the OSError of a short write and raises "unexpected
# pos" (the OSError stays in __context__ when the writer was a Python file); safetensors formats Rust's io::Error
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded",
                    "unexpected pos")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (an OSError, torch.save's RuntimeError, a SafetensorError, a torch.distributed.checkpoint
    CheckpointException) is a write that ran out of disk space. An errno anywhere in its chain of causes decides;
    without one, the message does."""
    queue, seen, texts = [error], set(), []
    while queue and len(seen) < 64:  # a chain, or DCP's failures of every rank: a few links
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno in _DISK_FULL_ERRNOS
        texts.append(str(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            queue.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        queue.extend((e.__cause__, e.__context__))
    return any(text in t for t in texts for text in _DISK_FULL_TEXTS)


def _space_left(directory: Path) -> str:
    """``the disk is full (12.0 KiB free in DIR)``; the free space left out where it cannot be read."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "the disk is full"
    size = next((f"{free / 2**k:.1f} {unit}" for k, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"))
                 if free >= 2**k), f"{free} B")
    return f"the disk is full ({size} free in {directory})"


def disk_full(path: str | Path, kept: str) -> DiskFull:
    """The :class:`DiskFull` of a write of ``path`` (a file or directory) that ran out of space; ``kept``: what the
    user keeps (what is left of the write was removed)."""
    path = Path(path)
    return DiskFull(f"cannot write {path}: {_space_left(path.parent)}; {kept}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ reading


_PLAIN_NAMES = "tensors, numbers, strings, None, and lists, tuples and dicts of them"


def _reason(e: BaseException) -> str:
    """``Type: first line of the message``, at most 160 characters."""
    reason = (str(e).strip().splitlines() or [""])[0]
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    return f"{type(e).__name__}: {reason}"


def _not_plain(obj: Any) -> str | None:
    """Where ``obj`` holds something outside :data:`PLAIN_TYPES` (``"a torch.device at ['rng']['cuda']"``); None
    when nowhere."""
    stack, seen = [(obj, "")], set()  # each container once: shared references would double the walk per level
    while stack:
        value, where = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if id(value) in seen:  # (ids stay unique: obj keeps every container alive during the walk)
                continue
            seen.add(id(value))
        if isinstance(value, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif not isinstance(value, PLAIN_TYPES):
            kind = type(value)
            return f"a {kind.__module__}.{kind.__qualname__} at {where or 'the top level'}"
    return None


def _refusal(name: str, unsafe: list[str]) -> str:
    if set(unsafe) <= _OLD_FORMAT_GLOBALS:
        quoted = shlex.quote(name)
        return (f"{name} is refused unread: it is in the format of an older grpo-fast, whose numpy RNG state needs "
                f"the pickle global {unsafe[0]}; if you trust the file, convert it (in place) with: "
                f"{CONVERT_COMMAND} {quoted} {quoted} --trust")
    more = f" (and {len(unsafe) - 1} more: {', '.join(unsafe[1:])})" if len(unsafe) > 1 else ""
    return (f"{name} is refused unread: its pickle needs the global {unsafe[0]}{more}, which no checkpoint holds "
            f"(only {_PLAIN_NAMES}); unpickling it could run code, so it was not loaded")


def check_safe(file: str | os.PathLike | IO[bytes], name: str | None = None) -> None:
    """Raises :class:`UnsafeCheckpoint` when the pickle inside ``file`` (a ``torch.save`` archive: a path or a
    seekable binary file) names a global outside torch's ``weights_only`` set (tensors, storages, dtypes,
    OrderedDict), :class:`DamagedCheckpoint` when ``file`` is no readable archive or a record of it fails its CRC-32
    check. Unpickles nothing: it reads the pickle's opcodes (:func:`~grpo_fast.train.pickle_walk.walk_pickle`). ``name``: the file in messages."""
    _inspect(file, str(file) if name is None else name)


def _inspect(file: str | os.PathLike | IO[bytes], name: str) -> bytes | None:
    """:func:`check_safe`; returns the pickle rewritten in the opcodes torch's weights-only unpickler takes when the
    file's own needs rewriting (protocol 3 to 5), None when ``torch.load`` reads it as it is."""
    buffer = not isinstance(file, (str, os.PathLike))
    if not buffer:  # a dangling link, a directory or a FIFO of a checkpoint's name: named, never opened
        try:
            mode = os.stat(file).st_mode
        except OSError as e:
            raise DamagedCheckpoint(f"{name} cannot be read ({_reason(e)})") from None
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise DamagedCheckpoint(f"{name} cannot be read (it is {kind}, not a file)")
    start = file.tell() if buffer else 0
    magic = b""
    try:
        with nullcontext(file) if buffer else open(file, "rb") as f:
            head = f.read(_HEAD_BYTES)
            f.seek(start)
            magic = head[:len(_ZIP_MAGIC)]
            if magic != _ZIP_MAGIC:
                what = ("the file is empty" if not head else
                        "an old (non-zip) torch.save format; re-save it with a current torch" if _LEGACY_MAGIC in head
                        else "not a torch.save archive")
                raise DamagedCheckpoint(f"{name} cannot be read ({what})")
            _verify_checksums(f, name)
            f.seek(start)
            records = torch._C.PyTorchFileReader(f)  # torch.load's reader: the pickle walked is the one it unpickles
            if records.has_record("constants.pkl"):
                raise DamagedCheckpoint(f"{name} cannot be read (a TorchScript archive, not a torch.save checkpoint)")
            data = records.get_record("data.pkl")
    except DamagedCheckpoint:
        raise
    except Exception as e:  # a missing file, a truncated archive: anything from OSError on
        what = "a truncated or damaged archive: " if magic else ""
        raise DamagedCheckpoint(f"{name} cannot be read ({what}{_reason(e)})") from None
    finally:
        if buffer:
            file.seek(start)
    walk = walk_pickle(data)
    allowed = {*_weights_only_unpickler._get_allowed_globals(), *_weights_only_unpickler._get_user_allowed_globals()}
    unsafe = sorted(g for g in walk.globals if g not in allowed)
    if unsafe:  # before a malformed or unsupported pickle: a payload followed by garbage is still a payload
        raise UnsafeCheckpoint(_refusal(name, unsafe))
    if walk.error is not None:
        raise DamagedCheckpoint(f"{name} cannot be read (its pickle is malformed: {walk.error})")
    if walk.unsupported:
        ops = sorted(walk.unsupported)
        raise DamagedCheckpoint(f"{name} cannot be read (its pickle uses the opcode {ops[0]}"
                                + (f" (and {', '.join(ops[1:])})" if len(ops) > 1 else "")
                                + ", which torch's weights-only unpickler does not take; re-save it with torch.save)")
    return walk_pickle(data, walk.elided).rewritten if walk.rewrite else None


def _verify_checksums(f: IO[bytes], name: str) -> None:
    """Raises :class:`DamagedCheckpoint` naming the record of the zip archive ``f`` whose bytes do not match the
    CRC-32 its writer stored for it: flipped or overwritten bytes, which torch's reader would load as they are (it
    does not check them). Reads each record once, in chunks. An archive written without checksums
    (``torch.serialization.set_crc32_options(False)``: every stored CRC is 0) is read with a warning."""
    with zipfile.ZipFile(f) as archive:
        records = archive.infolist()
        names = set()
        for record in records:  # two records of one name: which one a reader takes is its own choice
            if record.compress_type != zipfile.ZIP_STORED:  # a small file could inflate to any size when read
                raise DamagedCheckpoint(f"{name} cannot be read (its record {record.filename[:80]} is compressed, "
                                        "which torch.save never writes)")
            if record.filename in names:
                raise DamagedCheckpoint(f"{name} cannot be read (a damaged archive: two records named "
                                        f"{record.filename})")
            names.add(record.filename)
        if not any(record.CRC for record in records if record.file_size):
            logger.warning("%s carries no checksums (it was written with torch.serialization.set_crc32_options("
                           "False)): read without an integrity check", name)
            return
        for record in records:
            try:
                with archive.open(record) as data:
                    while data.read(_CHUNK):
                        pass
            except zipfile.BadZipFile as e:
                if "CRC" not in str(e):
                    raise
                raise DamagedCheckpoint(f"{name} cannot be read (its record {record.filename} fails its CRC-32 "
                                        "check: its bytes changed after it was written)") from None


def load(file: str | os.PathLike | IO[bytes], name: str | None = None) -> Any:
    """The one reader of checkpoint files (a ``.pt`` checkpoint, a ``.dcp``'s ``trainer_state.pt`` and its
    non-tensor entries): ``torch.load(file, map_location="cpu", weights_only=True)`` of a file :func:`check_safe`
    passed (its checksums verified, its globals torch's), whose content must be plain (:data:`PLAIN_TYPES`).
    ``name``: the file in messages (default: its path). Raises :class:`UnsafeCheckpoint` or
    :class:`DamagedCheckpoint`; never runs code from the file."""
    name = str(file) if name is None else name
    rewritten = _inspect(file, name)
    try:
        # on the CPU: RNG states must stay CPU byte tensors; load_state_dict moves the rest where it belongs
        if rewritten is None:
            state = torch.load(file, map_location="cpu", weights_only=True)
        else:
            state = _load_rewritten(file, rewritten)
    except pickle.UnpicklingError as e:  # the scan passed, torch's unpickler did not: a global pushed at load time
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), _reason(e))
        raise UnsafeCheckpoint(f"{name} is refused: torch's weights-only unpickler stopped it ({why[:200]}); it "
                               "was not loaded") from None
    except Exception as e:
        raise DamagedCheckpoint(f"{name} cannot be read ({_reason(e)})") from None
    where = _not_plain(state)
    if where is not None:
        raise DamagedCheckpoint(f"{name} holds {where}, which no checkpoint holds (only {_PLAIN_NAMES})")
    return state


class _RewrittenArchive:
    """torch's reader of a ``torch.save`` archive, whose ``data.pkl`` reads as the rewritten pickle."""

    def __init__(self, records, pickled: bytes):
        self._records, self._pickled = records, pickled

    def get_record(self, name: str):
        return self._pickled if name == "data.pkl" else self._records.get_record(name)

    def __getattr__(self, attr: str):
        return getattr(self._records, attr)


def _load_rewritten(file: str | os.PathLike | IO[bytes], pickled: bytes) -> Any:
    """What ``torch.load(file, map_location="cpu", weights_only=True)`` returns for the archive ``file`` with
    ``pickled`` as its pickle: torch.load's own steps (``torch.serialization._load`` with torch's weights-only
    unpickler, which checks every global again), on the archive whose pickle :func:`_inspect` rewrote."""
    buffer = not isinstance(file, (str, os.PathLike))
    start = file.tell() if buffer else 0
    try:  # (a path is read by torch itself, as torch.load reads it: the storages do not pass through Python)
        records = _RewrittenArchive(torch._C.PyTorchFileReader(file if buffer else os.fspath(file)), pickled)
        return torch.serialization._load(records, "cpu", _weights_only_unpickler, encoding="utf-8")
    finally:
        if buffer:
            file.seek(start)


def check_weights(directory: str | Path, flag: str, stem: str = "model") -> None:
    """Refuses, in one line naming ``flag`` and the file, a model directory whose weights would not load whole
    (``stem``: ``model`` or ``adapter_model``): none at all (the trainer's loader would build random weights from
    config.json), a missing shard of ``STEM.safetensors.index.json``, a ``.safetensors`` file that is empty or
    truncated (its header is read, and must cover the file), or a ``.bin`` whose pickle needs more than tensors
    (:func:`check_safe`; transformers would refuse it too, with a traceback). ``grpo-fast train --model`` and
    ``grpo-fast eval --model`` / ``--base-model`` read their weights after this check."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / f"{stem}.safetensors.index.json"
    files = [directory / f"{stem}.safetensors"]
    if index.is_file():
        try:
            files = [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{flag}: {index} cannot be read ({type(e).__name__}: {e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{flag}: {directory} lacks {missing[0]}, a shard its {index.name} names"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    files = [f for f in files if f.is_file()]
    bins = sorted(directory.glob(f"{'pytorch_model' if stem == 'model' else stem}*.bin"))
    if not files and not bins:
        raise FileNotFoundError(f"{flag}: {directory} holds no weights (no {stem}.safetensors); a saved model is "
                                "output_dir/model of a run, or grpo-fast export's OUT_DIR")
    for file in files:
        try:
            with safe_open(str(file), "pt"):  # the header, checked against the file's length
                pass
        except Exception as e:  # safetensors' SafetensorError (a Rust exception), OSError
            reason = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"{flag}: {file} cannot be read ({type(e).__name__}: {reason}); an empty or truncated "
                             "copy? Export or copy the model again") from None
    for file in bins:
        try:
            check_safe(file)
        except (DamagedCheckpoint, UnsafeCheckpoint) as e:
            raise ValueError(f"{flag}: {e}") from None



def read_state(path: Path) -> dict:
    """A checkpoint's state on the CPU, read by :func:`load`: the whole of a ``.pt`` file (model and optimizer
    included), the ``trainer_state.pt`` of a ``.dcp`` directory (whose shards :func:`read_sharded` reads). Raises
    :class:`UnsafeCheckpoint` for a file that needs more than a checkpoint holds, and :class:`DamagedCheckpoint`
    when the file is missing, truncated, empty, not a checkpoint or lacks a part."""
    path = Path(path)
    sharded = path.suffix == ".dcp" or path.is_dir()
    file = path / TRAINER_STATE if sharded else path
    state = load(file)
    needed = TRAINER_KEYS if sharded else (*TRAINER_KEYS, "model", "optimizer")
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"{file} holds a {type(state).__name__}, not a checkpoint")
    missing = [k for k in needed if k not in state]
    if missing:
        raise DamagedCheckpoint(f"{file} lacks {', '.join(missing)}")
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.dcp``'s ``.metadata`` with :data:`_METADATA_GLOBALS` and torch's dtypes, nothing else."""

    def __init__(self, file: IO[bytes], name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.name} is refused unread: its pickle needs the global {module}.{name}, which "
                               "no torch.distributed.checkpoint metadata holds; unpickling it could run code, so it "
                               "was not loaded")


def _read_metadata(file: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, str(file)).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        raise DamagedCheckpoint(f"{file} cannot be read ({_reason(e)})") from None
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(f"{file} holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                                "metadata")
    return metadata


def read_sharded(state: dict, path: Path, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path)`` (in place; collective unless ``no_dist``)
    through safe readers: the ``.metadata`` is unpickled with an allow-list of DCP's metadata classes, non-tensor
    entries by :func:`load` (tensors torch reads itself with ``weights_only=True``). An unsafe or damaged part
    raises :class:`UnsafeCheckpoint` or :class:`DamagedCheckpoint` on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = Path(path)
    _read_metadata(path / ".metadata")  # every rank, before the collective: a refusal is one error, not a wrapped one

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = _read_metadata(path / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DefaultLoadPlanner's, with load() for torch.load(weights_only=False)
            fqn = read_item.dest_index.fqn
            obj = load(value, f"{path} (entry {fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:  # a rank's failure, wrapped with its traceback: ours are one line
        for failure in e.failures.values():
            error = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(error, (UnsafeCheckpoint, DamagedCheckpoint)):
                raise error from None
        raise


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


def remove_stale_temporaries(directory: Path, pattern: str = ".checkpoint-*.tmp") -> list[Path]:
    """Deletes the files and directories matching ``pattern`` (the temporaries of :func:`save_atomic` and
    :func:`save_sharded` by default) an interrupted save left behind in ``directory``; returns them."""
    directory = Path(directory)
    stale = sorted(directory.glob(pattern)) if directory.is_dir() else []
    for p in stale:
        remove(p)
    return stale


def prune(directory: Path, keep: int) -> None:
    """Keeps the newest ``keep`` checkpoints (all of them when ``keep`` is 0)."""
    if keep > 0:
        for _, p in list_checkpoints(directory)[:-keep]:
            remove(p)


def check_writable(directory: str | Path, name: str, file: str | Path | None = None) -> None:
    """Raises ValueError naming ``name`` (the flag or argument) and ``directory`` as given, unless ``directory``
    takes files or can be created; with ``file`` (what will be written in ``directory``, as the user typed it) the
    message names it first. Creates nothing: the probe is a temporary file in ``directory``, or a temporary
    directory in its nearest existing ancestor, removed at once."""
    path = Path(directory)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    prefix = f"{name}: " + (f"cannot write {file}: " if file is not None else "")
    try:
        if not existing.is_dir():
            raise ValueError(f"{prefix}cannot create or write in {directory} ({existing} is a file, not a directory)")
        if existing == path:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        raise ValueError(f"{prefix}cannot create or write in {directory} ({e.strerror or e})") from None


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
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp))
        barrier()
        if is_main:
            save_atomic(trainer_state, tmp / TRAINER_STATE)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    except BaseException as e:  # DCP raises a failed write on every rank as a CheckpointException (a BaseException)
        if not is_disk_full(e):
            raise
        if is_main:
            remove(tmp)
        raise disk_full(path, "its partial directory was removed and nothing else was changed") from None
    barrier()


def load_sharded(model, optimizer, path: Path) -> None:
    """Loads :func:`save_sharded`'s model and optimizer state into the (sharded) ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read_sharded(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ------------------------------------------------------------------------------------------------ RNG states


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


def _portable_rng(state: dict) -> dict:
    """``state`` with Python's and numpy's generator states as tensors and numbers: ``random.getstate()``'s
    ``(version, 625 ints, gauss_next)`` and numpy's ``(name, uint32 array, pos, has_gauss, cached_gaussian)``
    become dicts; entries already portable stay as they are."""
    out = dict(state)
    if isinstance(out.get("python"), tuple):
        version, internal, gauss_next = out["python"]
        out["python"] = {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                         "gauss_next": gauss_next}
    if isinstance(out.get("numpy"), tuple):
        name, key, pos, has_gauss, cached_gaussian = out["numpy"]
        out["numpy"] = {"bit_generator": str(name), "key": torch.tensor(key.tolist(), dtype=torch.int64),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return out


def rng_state() -> dict:
    """The global generators a step may draw from (a reward function, say), as tensors and numbers: Python's
    ``random``, numpy's global one (when numpy is installed), torch's CPU generator and every CUDA device's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return _portable_rng(state)


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state` (sampling has no RNG state to restore: its seeds follow the step)."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss_next"]))
    torch.set_rng_state(state["torch"])
    np = _numpy()
    if "numpy" in state and np is not None:
        saved = state["numpy"]
        np.random.set_state((saved["bit_generator"], np.asarray(saved["key"].tolist(), dtype=np.uint32),
                             saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ old checkpoints


def convert(old: str | Path, new: str | Path) -> Path:
    """Re-saves ``old``, a checkpoint of an older grpo-fast (its RNG state pickled with numpy arrays), in the format
    :func:`load` reads; returns ``new``. ``new`` may be ``old``: converted in place, atomically. Of a ``.dcp``
    directory the ``trainer_state.pt`` is converted and the shards are copied as they are; a ``trainer_state.pt``
    can be converted alone.

    This unpickles ``old`` with full pickle (``weights_only=False``), which runs any code the file holds: the one
    place grpo-fast does so, for a file its user trusts (``grpo-fast convert-checkpoint OLD NEW --trust``)."""
    typed = str(new)  # NEW in messages, as the user typed it
    if not typed.strip():
        raise ValueError(f"NEW: expected the path of the converted checkpoint, got {typed!r}")
    old, new = Path(old), Path(new)
    sharded = old.is_dir()
    source = old / TRAINER_STATE if sharded else old
    if not source.is_file():
        raise FileNotFoundError(f"OLD: expected a checkpoint-*.pt file or a checkpoint-*.dcp directory (holding "
                                f"{TRAINER_STATE}), got {str(old)!r}")
    in_place = new.exists() and new.resolve() == old.resolve()
    if new.exists() and not in_place:
        raise FileExistsError(f"NEW: {typed} exists; choose a new path, or pass OLD again to convert it in place")
    check_writable(new.parent, "NEW", typed)  # before anything is read: the temporary files go next to NEW
    try:
        with open(source, "rb") as f:  # trusted not to run code, not to be intact: its checksums first
            if f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
                f.seek(0)
                _verify_checksums(f, f"OLD: {source}")
        state = torch.load(source, map_location="cpu", weights_only=False)  # trusted: it may run what it holds
    except DamagedCheckpoint:
        raise
    except Exception as e:
        raise DamagedCheckpoint(f"OLD: {source} cannot be read ({_reason(e)})") from None
    if not isinstance(state, dict):
        raise DamagedCheckpoint(f"OLD: {source} holds a {type(state).__name__}, not a checkpoint")
    if isinstance(state.get("rng"), dict):
        state["rng"] = _portable_rng(state["rng"])
    buffer = io.BytesIO()
    _torch_save(state, buffer)
    buffer.seek(0)
    try:  # what resume and export will read: refused here, before anything is written
        load(buffer, f"{source} (converted)")
    except (UnsafeCheckpoint, DamagedCheckpoint) as e:
        raise ValueError(f"OLD: cannot convert: {e}") from None
    try:
        if not sharded or in_place:
            save_atomic(state, new / TRAINER_STATE if sharded else new)
            return new
        tmp = new.with_name(f".{new.name}.{os.getpid()}.tmp")
        try:
            shutil.copytree(old, tmp)
            save_atomic(state, tmp / TRAINER_STATE)
            os.replace(tmp, new)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # what the check cannot foresee (a full disk): about NEW, not its temporary name
        if is_disk_full(e):
            raise DiskFull(f"NEW: {disk_full(typed, 'what was written of it was removed; OLD is as it was')}") from None
        raise OSError(f"NEW: writing {typed} failed ({e.strerror or e})") from None
    return new
