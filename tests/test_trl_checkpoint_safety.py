"""Resuming ``FastGRPOTrainer`` runs no code from the checkpoint: a pickle payload (it would create a marker file)
planted in each file a resume unpickles, ``rng_state.pth``, ``optimizer.pt``, ``scheduler.pt`` and the weights as a
``pytorch_model.bin``, is refused by torch's weights-only unpickler before it runs, and ``training_args.bin``, a full
pickle of the config, is never read. Under DeepSpeed, whose engine unpickles its files in full, the resume is refused
unless the checkpoint is trusted. (What each file is read with: docs/trl.md, "Resuming".)"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_fixtures import build_tiny_grpo_trainer, save_tiny_model, token_sum_reward  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

PROMPTS = ["w1 w2", "w3"]


class Payload:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model directory, checkpoint-1 of a one-step FastGRPOTrainer run)."""
    tmp = tmp_path_factory.mktemp("trl_resume")
    model_dir = save_tiny_model(tmp / "model")
    trainer = _trainer(model_dir, tmp / "run", max_steps=1)
    trainer.train()
    checkpoint = tmp / "run" / "checkpoint-1"
    assert {"rng_state.pth", "optimizer.pt", "scheduler.pt", "model.safetensors"} <= set(os.listdir(checkpoint))
    return model_dir, checkpoint


def _trainer(model_dir, output_dir, max_steps):
    return build_tiny_grpo_trainer(model_dir, output_dir, [token_sum_reward()], PROMPTS, trainer_cls=FastGRPOTrainer,
                                   max_steps=max_steps, save_strategy="steps", save_steps=1)


def _copy(checkpoint, tmp_path):
    copy = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy


def test_the_payload_runs_when_unpickled_in_full(tmp_path):
    """The control: the planted object is a working payload, so a missing marker below means it did not run."""
    marker = tmp_path / "MARKER"
    torch.save({"x": Payload(marker)}, tmp_path / "file.pt")
    torch.load(tmp_path / "file.pt", weights_only=False)
    assert marker.exists()


def test_a_resume_reads_the_checkpoint_and_never_training_args_bin(saved, tmp_path):
    """The resume itself works (step 1 restored, step 2 trained), with a payload in training_args.bin, which a
    resume does not read."""
    model_dir, checkpoint = saved
    copy = _copy(checkpoint, tmp_path)
    marker = tmp_path / "MARKER"
    torch.save(Payload(marker), copy / "training_args.bin")
    trainer = _trainer(model_dir, tmp_path / "run", max_steps=2)
    trainer.train(resume_from_checkpoint=str(copy))
    assert trainer.state.global_step == 2 and not marker.exists()


@pytest.mark.parametrize("planted", ["rng_state.pth", "optimizer.pt", "scheduler.pt", "pytorch_model.bin"])
def test_a_payload_in_a_file_the_resume_reads_never_runs(saved, tmp_path, planted):
    model_dir, checkpoint = saved
    copy = _copy(checkpoint, tmp_path)
    marker = tmp_path / "MARKER"
    if planted == "pytorch_model.bin":  # the weights as a pickle (transformers prefers model.safetensors)
        (copy / "model.safetensors").unlink()
    torch.save({"state": Payload(marker)}, copy / planted)
    trainer = _trainer(model_dir, tmp_path / "run", max_steps=2)
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.system"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert not marker.exists()


def test_a_resume_under_deepspeed_is_refused_unless_trusted(saved, tmp_path, monkeypatch):
    """DeepSpeed's engine would unpickle its files in full: refused before TRL's train runs, unless trusted."""
    model_dir, checkpoint = saved
    calls = []
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, resume, *a, **k: calls.append(resume))
    trainer = _trainer(model_dir, tmp_path / "run", max_steps=2)
    trainer.is_deepspeed_enabled = True  # what accelerate sets under a DeepSpeed config (not installed here)
    with pytest.raises(ValueError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(info.value) == (
        f"FastGRPOTrainer.train(resume_from_checkpoint={str(checkpoint)!r}) under DeepSpeed: DeepSpeed's engine "
        "reads the checkpoint's global_step*/ files with torch.load(weights_only=False), which runs any code a file "
        "planted there holds; for a checkpoint you wrote or otherwise trust, set trainer.trust_deepspeed_checkpoints "
        "= True first")
    assert calls == []
    trainer.train()  # no resume: nothing to refuse
    trainer.trust_deepspeed_checkpoints = True
    trainer.train(resume_from_checkpoint=True)
    assert calls == [None, True]
