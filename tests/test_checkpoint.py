"""Checkpoints: atomic writes, and a resumed run (even one killed in the middle of a save) reaching the same
parameters as an uninterrupted one."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from train_helpers import HERE, small_config

from grpo_fast.train import train
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train.metrics import read_steps

STEPS = 6


def _final_params(out_dir):
    _, path = ckpt.list_checkpoints(out_dir / "checkpoints")[-1]
    return ckpt.read_state(path)["model"]


def _config_kwargs(tmp_path, name, **kw):
    # warm-up then cosine: the restored scheduler matters; beta and mu: the reference and old passes are covered
    return dict(steps=STEPS, output_dir=str(tmp_path / name), warmup_steps=3, lr_schedule="cosine",
                **{"loss.beta": "0.05", "mu": 2}, **kw)


def test_save_atomic_leaves_no_partial_file(tmp_path, monkeypatch):
    path = ckpt.checkpoint_path(tmp_path, 3)
    ckpt.save_atomic({"a": torch.ones(3)}, path)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):  # the failure reaches the caller
        ckpt.save_atomic({"a": torch.zeros(3)}, path)
    assert torch.equal(ckpt.load(path)["a"], torch.ones(3))  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # and no temporary is left


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_atomic({"step": step}, ckpt.checkpoint_path(tmp_path, step))
    ckpt.prune(tmp_path, 2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]


def test_resume_after_a_kill_in_the_middle_of_a_save_matches_an_uninterrupted_run(tmp_path):
    straight = small_config(tmp_path, **_config_kwargs(tmp_path, "straight"))
    train(straight)
    expected = _final_params(tmp_path / "straight")

    # the same run in a child process that SIGKILLs itself halfway through writing the step-4 checkpoint
    crashed_dir = tmp_path / "crashed"
    overrides = _config_kwargs(tmp_path, "crashed", save_every=2, keep_checkpoints=0)
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from train_helpers import small_config
        from grpo_fast.train import checkpoint, train

        real_save = torch.save

        def save_then_die(state, f, *a, **k):
            if state["step"] == 4:
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_save(state, f, *a, **k)

        checkpoint.torch.save = save_then_die
        train(small_config(Path({str(tmp_path)!r}), **{overrides!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpt_dir = crashed_dir / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(ckpt_dir)] == [2]
    assert list(ckpt_dir.glob(".checkpoint-*.tmp"))  # the interrupted save's partial file

    summary = train(small_config(tmp_path, **overrides, resume=True))
    assert summary.steps == STEPS
    assert not list(ckpt_dir.glob(".checkpoint-*.tmp"))
    got = _final_params(crashed_dir)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    # the metrics file reads as one run: steps 1..6 once each, one start and one end line
    assert [s["step"] for s in read_steps(crashed_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    events = [json.loads(line)["event"] for line in (crashed_dir / "metrics.jsonl").read_text().splitlines()]
    assert events.count("start") == 1 and events.count("end") == 1


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    """As TRL's resume_from_checkpoint=True: --resume with nothing to resume is an error, not a fresh start."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^--resume: nothing to resume \({out} does not exist\); start the run "
                                         r"without --resume$"):
        train(small_config(tmp_path, steps=1, resume=True))
    assert not out.exists()
    out.mkdir()
    with pytest.raises(ValueError, match=rf"^--resume: nothing to resume \(no checkpoint in {out / 'checkpoints'}\); "
                                         r"start the run without --resume$"):
        train(small_config(tmp_path, steps=1, resume=True))
    train(small_config(tmp_path, steps=1, save_every=0, keep_checkpoints=1))
    for _, path in ckpt.list_checkpoints(out / "checkpoints"):
        path.unlink()  # a run with steps but no checkpoint left: only --overwrite starts again
    with pytest.raises(ValueError, match=r"\); start over in it with --overwrite instead$"):
        train(small_config(tmp_path, steps=1, resume=True))


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^TrainConfig.resume and TrainConfig.overwrite exclude each other .*; pass "
                                         r"one, got both$"):
        small_config(tmp_path, resume=True, overwrite=True)


def test_resume_with_other_options_is_refused(tmp_path):
    train(small_config(tmp_path, steps=1))
    with pytest.raises(ValueError, match=r"--resume: .* other options \(TrainConfig\.group_size: 4 -> 8\)"):
        train(small_config(tmp_path, steps=2, group_size=8, resume=True))
    summary = train(small_config(tmp_path, steps=2, resume=True))  # more steps is fine
    assert summary.steps == 2


def _draws() -> list:
    """One draw from every global generator a step could use (CUDA's where there is one)."""
    import numpy as np

    out = [random.random(), random.gauss(0, 1), float(np.random.random()), float(np.random.standard_normal()),
           float(torch.rand(()))]
    if torch.cuda.is_available():
        out += [float(torch.rand((), device=f"cuda:{i}")) for i in range(torch.cuda.device_count())]
    return out


def test_rng_state_round_trip_through_a_checkpoint_file(tmp_path):
    pytest.importorskip("numpy")
    random.seed(1)
    torch.manual_seed(1)
    np = __import__("numpy")
    np.random.seed(1)
    random.gauss(0, 1), np.random.standard_normal()  # each now holds the second normal of a pair, saved with it
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    path = tmp_path / "rng.pt"
    ckpt.save_atomic({"rng": ckpt.rng_state()}, path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []  # tensors and numbers: no numpy
    expected = _draws()
    assert _draws() != expected  # the generators moved on: each draw is new
    ckpt.set_rng_state(ckpt.load(path)["rng"])
    assert _draws() == expected
    assert {"python", "numpy", "torch"} <= ckpt.rng_state().keys()


def test_resume_restores_the_global_rngs_a_step_draws_from(tmp_path):
    """A reward that draws from Python's, numpy's and torch's global generators: the run saved at step 2 and resumed
    (in between, the saved run's after-evaluation and the resumed run's set-up drew from them too) reaches the
    parameters of the uninterrupted run only if all three states come back."""
    pytest.importorskip("numpy")
    rewards = tmp_path / "noisy.py"
    rewards.write_text("import random\nimport numpy as np\nimport torch\n\n"
                       "def noisy(prompts, completions, **kw):\n"
                       "    return [random.random() + float(np.random.random()) + float(torch.rand(()))\n"
                       "            for _ in completions]\n")
    options = dict(rewards=f"{rewards}:noisy", **{"loss.beta": "0.05"})
    train(small_config(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "straight"), **options))
    expected = _final_params(tmp_path / "straight")
    train(small_config(tmp_path, steps=2, output_dir=str(tmp_path / "resumed"), **options))
    train(small_config(tmp_path, steps=4, save_every=2, output_dir=str(tmp_path / "resumed"), resume=True, **options))
    got = _final_params(tmp_path / "resumed")
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_resume_removes_a_partial_model_export(tmp_path, caplog):
    """A run killed while writing model/ leaves .model.<pid>.tmp beside it; --resume removes it, says so, and leaves
    everything else alone."""
    train(small_config(tmp_path, steps=2, save_every=1))
    out = tmp_path / "run"
    partial = out / ".model.4242.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    before = sorted(p.name for p in out.iterdir() if p != partial)
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        train(small_config(tmp_path, steps=3, save_every=1, resume=True))
    assert not partial.exists()
    assert "removed 1 partial model/ export(s) left by an interrupted run: .model.4242.tmp" in caplog.text
    assert set(before) <= {p.name for p in out.iterdir()}
