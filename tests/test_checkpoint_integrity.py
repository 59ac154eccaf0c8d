"""Hostile and damaged checkpoint files (issue 31), each class with its regression test and variants:

- damaged contents: bytes flipped or overwritten inside a checkpoint fail the CRC-32 torch.save stored for their
  record; resume names the file and the record in one line and falls back to the older checkpoint, export and every
  other reader refuse it in one line (controls show that without the check the same files load, wrong, in silence);
- pickles of every protocol 2..5: harmless ones load, a payload is refused as unsafe whichever opcode reaches its
  global (GLOBAL, STACK_GLOBAL from pushed or memoized strings, INST, OBJ, EXT codes), never skipped as damaged, and
  the walk over the opcodes stays linear;
- a full disk while saving a checkpoint or writing model/: one line naming the path and the space left, the
  temporary file removed, the earlier files intact.
"""

from __future__ import annotations

import copyreg
import errno
import io
import logging
import os
import pickle
import random
import shutil
import time
import warnings
import zipfile
from collections import OrderedDict, namedtuple

import pytest
import torch
from train_helpers import small_config

from grpo_fast.cli import main
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train.pickle_walk import walk_pickle
from grpo_fast.train import train

STEPS = 3
REFUSED = ("{file} is refused unread: its pickle needs the global {glob}, which no checkpoint holds (only tensors, "
           "numbers, strings, None, and lists, tuples and dicts of them); unpickling it could run code, so it was "
           "not loaded")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step run with a checkpoint after every step."""
    tmp = tmp_path_factory.mktemp("integrity")
    train(small_config(tmp, steps=STEPS, save_every=1, keep_checkpoints=0))
    return tmp / "run"


def _copy(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out, out / "checkpoints"


def _records(path) -> dict[str, tuple[int, int]]:
    """{record: (offset of its bytes in the file, size)} as torch's reader finds them."""
    reader = torch._C.PyTorchFileReader(str(path))
    return {name: (reader.get_record_offset(name), reader.get_record_size(name)) for name in reader.get_all_records()}


