"""Checkpoints cannot run code: a pickle payload planted on every path that reads a checkpoint file (resume through
``grpo-fast train``, ``grpo-fast export`` of a ``.pt`` and of a ``.dcp`` directory's ``trainer_state.pt``,
``.metadata`` and non-tensor entries, the weights of ``grpo-fast eval --model`` and ``grpo-fast train --model``) is
refused unread, with one line naming the file and the global; the payload, which would create a marker file, never
runs. A checkpoint of the previous format (numpy RNG state) is refused with the conversion command, and ``grpo-fast
convert-checkpoint --trust`` makes it resume to the parameters of an uninterrupted run; its NEW is checked first. A
file in torch.save's legacy format says so. (The TRL drop-in's resume: tests/test_trl_checkpoint_safety.py.)"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings

import pytest
import torch
from train_helpers import small_config

from grpo_fast.cli import main
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train import train

TINY = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2",
        "--progress", "false", "--plot", "false", "--save-every", "1", "--keep-checkpoints", "0"]


class Payload:
    """Unpickling it runs ``touch MARKER`` (what a hostile checkpoint would do with any command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refusal(file, glob="posix.system") -> str:
    return (f"{file} is refused unread: its pickle needs the global {glob}, which no checkpoint holds (only tensors, "
            "numbers, strings, None, and lists, tuples and dicts of them); unpickling it could run code, so it was "
            "not loaded")


def _one_line(capsys, argv, command) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(f"grpo-fast {command}: error: "), err
    return errors[0].removeprefix(f"grpo-fast {command}: error: ")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-step run through the CLI, its checkpoint-000001.pt and its model/."""
    out = tmp_path_factory.mktemp("safe") / "run"
    assert main(["train", *TINY, "--output-dir", str(out)]) == 0
    return out


def test_the_payload_runs_when_unpickled_in_full(tmp_path):
    """The control: the planted file is a working payload, so the tests below that find no marker mean something."""
    marker, path = tmp_path / "MARKER", tmp_path / "evil.pt"
    torch.save({"x": Payload(marker)}, path)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_load_refuses_a_payload_unread(tmp_path):
    marker, path = tmp_path / "MARKER", tmp_path / "evil.pt"
    torch.save({"step": 1, "x": Payload(marker)}, path)
    with pytest.raises(ckpt.UnsafeCheckpoint) as info:
        ckpt.load(path)
    assert str(info.value) == _refusal(path)
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"^save_atomic: the state holds a .*Payload at \['x'\], which a "
                                         r"checkpoint cannot hold"):
        ckpt.save_atomic({"x": Payload(marker)}, tmp_path / "saved.pt")  # nor does a save write one
    assert not (tmp_path / "saved.pt").exists()


def test_resume_stops_at_a_planted_checkpoint(run_dir, tmp_path, capsys):
    """A payload planted as the newest checkpoint: --resume does not run it, does not skip it for the older one as
    it would a damaged file, does not rename it; one line says why, exit code 2."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    marker, planted = tmp_path / "MARKER", out / "checkpoints" / "checkpoint-000002.pt"
    state = ckpt.read_state(out / "checkpoints" / "checkpoint-000001.pt")
    torch.save({**state, "step": 2, "sampler": Payload(marker)}, planted)
    before = planted.read_bytes()
    line = _one_line(capsys, ["train", *TINY, "--steps", "3", "--output-dir", str(out), "--resume"], "train")
    assert line == f"--resume: {_refusal(planted)}; nothing in {out / 'checkpoints'} was changed"
    assert not marker.exists()
    assert planted.read_bytes() == before and not list(out.glob("checkpoints/*.damaged"))


def test_export_refuses_a_planted_checkpoint(tmp_path, capsys):
    marker, planted = tmp_path / "MARKER", tmp_path / "checkpoint-000009.pt"
    torch.save({"model": {}, "config": {}, "x": Payload(marker)}, planted)
    line = _one_line(capsys, ["export", str(planted), str(tmp_path / "out")], "export")
    assert line == f"CHECKPOINT: {_refusal(planted)}"
    assert not marker.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- .dcp directories


def _sharded_checkpoint(run_dir, path, model_entries=None):
    """An FSDP2-style checkpoint of the run, made without torchrun: the model's entries in
    torch.distributed.checkpoint's format and the trainer state beside them (``model_entries`` replaces some)."""
    import torch.distributed.checkpoint as dcp

    state = ckpt.read_state(run_dir / "checkpoints" / "checkpoint-000001.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process"
        dcp.save({"model": {**state["model"], **(model_entries or {})}}, checkpoint_id=str(path), no_dist=True)
    ckpt.save_atomic({k: state[k] for k in ckpt.TRAINER_KEYS}, path / ckpt.TRAINER_STATE)
    return path


def test_a_sharded_checkpoint_exports_through_the_safe_readers(run_dir, tmp_path):
    """The control for the .dcp cases: the allow-listed metadata and the entries read back as the .pt's export."""
    from safetensors.torch import load_file

    path = _sharded_checkpoint(run_dir, tmp_path / "checkpoint-000001.dcp")
    assert main(["export", str(path), str(tmp_path / "from_dcp")]) == 0
    assert main(["export", str(run_dir / "checkpoints" / "checkpoint-000001.pt"), str(tmp_path / "from_pt")]) == 0
    got, want = load_file(tmp_path / "from_dcp" / "model.safetensors"), load_file(tmp_path / "from_pt" /
                                                                                   "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("part", ["trainer_state", "metadata", "entry"])
def test_a_payload_in_a_sharded_checkpoint_is_refused(run_dir, tmp_path, capsys, part):
    marker = tmp_path / "MARKER"
    entry = "model.embed_tokens.weight"  # a tensor's name holding a pickled object instead: DCP's "bytes" entry
    path = _sharded_checkpoint(run_dir, tmp_path / "checkpoint-000001.dcp",
                               {entry: Payload(marker)} if part == "entry" else None)
    if part == "trainer_state":
        state = ckpt.load(path / ckpt.TRAINER_STATE)
        torch.save({**state, "rng": Payload(marker)}, path / ckpt.TRAINER_STATE)
        expected = f"CHECKPOINT: {_refusal(path / ckpt.TRAINER_STATE)}"
    elif part == "metadata":
        (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        expected = (f"CHECKPOINT: {path / '.metadata'} is refused unread: its pickle needs the global posix.system, "
                    "which no torch.distributed.checkpoint metadata holds; unpickling it could run code, so it was not "
                    "loaded")
    else:
        expected = f"CHECKPOINT: {_refusal(f'{path} (entry model.{entry})')}"  # under the "model" key
    line = _one_line(capsys, ["export", str(path), str(tmp_path / "out")], "export")
    assert line == expected
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_reads_a_sharded_trainer_state_safely(run_dir, tmp_path):
    """Resume reads a .dcp's trainer_state.pt before anything else (its FSDP2 check included): refused unread."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    marker = tmp_path / "MARKER"
    path = _sharded_checkpoint(run_dir, out / "checkpoints" / "checkpoint-000002.dcp")
    torch.save({**ckpt.load(path / ckpt.TRAINER_STATE), "config": Payload(marker)}, path / ckpt.TRAINER_STATE)
    with pytest.raises(ValueError) as info:
        train(small_config(tmp_path, output_dir=str(out), resume=True))
    assert str(info.value) == (f"--resume: {_refusal(path / ckpt.TRAINER_STATE)}; nothing in {out / 'checkpoints'} "
                               "was changed")
    assert not marker.exists()


# --------------------------------------------------------------------------------------------- eval


def test_eval_refuses_a_planted_weights_file(run_dir, tmp_path, capsys):
    """A model directory whose weights are a pytorch_model.bin payload: refused before transformers sees it."""
    model = tmp_path / "model"
    shutil.copytree(run_dir / "model", model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "MARKER"
    torch.save({"lm_head.weight": Payload(marker)}, model / "pytorch_model.bin")
    line = _one_line(capsys, ["eval", "--model", str(model), "--dataset", "builtin:digits"], "eval")
    assert line == f"--model: {_refusal(model / 'pytorch_model.bin')}"
    assert not marker.exists() and not (model / "eval.json").exists()


def test_train_refuses_a_planted_weights_file(tmp_path, capsys):
    """``train --model DIR`` whose weights are a pytorch_model.bin payload: the same one-line refusal as eval's
    (transformers' weights-only load would refuse it too, as a multi-frame UnpicklingError), nothing written."""
    from train_helpers import save_local_model

    model = tmp_path / "model"
    save_local_model(model, "qwen2", None)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "MARKER"
    torch.save({"lm_head.weight": Payload(marker)}, model / "pytorch_model.bin")
    out = tmp_path / "run"
    line = _one_line(capsys, ["train", *TINY, "--model", str(model), "--output-dir", str(out)], "train")
    assert line == f"--model: {_refusal(model / 'pytorch_model.bin')}"
    assert not marker.exists() and not out.exists()


# --------------------------------------------------------------------------------------------- the older format


def _old_format(state: dict) -> dict:
    """``state`` as grpo-fast wrote it before: ``random.getstate()`` and numpy's ``get_state()`` tuples as they
    are, numpy's key a uint32 array."""
    import numpy as np

    python, numpy_state = state["rng"]["python"], state["rng"]["numpy"]
    rng = {**state["rng"], "python": (python["version"], tuple(python["internal"].tolist()), python["gauss_next"]),
           "numpy": (numpy_state["bit_generator"], np.asarray(numpy_state["key"].tolist(), dtype=np.uint32),
                     numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached_gaussian"])}
    return {**state, "rng": rng}


def test_an_old_checkpoint_is_refused_then_converted_and_resumes_bit_exact(tmp_path, capsys):
    """A run saved at step 2 in the older format: resume names the conversion command; without --trust it is
    refused; converted in place it resumes to the parameters of the uninterrupted 4-step run."""
    pytest.importorskip("numpy")
    assert train(small_config(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "straight"))).steps == 4
    expected = ckpt.read_state(tmp_path / "straight" / "checkpoints" / "checkpoint-000004.pt")["model"]
    train(small_config(tmp_path, steps=2, output_dir=str(tmp_path / "old")))
    path = tmp_path / "old" / "checkpoints" / "checkpoint-000002.pt"
    torch.save(_old_format(ckpt.read_state(path)), path)
    resumed = small_config(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "old"), resume=True)
    with pytest.raises(ValueError) as info:
        train(resumed)
    glob = "numpy._core.multiarray._reconstruct" if "numpy._core.multiarray._reconstruct" in \
        torch.serialization.get_unsafe_globals_in_checkpoint(path) else "numpy.core.multiarray._reconstruct"
    assert str(info.value) == (f"--resume: {path} is refused unread: it is in the format of an older grpo-fast, whose "
                               f"numpy RNG state needs the pickle global {glob}; if you trust the file, convert it "
                               f"(in place) with: grpo-fast convert-checkpoint {path} {path} --trust; nothing in "
                               f"{path.parent} was changed")
    before = path.read_bytes()
    line = _one_line(capsys, ["convert-checkpoint", str(path), str(path)], "convert-checkpoint")
    assert line == ("--trust is required: converting unpickles OLD in full, which runs any code it holds; pass --trust "
                    "for a checkpoint you made or otherwise trust")
    assert path.read_bytes() == before
    assert main(["convert-checkpoint", str(path), str(path), "--trust"]) == 0
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    assert train(resumed).steps == 4
    got = ckpt.read_state(tmp_path / "old" / "checkpoints" / "checkpoint-000004.pt")["model"]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_convert_writes_a_new_sharded_checkpoint_and_keeps_the_old(run_dir, tmp_path, capsys):
    old = _sharded_checkpoint(run_dir, tmp_path / "checkpoint-000001.dcp")
    state = ckpt.load(old / ckpt.TRAINER_STATE)
    torch.save(_old_format(state), old / ckpt.TRAINER_STATE)
    with pytest.raises(ckpt.UnsafeCheckpoint, match="in the format of an older grpo-fast"):
        ckpt.read_state(old)
    new = tmp_path / "converted" / "checkpoint-000001.dcp"
    new.parent.mkdir()
    assert main(["convert-checkpoint", str(old), str(new), "--trust"]) == 0
    converted = ckpt.read_state(new)
    assert converted["step"] == state["step"] and converted["rng"]["numpy"]["pos"] == state["rng"]["numpy"]["pos"]
    assert torch.equal(converted["rng"]["numpy"]["key"], state["rng"]["numpy"]["key"])
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
    with pytest.raises(ckpt.UnsafeCheckpoint):  # OLD is left as it was
        ckpt.read_state(old)
    line = _one_line(capsys, ["convert-checkpoint", str(old), str(new), "--trust"], "convert-checkpoint")
    assert line == f"NEW: {new} exists; choose a new path, or pass OLD again to convert it in place"


@pytest.mark.parametrize("where", ["below a file", "unwritable", "empty"])
def test_convert_checks_new_first_and_names_it_as_typed(tmp_path, capsys, where):
    """A NEW that cannot be written is one line naming NEW as typed (not the temporary file beside it, not a raw
    errno), before OLD is read."""
    from train_helpers import unwritable_path

    old = tmp_path / "checkpoint-000001.pt"
    torch.save({"step": 1}, old)
    (tmp_path / "a-file").write_text("")
    new = {"below a file": f"{tmp_path}/a-file/checkpoint-000001.pt",
           "unwritable": f"{unwritable_path(tmp_path)}/checkpoint-000001.pt", "empty": ""}[where]
    line = _one_line(capsys, ["convert-checkpoint", str(old), new, "--trust"], "convert-checkpoint")
    expected = {"below a file": f"NEW: cannot write {new}: cannot create or write in {tmp_path}/a-file "
                                f"({tmp_path}/a-file is a file, not a directory)",
                "unwritable": f"NEW: cannot write {new}: cannot create or write in {os.path.dirname(new)} (",
                "empty": "NEW: expected the path of the converted checkpoint, got ''"}[where]
    assert line.startswith(expected) and ".tmp" not in line and "Errno" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", old.name] + (["read-only"] if os.geteuid() else [])


def test_a_legacy_torch_save_file_is_named_as_such(tmp_path):
    """torch.save's old (non-zip) format is not "not a torch.save archive": the message says what it is."""
    path = tmp_path / "checkpoint-000001.pt"
    torch.save({"step": 1}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ckpt.DamagedCheckpoint) as info:
        ckpt.load(path)
    assert str(info.value) == (f"{path} cannot be read (an old (non-zip) torch.save format; re-save it with a "
                               "current torch)")
    path.write_bytes(b"garbage\n" * 8)
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"\(not a torch.save archive\)$"):
        ckpt.load(path)


def _shared(kind: str, depth: int):
    """A container of ``depth`` levels whose every level holds the one below twice: 1.5 KB as a pickle (memoised),
    2**depth paths to walk if shared references are followed each time."""
    inner = [0]
    for _ in range(depth):
        inner = {"list": [inner, inner], "tuple": (inner, inner), "dict": {"a": inner, "b": inner},
                 "mixed": [inner, {"x": (inner,)}]}[kind]
    return inner


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "mixed"])
def test_a_small_checkpoint_of_shared_references_loads_at_once(tmp_path, kind):
    """Plain content that shares its containers (2**40 paths, a few KB on disk) is checked in one pass over each
    container; a shared container hiding a non-plain value is still found, under the first path that reaches it."""
    import time

    path = tmp_path / "bomb.pt"
    torch.save({"x": _shared(kind, 40)}, path)
    assert path.stat().st_size < 4096
    start = time.perf_counter()
    assert ckpt.load(path)["x"] is not None
    assert time.perf_counter() - start < 2.0
    inner = {"deep": torch.device("cpu")}
    for _ in range(40):
        inner = [inner, inner]
    torch.save({"x": inner}, path)
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"a torch\.device at \['x'\](\[1\]){40}\['deep'\]"):
        ckpt.load(path)


def test_export_of_a_shared_reference_bomb_is_one_line(tmp_path, capsys):
    path = tmp_path / "checkpoint-000009.pt"
    torch.save({"x": _shared("list", 40)}, path)
    line = _one_line(capsys, ["export", str(path), str(tmp_path / "out")], "export")
    assert line.startswith(f"CHECKPOINT: {path} lacks step, ")


@pytest.mark.parametrize("kind", ["dangling link", "directory", "fifo", "link to a directory"])
def test_resume_skips_a_checkpoint_name_that_is_not_a_file(run_dir, tmp_path, caplog, kind):
    """The newest checkpoint's name is a dangling symlink, a directory, a FIFO (which an open would wait on
    forever) or a link to a directory: --resume names it, skips it as damaged, and resumes from the older one."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    planted = out / "checkpoints" / "checkpoint-000002.pt"
    if kind == "dangling link":
        planted.symlink_to(tmp_path / "gone.pt")
    elif kind == "directory":
        planted.mkdir()
    elif kind == "fifo":
        os.mkfifo(planted)
    else:
        (tmp_path / "elsewhere").mkdir()
        planted.symlink_to(tmp_path / "elsewhere")
    what = {"dangling link": f"{planted} cannot be read (FileNotFoundError: [Errno 2] No such file or directory",
            "fifo": f"{planted} cannot be read (it is a FIFO, not a file)",
            # a directory of that name is read as a sharded checkpoint: its trainer_state.pt is missing
            "directory": f"{planted}/trainer_state.pt cannot be read (FileNotFoundError",
            "link to a directory": f"{planted}/trainer_state.pt cannot be read (FileNotFoundError"}[kind]
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        assert main(["train", *TINY, "--steps", "2", "--output-dir", str(out), "--resume"]) == 0
    assert f"--resume: skipping a damaged checkpoint: {what}" in caplog.text
    step, newest = ckpt.list_checkpoints(out / "checkpoints")[-1]
    assert step == 2 and newest.is_file() and not newest.is_symlink() and ckpt.read_state(newest)["step"] == 2
