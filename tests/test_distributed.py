"""torchrun with 2 CPU processes (gloo): DDP and FSDP2 reach the parameters of one process on the same global batch.

Each run is the real command line (``torchrun -m grpo_fast train``). The one-process reference samples its prompts
in chunks of ``--generation-prompts 2``, which is what each of the 2 ranks holds, so both sample the same completions
(sampling seeds follow the step and the global chunk, not the rank). Each rank's micro-batch is then one of the
reference's micro-batches, and its loss is scaled by the world size before DDP/FSDP2 average the gradients: a
multiplication and a division by 2, both exact in floating point, so the parameters agree to the bit, not just
within a tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_helpers import REPO, save_local_model

from grpo_fast.train import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

STEPS = 3
ARGS = ["--prompts-per-step", "4", "--group-size", "4", "--micro-batch-size", "8", "--generation-prompts", "2",
        "--eval-size", "8", "--save-every", "0", "--progress", "false", "--plot", "false", "--mu", "2",
        "--loss.beta", "0.04", "--max-new-tokens", "3", "--rewards", "tests/train_helpers.py:starts_with_seven",
        # no clipping: FSDP2 sums the squares of the gradient norm in another order (last-bit differences in the
        # norm, compared below), which a clip would carry into every parameter
        "--max-grad-norm", "1000"]


def _train(out: Path, nproc: int = 1, *extra: str, expect_rc: int = 0) -> str:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "grpo_fast", "train", *ARGS, "--output-dir", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, output[-3000:]
    return output


def _parameters(out: Path, step: int) -> dict[str, torch.Tensor]:
    directory = out / "checkpoints"
    single = directory / f"checkpoint-{step:06d}.pt"
    if single.exists():
        return ckpt.read_state(single)["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(directory / f"checkpoint-{step:06d}.dcp", Path(tmp) / "full.pt")
        return ckpt.load(Path(tmp) / "full.pt")["model"]  # torch.save of the gathered state: plain values


def _saved_model(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def _steps(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "step" in line]


def _assert_same(got: dict, want: dict, start: dict | None = None) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if start is not None:  # the runs did train: the comparison is not between two untouched models
        assert max(float((want[n] - start[n]).abs().max()) for n in want) > 1e-4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    _train(out, 1, "--steps", str(STEPS), "--save-every", "1", "--keep-checkpoints", "0")
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_equal_one_process(tmp_path, one_process, strategy):
    out = tmp_path / strategy
    log = _train(out, 2, "--steps", str(STEPS), "--distributed", strategy)
    assert f"2 processes, {strategy}" in log
    if strategy == "ddp":
        assert "parameters identical on all 2 ranks" in log
    _assert_same(_parameters(out, STEPS), _parameters(one_process, STEPS), start=_parameters(one_process, 1))
    for got, want in zip(_steps(out), _steps(one_process), strict=True):  # metrics are global, not rank 0's
        for key in ("reward", "loss", "kl", "completion_length", "forward_tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), key
        # FSDP2 adds the float32 squares of each shard's gradients first, then the shards' sums: another order
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-12 if strategy == "ddp" else 1e-6)
    # the trained model leaves the run: FSDP2 gathers the full state dict on rank 0 for output_dir/model
    _assert_same(_saved_model(out / "model"), _saved_model(one_process / "model"))
    if strategy == "fsdp2":  # and grpo-fast export turns the sharded checkpoint into the same directory
        exported = tmp_path / "exported"
        subprocess.run([sys.executable, "-m", "grpo_fast", "export", str(out / "checkpoints" /
                        f"checkpoint-{STEPS:06d}.dcp"), str(exported)], cwd=REPO, check=True, capture_output=True)
        _assert_same(_saved_model(exported), _saved_model(one_process / "model"))


def test_fsdp2_untied_lm_head_equals_one_process(tmp_path):
    model = save_local_model(tmp_path / "model", "llama", None)  # lm_head separate from the embeddings
    # one held-out prompt: rank 1 has none to evaluate, yet must join rank 0's generation forwards
    options = ("--steps", "2", "--model", model, "--lr", "5e-4", "--eval-size", "1")
    _train(tmp_path / "one", 1, *options)
    _train(tmp_path / "two", 2, *options, "--distributed", "fsdp2")
    _assert_same(_parameters(tmp_path / "two", 2), _parameters(tmp_path / "one", 2))


def test_ddp_with_lora_equals_one_process(tmp_path):
    pytest.importorskip("peft")
    lora = ("--steps", "2", "--lora-r", "4", "--lora-target-modules", "q_proj,v_proj")  # reference: adapters off
    _train(tmp_path / "one", 1, *lora)
    _train(tmp_path / "two", 2, *lora, "--distributed", "ddp")
    _assert_same(_parameters(tmp_path / "two", 2), _parameters(tmp_path / "one", 2))


def test_fsdp2_checkpoint_resumes_to_the_same_parameters(tmp_path, one_process):
    out = tmp_path / "run"
    _train(out, 2, "--steps", "2", "--distributed", "fsdp2")
    assert (out / "checkpoints" / "checkpoint-000002.dcp" / "trainer_state.pt").exists()
    log = _train(out, 2, "--steps", str(STEPS), "--distributed", "fsdp2", "--resume")
    assert "resumed from" in log and "(step 2)" in log
    _assert_same(_parameters(out, STEPS), _parameters(one_process, STEPS))
    assert [s["step"] for s in _steps(out)] == [1, 2, 3]


def test_prompts_that_do_not_split_evenly_are_refused(tmp_path):
    # each rank exits with 2 (bad input; the flag named, since it came from the command line) and torchrun reports
    # the failure with its own exit code 1
    log = _train(tmp_path / "run", 2, "--steps", "1", "--prompts-per-step", "3", expect_rc=1)
    assert "exitcode  : 2" in log
    assert "--prompts-per-step must be a multiple of the 2 processes" in log