def _tensors(state, prefix=""):
    """Every tensor of a loaded state, by path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _damage(path, how) -> str:
    """Damages the checkpoint ``path`` in place; returns the record whose CRC-32 it breaks."""
    data = bytearray(path.read_bytes())
    records = _records(path)
    storage = max((r for r in records if r.startswith("data/")), key=lambda r: records[r][1])  # a 32 KiB weight
    offset, size = records[storage]
    assert size >= 8192
    if how == "64 flipped bytes":
        for i in range(offset + 256, offset + 320):
            data[i] ^= 0xFF
    elif how == "4 KiB of 0xFF":
        data[offset + 1024:offset + 5120] = b"\xff" * 4096
    elif how == "a global's name in the pickle":  # a walk before the check would call this unsafe, not damaged
        at = data.index(b"torch._utils", records["data.pkl"][0])
        data[at + len("torch._util")] = ord("r")
        storage = "data.pkl"
    elif how == "a stored CRC":  # the checksum damaged, not the record: the two disagree all the same
        name, entry = f"archive/{storage}".encode(), -1
        while data[entry + 46:entry + 46 + len(name)] != name:  # its central directory entry (the name at 46)
            entry = data.index(b"PK\x01\x02", entry + 1)
        data[entry + 16] ^= 0x01  # the CRC-32 field
    else:
        raise AssertionError(how)
    path.write_bytes(bytes(data))
    return f"archive/{storage}"


def _damaged_message(path, record) -> str:
    return (f"{path} cannot be read (its record {record} fails its CRC-32 check: its bytes changed after it was "
            "written)")


# --------------------------------------------------------------------------------------------- damaged contents


@pytest.mark.parametrize("how, changed", [("64 flipped bytes", 16), ("4 KiB of 0xFF", 1024)])
def test_flipped_or_overwritten_bytes_are_found(run_dir, tmp_path, how, changed):
    """The control first: torch.load takes the damaged file in silence (16 values changed; 1,024 NaNs), so a
    checkpoint reader without the check would resume from it. load() names the file and the record instead."""
    path = tmp_path / "checkpoint-000003.pt"
    shutil.copy(run_dir / "checkpoints" / path.name, path)
    before = _tensors(torch.load(path, weights_only=True))
    record = _damage(path, how)
    after = _tensors(torch.load(path, weights_only=True))  # no error from torch's own reader
    assert after.keys() == before.keys()
    storages = {before[k].untyped_storage().data_ptr(): k for k in before if before[k].dtype == torch.float32}
    differ = sum(int((before[k].reshape(-1).view(torch.int32) != after[k].reshape(-1).view(torch.int32)).sum())
                 for k in storages.values())  # (each storage once: a tied weight would count twice)
    assert differ == changed
    assert how != "4 KiB of 0xFF" or sum(int(t.isnan().sum()) for t in after.values() if t.is_floating_point()) == 1024
    with pytest.raises(ckpt.DamagedCheckpoint) as info:
        ckpt.load(path)
    assert str(info.value) == _damaged_message(path, record)


@pytest.mark.parametrize("how", ["64 flipped bytes", "4 KiB of 0xFF", "a global's name in the pickle",
                                 "a stored CRC"])
def test_resume_skips_a_damaged_newest_checkpoint_for_the_older_one(run_dir, tmp_path, caplog, how):
    """Resume names the damaged file and its record in one warning, resumes from step 2, renames the damaged file,
    and recomputes step 3 to the parameters the undamaged checkpoint held."""
    out, ckpt_dir = _copy(run_dir, tmp_path)
    newest = ckpt_dir / "checkpoint-000003.pt"
    expected = ckpt.read_state(newest)["model"]
    record = _damage(newest, how)
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        summary = train(small_config(tmp_path, steps=STEPS, save_every=1, keep_checkpoints=0, resume=True))
    assert summary.steps == STEPS
    skipped = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert skipped == [f"--resume: skipping a damaged checkpoint: {_damaged_message(newest, record)}",
                       f"--resume: renamed the damaged {newest} to {newest}.damaged"]
    assert (ckpt_dir / "checkpoint-000003.pt.damaged").exists()
    got = ckpt.read_state(newest)["model"]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_export_of_a_damaged_checkpoint_is_one_line(run_dir, tmp_path, capsys):
    path = tmp_path / "checkpoint-000003.pt"
    shutil.copy(run_dir / "checkpoints" / path.name, path)
    record = _damage(path, "64 flipped bytes")
    assert main(["export", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"grpo-fast export: error: CHECKPOINT: {_damaged_message(path, record)}", err
    assert not any("Traceback" in line for line in err) and not (tmp_path / "out").exists()


def test_every_reader_verifies_the_checksums(run_dir, tmp_path):
    """The other readers of these files: a .dcp's trainer_state.pt, a --model directory's pytorch_model.bin, and
    convert-checkpoint's OLD (unpickled in full, but not before its checksums pass)."""
    source = run_dir / "checkpoints" / "checkpoint-000001.pt"
    state = ckpt.read_state(source)
    dcp = tmp_path / "checkpoint-000001.dcp"
    dcp.mkdir()
    ckpt.save_atomic({k: state[k] for k in ckpt.TRAINER_KEYS}, dcp / ckpt.TRAINER_STATE)
    model = tmp_path / "model"
    model.mkdir()
    torch.save(state["model"], model / "pytorch_model.bin")
    old = tmp_path / "checkpoint-000009.pt"
    shutil.copy(source, old)
    for file in (dcp / ckpt.TRAINER_STATE, model / "pytorch_model.bin", old):
        ckpt.load(file)  # intact: each reads
        data = bytearray(file.read_bytes())
        offset, size = max(_records(file).values(), key=lambda r: r[1])
        data[offset + size // 2] ^= 0x10
        file.write_bytes(bytes(data))
    with pytest.raises(ckpt.DamagedCheckpoint, match=rf"^{dcp / ckpt.TRAINER_STATE} cannot be read \(its record "
                                                     r"archive/\S+ fails its CRC-32 check"):
        ckpt.read_state(dcp)
    with pytest.raises(ValueError, match=rf"^--model: {model / 'pytorch_model.bin'} cannot be read \(its record "):
        ckpt.check_weights(model, "--model")
    with pytest.raises(ckpt.DamagedCheckpoint, match=rf"^OLD: {old} cannot be read \(its record archive/\S+ fails"):
        ckpt.convert(old, tmp_path / "new.pt")
    assert not (tmp_path / "new.pt").exists()


def test_a_file_written_without_checksums_loads_with_a_warning(tmp_path, caplog):
    """torch.serialization.set_crc32_options(False) writes every CRC as 0: such a file is read, with one warning
    that it was not verified; save_atomic writes checksums whatever that option says, and leaves it as it was."""
    path = tmp_path / "checkpoint-000001.pt"
    state = {"step": 1, "w": torch.arange(12.0)}
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, path)
        ckpt.save_atomic(state, tmp_path / "saved.pt")
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)
    assert not any(info.CRC for info in zipfile.ZipFile(path).infolist())
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        assert torch.equal(ckpt.load(path)["w"], state["w"])
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} carries no checksums (it was written with torch.serialization.set_crc32_options(False)): read "
        "without an integrity check"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        assert torch.equal(ckpt.load(tmp_path / "saved.pt")["w"], state["w"])
    assert all(info.CRC for info in zipfile.ZipFile(tmp_path / "saved.pt").infolist() if info.file_size)
    assert not caplog.records


def test_a_checkpoint_of_an_earlier_version_is_verified_too(tmp_path, caplog):
    """Checkpoints written before the check (plain torch.save, which has always stored the CRC-32s) are read
    without a warning, and their damage is found the same way."""
    path = tmp_path / "checkpoint-000004.pt"
    torch.save({"step": 4, "w": torch.ones(64)}, path)
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        assert ckpt.load(path)["step"] == 4
    assert not caplog.records
    data = bytearray(path.read_bytes())
    offset, _ = _records(path)["data/0"]
    data[offset + 7] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"its record checkpoint-000004/data/0 fails its CRC-32 check"):
        ckpt.load(path)


def test_an_archive_with_two_records_of_one_name_is_damaged(tmp_path):
    path = tmp_path / "checkpoint-000001.pt"
    torch.save({"step": 1}, path)
    name = next(n for n in zipfile.ZipFile(path).namelist() if n.endswith("/data.pkl"))
    with zipfile.ZipFile(path, "a") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        archive.writestr(name, pickle.dumps({"step": 2}, protocol=2))
    assert zipfile.ZipFile(path).namelist().count(name) == 2
    with pytest.raises(ckpt.DamagedCheckpoint, match=rf"\(a damaged archive: two records named {name}\)$"):
        ckpt.load(path)


# --------------------------------------------------------------------------------------------- pickle protocols


class Payload:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plain_state():
    shared = [1, "shared", 2.5]
    return {"step": 7, "w": torch.arange(12.0).reshape(3, 4)[:, 1:], "h": torch.ones(5, dtype=torch.bfloat16),
            "i": torch.tensor([1, 2], dtype=torch.int64), "big": 2**100, "text": "é\udcff", "none": None,
            "flags": (True, False), "nested": {"a": shared, "b": shared, "c": {"d": [shared, ()]}},
            "od": OrderedDict(x=1)}


def _assert_same(got, want):
    assert type(got) is type(want) or (isinstance(want, dict) and isinstance(got, dict)), (got, want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_plain_checkpoint_of_any_protocol_loads(tmp_path, protocol, recwarn):
    """torch.save(..., pickle_protocol=4) of plain values was refused as damaged (the scan knew only GLOBAL); every
    protocol now loads, values, dtypes, views and shared containers as saved, without torch's protocol warning."""
    path = tmp_path / "checkpoint-000007.pt"
    state = _plain_state()
    torch.save(state, path, pickle_protocol=protocol)
    got = ckpt.load(path)
    _assert_same(got, state)
    assert got["nested"]["a"] is got["nested"]["b"] is got["nested"]["c"]["d"][0]
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]
    buffer = io.BytesIO()  # a buffer (a .dcp's bytes entry) as a path
    torch.save(state, buffer, pickle_protocol=protocol)
    buffer.seek(0)
    _assert_same(ckpt.load(buffer, "entry"), state)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_payload_of_any_protocol_is_refused_as_unsafe(tmp_path, protocol):
    """Protocol 4's payload reaches os.system by STACK_GLOBAL, and was called damaged: refused as unsafe, unread."""
    marker, path = tmp_path / "MARKER", tmp_path / "checkpoint-000009.pt"
    torch.save({"step": 1, "x": Payload(marker)}, path, pickle_protocol=protocol)
    torch.load(path, weights_only=False)  # the control: it is a working payload
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ckpt.UnsafeCheckpoint) as info:
        ckpt.load(path)
    assert str(info.value) == REFUSED.format(file=path, glob="posix.system")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [4, 5])
def test_resume_stops_at_a_payload_of_protocol_4_or_5(run_dir, tmp_path, protocol):
    """The documented behaviour: a planted newest checkpoint stops the resume, unread and not renamed; it is not
    skipped for the older checkpoint as a damaged one is."""
    out, ckpt_dir = _copy(run_dir, tmp_path)
    marker, planted = tmp_path / "MARKER", ckpt_dir / "checkpoint-000004.pt"
    state = ckpt.read_state(ckpt_dir / "checkpoint-000003.pt")
    torch.save({**state, "step": 4, "sampler": Payload(marker)}, planted, pickle_protocol=protocol)
    before = planted.read_bytes()
    with pytest.raises(ValueError) as info:
        train(small_config(tmp_path, steps=5, save_every=1, keep_checkpoints=0, resume=True))
    assert str(info.value) == (f"--resume: {REFUSED.format(file=planted, glob='posix.system')}; nothing in "
                               f"{ckpt_dir} was changed")
    assert not marker.exists() and planted.read_bytes() == before and not list(ckpt_dir.glob("*.damaged"))


def test_resume_from_a_protocol_4_checkpoint(run_dir, tmp_path, caplog):
    """A harmless checkpoint re-saved with protocol 4 resumes: same state, no damaged warning, the next step runs."""
    out, ckpt_dir = _copy(run_dir, tmp_path)
    newest = ckpt_dir / "checkpoint-000003.pt"
    state = ckpt.read_state(newest)
    torch.save(state, newest, pickle_protocol=4)
    _assert_same(ckpt.read_state(newest), state)
    with caplog.at_level("INFO", logger="grpo_fast.train"):
        assert train(small_config(tmp_path, steps=4, save_every=1, keep_checkpoints=0, resume=True)).steps == 4
    assert f"resumed from {newest} (step 3)" in caplog.text and "damaged" not in caplog.text


# --------------------------------------------------------------------------------------------- hand-made pickles


def _u(text: str) -> bytes:
    encoded = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(encoded)]) + encoded


def _u8(text: str) -> bytes:
    encoded = text.encode()
    return pickle.BINUNICODE8 + len(encoded).to_bytes(8, "little") + encoded


def _archive(path, pickled: bytes):
    """A torch.save archive (as torch's reader takes it) whose pickle is ``pickled``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


_EXT_SYSTEM, _EXT_ORDERED = 0xF0, 0x1234


@pytest.fixture
def extensions():
    """copyreg codes for os.system and collections.OrderedDict, as an EXT payload would need registered."""
    copyreg.add_extension("os", "system", _EXT_SYSTEM)
    copyreg.add_extension("collections", "OrderedDict", _EXT_ORDERED)
    yield
    copyreg.remove_extension("os", "system", _EXT_SYSTEM)
    copyreg.remove_extension("collections", "OrderedDict", _EXT_ORDERED)


def _payloads(command: str) -> dict[str, bytes]:
    """Each way a pickle reaches os.system; each runs ``command`` under pickle.loads."""
    call = _u(command) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
    p4 = pickle.PROTO + b"\x04"
    return {
        "GLOBAL": pickle.PROTO + b"\x02" + pickle.GLOBAL + b"os\nsystem\n" + call,
        "STACK_GLOBAL": p4 + _u("os") + _u("system") + pickle.STACK_GLOBAL + call,
        "STACK_GLOBAL from the memo": (p4 + _u("os") + pickle.MEMOIZE + pickle.POP + _u("system") + pickle.MEMOIZE
                                       + pickle.POP + pickle.BINGET + b"\x00" + pickle.BINGET + b"\x01"
                                       + pickle.STACK_GLOBAL + call),
        "STACK_GLOBAL from LONG_BINGET": (p4 + _u8("os") + pickle.LONG_BINPUT + (7).to_bytes(4, "little")
                                          + _u8("system") + pickle.LONG_BINPUT + (9).to_bytes(4, "little")
                                          + pickle.POP + pickle.POP + pickle.LONG_BINGET + (7).to_bytes(4, "little")
                                          + pickle.LONG_BINGET + (9).to_bytes(4, "little") + pickle.STACK_GLOBAL
                                          + call),
        "STACK_GLOBAL of duplicated strings": (p4 + _u("os") + pickle.DUP + pickle.POP + _u("system")
                                               + pickle.STACK_GLOBAL + call),
        "INST": pickle.MARK + _u(command) + pickle.INST + b"os\nsystem\n" + pickle.STOP,
        "OBJ": (p4 + pickle.MARK + _u("os") + _u("system") + pickle.STACK_GLOBAL + _u(command) + pickle.OBJ
                + pickle.STOP),
        "EXT1": pickle.PROTO + b"\x02" + pickle.EXT1 + bytes([_EXT_SYSTEM]) + call,
        "a payload cut short": p4 + _u("os") + _u("system") + pickle.STACK_GLOBAL + _u(command) + pickle.TUPLE1,
    }


@pytest.mark.parametrize("kind", list(_payloads("x")))
def test_every_opcode_that_reaches_a_global_is_understood(tmp_path, extensions, kind):
    """Hand-made payloads, one per way to a global: each runs under pickle.loads (the control), each is refused
    as unsafe, naming os.system (posix.system is the same function), before anything is unpickled."""
    marker = tmp_path / "MARKER"
    pickled = _payloads(f"touch {marker}")[kind]
    if kind != "a payload cut short":
        pickle.loads(pickled)
        assert marker.exists()
        marker.unlink()
    path = _archive(tmp_path / "checkpoint-000001.pt", pickled)
    with pytest.raises(ckpt.UnsafeCheckpoint) as info:
        ckpt.load(path)
    assert str(info.value) == REFUSED.format(file=path, glob="os.system")
    assert not marker.exists()


def test_a_global_named_by_computed_values_is_unsafe(tmp_path):
    """STACK_GLOBAL of values that are not strings of the pickle (here an object a call returned): no static
    walk can name it, so it is refused, not guessed."""
    pickled = (pickle.PROTO + b"\x04" + pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE
               + pickle.REDUCE + _u("system") + pickle.STACK_GLOBAL + pickle.STOP)
    with pytest.raises(ckpt.UnsafeCheckpoint, match=r"needs the global <computed while unpickling: STACK_GLOBAL of "):
        ckpt.load(_archive(tmp_path / "checkpoint-000001.pt", pickled))


def test_a_harmless_ext_code_loads(tmp_path, extensions):
    """An EXT code of an allowed global is rewritten to that GLOBAL and loads."""
    pickled = (pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + _u("od") + pickle.EXT2
               + _EXT_ORDERED.to_bytes(2, "little") + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.SETITEM + pickle.STOP)
    assert pickle.loads(pickled) == {"od": OrderedDict()}
    got = ckpt.load(_archive(tmp_path / "checkpoint-000001.pt", pickled))
    assert got == {"od": OrderedDict()} and type(got["od"]) is OrderedDict


@pytest.mark.parametrize("pickled, why", [
    (pickle.PROTO + b"\x04" + pickle.NONE, r"its pickle is malformed: it ends before its STOP opcode"),
    (pickle.PROTO + b"\x02" + pickle.NONE + pickle.TUPLE2 + pickle.STOP,
     r"its pickle is malformed: TUPLE2 at byte 3 takes 2 values from a stack that holds 1"),
    (pickle.PROTO + b"\x02" + pickle.BINGET + b"\x05" + pickle.STOP,
     r"its pickle is malformed: BINGET at byte 2 fetches nothing from the memo"),
    (pickle.PROTO + b"\x02" + b"\xff" + pickle.STOP, r"its pickle is malformed: unknown opcode 0xff at byte 2"),
    (pickle.PROTO + b"\x02" + pickle.EXT1 + b"\xf1" + pickle.STOP,
     r"its pickle is malformed: EXT1 at byte 2 names the extension code 241, which is not registered"),
    (pickle.PROTO + b"\x02" + pickle.BINUNICODE + (99).to_bytes(4, "little") + b"ab" + pickle.STOP,
     r"its pickle is malformed: it ends inside the BINUNICODE opcode at byte 2"),
    (b"I1\n.", r"its pickle uses the opcode INT, which torch's weights-only unpickler does not take; re-save it "
               r"with torch.save"),
])
def test_a_malformed_or_unreadable_pickle_is_damaged(tmp_path, pickled, why):
    path = _archive(tmp_path / "checkpoint-000001.pt", pickled)
    with pytest.raises(ckpt.DamagedCheckpoint, match=rf"^{path} cannot be read \({why}\)$"):
        ckpt.load(path)


def _random_plain(rng: random.Random, depth: int, pool: list):
    """A random plain value: numbers (huge ones included), strings (non-ASCII, surrogates), None, bools, and
    lists, tuples and dicts of them, some shared (taken again from ``pool``)."""
    kind = rng.randrange(9 if depth > 0 else 4)
    if kind == 4 and not pool:
        kind = 5
    if kind == 0:
        return rng.choice([0, -1, 255, 256, 65535, 2**31, -2**31 - 1, 2**70, -2**200])
    if kind == 1:
        return rng.choice([0.0, -1.5, 1e300, float("inf")])
    if kind == 2:
        return rng.choice(["", "a", "é" * 300, "\udcff", "torch", "x" * 70000])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4 and pool:
        return rng.choice(pool)
    items = [_random_plain(rng, depth - 1, pool) for _ in range(rng.randrange(4))]
    value = {5: lambda: items, 6: lambda: tuple(items), 7: lambda: {f"k{i}": v for i, v in enumerate(items)},
             8: lambda: dict(enumerate(items))}[kind]()
    pool.append(value)
    return value


def _sharing(value) -> list:
    """The containers of ``value`` in walk order, each seen again as the index of its first sight: equal lists
    mean the same containers are shared in the same places."""
    seen: dict[int, int] = {}
    out: list = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple, dict)) and (v or not isinstance(v, tuple)):
            if id(v) in seen:
                out.append(seen[id(v)])
                continue
            seen[id(v)] = len(seen)
            out.append(type(v).__name__)
            stack.extend(v.values() if isinstance(v, dict) else v)
    return out


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_rewrite_keeps_every_value_and_shared_reference(protocol):
    """The pickle of protocol 3..5 rewritten in protocol 2's opcodes reads, in torch's weights-only unpickler, as
    pickle.loads reads the original (values and shared containers), over random plain values."""
    from torch import _weights_only_unpickler

    rng = random.Random(protocol)
    for _ in range(40):
        pool: list = []
        value = [_random_plain(rng, 4, pool) for _ in range(3)] + [pool[:3]]
        pickled = pickle.dumps(value, protocol=protocol)
        walk = walk_pickle(pickled)
        assert walk.error is None and not walk.unsupported and not walk.globals
        rewritten = walk_pickle(pickled, walk.elided).rewritten if walk.rewrite else pickled
        got = _weights_only_unpickler.Unpickler(io.BytesIO(rewritten), encoding="utf-8").load()
        want = pickle.loads(pickled)
        assert repr(got) == repr(want)
        assert _sharing(got) == _sharing(want) and len(set(_sharing(want))) < len(_sharing(want))


def test_the_walk_is_linear(tmp_path):
    """Pickles of many opcodes (deep MARKs, long runs of memo fetches, many strings) are walked in one pass: a
    walk that went back over the stack or the memo per opcode would take minutes here."""
    n = 300_000
    start = time.perf_counter()
    for pickled in (pickle.PROTO + b"\x04" + pickle.MARK * n + pickle.POP_MARK * n + pickle.NONE + pickle.STOP,
                    pickle.PROTO + b"\x04" + pickle.NONE + pickle.MEMOIZE + (pickle.BINGET + b"\x00" + pickle.POP) * n
                    + pickle.STOP):
        with pytest.raises(ckpt.DamagedCheckpoint, match=r"uses the opcode (POP|POP_MARK)"):
            ckpt.load(_archive(tmp_path / "checkpoint-000001.pt", pickled))
    path = tmp_path / "checkpoint-000002.pt"
    torch.save({"names": [f"s{i}" for i in range(n // 6)]}, path, pickle_protocol=4)
    assert len(ckpt.load(path)["names"]) == n // 6
    assert time.perf_counter() - start < 10.0


# --------------------------------------------------------------------------------------------- a full disk

_Usage = namedtuple("_Usage", "total used free")


@pytest.fixture
def twelve_kib_free(monkeypatch):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: _Usage(2**30, 2**30 - 12288, 12288))


class _FillingFile:
    """A file opened for writing that takes ``room`` bytes, then fails each write with ``code`` (ENOSPC: as a
    file on a full disk does)."""

    def __init__(self, f, room: int, code: int):
        self.f, self.room, self.code = f, room, code

    def write(self, data) -> int:
        if len(data) > self.room:
            self.f.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _full_disk(monkeypatch, how: str) -> None:
    """Makes the next save_atomic fail the way a full disk (or another error, for the controls) makes it fail."""
    real_open = open
    if how in ("torch's zip writer: ENOSPC", "torch's zip writer: EDQUOT", "torch's zip writer: EIO"):
        code = {"ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EIO": errno.EIO}[how.rsplit(" ", 1)[1]]

        def filling_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return _FillingFile(f, 1000, code) if "w" in mode else f

        monkeypatch.setattr(ckpt, "open", filling_open, raising=False)
    elif how == "torch's RuntimeError alone":
        def save(state, f, *args, **kwargs):
            f.write(b"PK\x03\x04 half an archive")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

        monkeypatch.setattr(ckpt.torch, "save", save)
    elif how in ("fsync: ENOSPC", "fsync: EIO"):
        code = errno.ENOSPC if how.endswith("ENOSPC") else errno.EIO

        def fsync(fd):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(ckpt.os, "fsync", fsync)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["torch's zip writer: ENOSPC", "torch's zip writer: EDQUOT",
                                 "torch's RuntimeError alone", "fsync: ENOSPC"])
def test_a_full_disk_while_saving_is_one_line(tmp_path, monkeypatch, twelve_kib_free, how):
    """The error torch.save raises on a full disk ("unexpected pos", the OSError in its context), a quota, or a
    failed fsync: one line naming the file and the space left; the temporary file is gone and the earlier
    checkpoint reads as before."""
    path = tmp_path / "checkpoint-000002.pt"
    ckpt.save_atomic({"step": 1, "w": torch.ones(4)}, path)
    before = path.read_bytes()
    _full_disk(monkeypatch, how)
    with pytest.raises(ckpt.DiskFull) as info:
        ckpt.save_atomic({"step": 2, "w": torch.zeros(10_000)}, path)
    assert str(info.value) == (f"cannot write {path}: the disk is full (12.0 KiB free in {tmp_path}); its partial "
                               "file was removed and nothing else was changed")
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name] and path.read_bytes() == before
    assert ckpt.load(path)["step"] == 1


@pytest.mark.parametrize("how, error", [("torch's zip writer: EIO", RuntimeError), ("fsync: EIO", OSError)])
def test_other_write_errors_are_not_called_a_full_disk(tmp_path, monkeypatch, how, error):
    """The control: an I/O error that is not ENOSPC (even behind the same "unexpected pos") passes through as it
    is; the temporary file is removed all the same."""
    path = tmp_path / "checkpoint-000002.pt"
    _full_disk(monkeypatch, how)
    with pytest.raises(error) as info:
        ckpt.save_atomic({"step": 2, "w": torch.zeros(10_000)}, path)
    assert not isinstance(info.value, ckpt.DiskFull)
    assert not list(tmp_path.iterdir())


def test_is_disk_full_reads_every_wrapping():
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device")
    assert ckpt.is_disk_full(full) and ckpt.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert ckpt.is_disk_full(SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                             'message: "No space left on device" })'))
    assert ckpt.is_disk_full(CheckpointException("rank 1 failed", {1: (full, None)}))
    assert not ckpt.is_disk_full(CheckpointException("rank 1 failed", {1: (OSError(errno.EIO, "EIO"), None)}))
    assert not ckpt.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not ckpt.is_disk_full(RuntimeError("size mismatch for weight"))


def _raise_on_save_pretrained(monkeypatch, error):
    """model.save_pretrained writes part of its weights, then fails with ``error``."""
    import transformers

    def save_pretrained(self, directory, *args, **kwargs):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise error

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_pretrained)


@pytest.mark.parametrize("error", ["SafetensorError", "OSError"])
def test_a_full_disk_while_writing_the_model_is_one_line(run_dir, tmp_path, monkeypatch, twelve_kib_free, error):
    """save_model (model/ at the end of a run): the partial directory is removed, an earlier model/ is kept."""
    from safetensors import SafetensorError

    from grpo_fast.train.export import load_checkpoint_model, save_model

    model, tokenizer, _ = load_checkpoint_model(run_dir / "checkpoints" / "checkpoint-000001.pt")
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    _raise_on_save_pretrained(monkeypatch, SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })')
        if error == "SafetensorError" else OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(ckpt.DiskFull) as info:
        save_model(model, tokenizer, out)
    assert str(info.value) == (f"cannot write {out}: the disk is full (12.0 KiB free in {tmp_path}); the partial "
                               f"export was removed; the earlier {out} is intact")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and os.listdir(out) == ["config.json"]


def test_export_to_a_full_disk_is_one_line(run_dir, tmp_path, monkeypatch, twelve_kib_free, capsys):
    _raise_on_save_pretrained(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    out = tmp_path / "out"
    assert main(["export", str(run_dir / "checkpoints" / "checkpoint-000001.pt"), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"grpo-fast export: error: OUT_DIR: cannot write {out}: the disk is full (12.0 KiB free in "
                       f"{tmp_path}); the partial export was removed"), err
    assert not any("Traceback" in line for line in err) and not list(tmp_path.iterdir())


def test_a_full_disk_stops_the_run_with_what_is_kept(tmp_path, monkeypatch, twelve_kib_free, caplog):
    """The step-2 checkpoint fails on a full disk: the run stops with one message naming it, the step-1 checkpoint
    and --resume; once there is room, --resume continues from step 1."""
    real_save = torch.save

    def save(state, f, *args, **kwargs):
        if isinstance(state, dict) and state.get("step") == 2:
            f.write(b"PK\x03\x04 half an archive")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(state, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    with pytest.raises(ckpt.DiskFull) as info:
        train(small_config(tmp_path, steps=STEPS, save_every=1, keep_checkpoints=0))
    assert str(info.value) == (
        f"cannot write {ckpt_dir / 'checkpoint-000002.pt'}: the disk is full (12.0 KiB free in {ckpt_dir}); its "
        f"partial file was removed and nothing else was changed; the newest checkpoint, "
        f"{ckpt_dir / 'checkpoint-000001.pt'} (step 1), is intact: free some space, then continue with --resume")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint-000001.pt"]
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        assert train(small_config(tmp_path, steps=STEPS, save_every=1, keep_checkpoints=0, resume=True)).steps == 3
    assert f"resumed from {ckpt_dir / 'checkpoint-000001.pt'} (step 1)" in caplog.text


def test_a_full_disk_at_the_model_export_names_the_export_command(tmp_path, monkeypatch, twelve_kib_free):
    _raise_on_save_pretrained(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    out = tmp_path / "run"
    with pytest.raises(ckpt.DiskFull) as info:
        train(small_config(tmp_path, steps=1))
    last = out / "checkpoints" / "checkpoint-000001.pt"
    assert str(info.value) == (f"cannot write {out / 'model'}: the disk is full (12.0 KiB free in {out}); the "
                               f"partial export was removed; the trained run is saved in {last} (step 1): free some "
                               f"space, then write the model with: grpo-fast export {last} {out / 'model'}")
    assert not (out / "model").exists() and not list(out.glob(".model.*.tmp")) and ckpt.read_state(last)["step"] == 1


def test_a_full_disk_while_saving_a_sharded_checkpoint(tmp_path, monkeypatch, twelve_kib_free):
    """torch.distributed.checkpoint reports a rank's failed write as a CheckpointException (a BaseException) on
    every rank: read as a full disk, the partial .dcp directory removed."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def save(state, checkpoint_id, **kwargs):
        (tmp_path / checkpoint_id).joinpath("__0_0.distcp").write_bytes(b"half")
        raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"),
                                                      traceback.StackSummary())})

    monkeypatch.setattr(dcp, "save", save)
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "checkpoint-000002.dcp"
    with pytest.raises(ckpt.DiskFull) as info:
        ckpt.save_sharded(model, torch.optim.AdamW(model.parameters()), {"step": 2}, path, True, lambda: None)
    assert str(info.value) == (f"cannot write {path}: the disk is full (12.0 KiB free in {tmp_path}); its partial "
                               "directory was removed and nothing else was changed")
    assert not list(tmp_path.iterdir())


def test_grpo_fast_train_on_a_full_disk_is_one_line(tmp_path, monkeypatch, twelve_kib_free, capsys):
    """The command line: no traceback, the message of the DiskFull, exit status 1."""
    real_save = torch.save

    def save(state, f, *args, **kwargs):
        if isinstance(state, dict) and state.get("step") == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(state, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save)
    out = tmp_path / "run"
    code = main(["train", "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "8",
                 "--eval-size", "16", "--max-new-tokens", "3", "--output-dir", str(out), "--progress", "false",
                 "--plot", "false", "--save-every", "1", "--warmup-steps", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    assert err[-1].startswith("grpo-fast train: error: cannot write ") and "the disk is full" in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_a_resume_refusal_names_only_what_changed(run_dir, tmp_path):
    out, _ = _copy(run_dir, tmp_path)
    with pytest.raises(ValueError) as info:
        train(small_config(tmp_path, steps=STEPS + 1, save_every=1, keep_checkpoints=0, resume=True,
                           **{"loss.beta": "0.1"}))
    message = str(info.value)
    assert "(TrainConfig.loss.beta: 0.0 -> 0.1)" in message and "epsilon" not in message, message


def test_a_checkpoint_whose_saved_options_are_a_reference_bomb_is_refused_at_once(run_dir, tmp_path):
    """A valid file whose config holds 2**40 shared references: the refusal shows it short, it never walks it."""
    out, ckpt_dir = _copy(run_dir, tmp_path)
    newest = ckpt_dir / "checkpoint-000003.pt"
    state = ckpt.load(newest)
    bomb = [0]
    for _ in range(40):
        bomb = [bomb, bomb]
    state["config"]["rewards"] = bomb
    ckpt.save_atomic(state, newest)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rewards: \[\["):
        train(small_config(tmp_path, steps=STEPS + 1, save_every=1, keep_checkpoints=0, resume=True))
    assert time.monotonic() - start < 30


def test_a_compressed_record_is_refused_unread(tmp_path):
    """torch.save never compresses: a deflated or bzip2 record (a small file that inflates to gigabytes) is damaged."""
    path = tmp_path / "checkpoint-000001.pt"
    ckpt.save_atomic({"step": 1, "w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in records:
            archive.writestr(info.filename, data, compress_type=zipfile.ZIP_BZIP2 if info.filename.endswith(
                "data/0") else zipfile.ZIP_STORED)
    with pytest.raises(ckpt.DamagedCheckpoint, match="is compressed, which torch.save never writes"):
        ckpt.load(path)


def test_export_takes_a_checkpoint_from_a_machine_with_more_cpus(run_dir, tmp_path, capsys):
    out, ckpt_dir = _copy(run_dir, tmp_path)
    newest = ckpt_dir / "checkpoint-000003.pt"
    state = ckpt.load(newest)
    state["config"]["threads"] = 4096
    state["config"]["seed"] = 2**40  # seeds up to 64 bits are runs' seeds
    ckpt.save_atomic(state, newest)
    assert main(["export", str(newest), str(tmp_path / "exported")]) == 0, capsys.readouterr().err
