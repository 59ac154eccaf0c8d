"""``grpo-fast train --rollout vllm`` on this CPU: the engine's weights follow every optimizer update exactly (full
fine-tune with a tied head, an untied head, LoRA), a skipped sync is caught, TRL's off-policy correction reaches the
loss, and a resumed run reproduces the uninterrupted one."""

import json

import pytest
import torch

pytest.importorskip("vllm")

from train_helpers import small_config  # noqa: E402

from grpo_fast.train import trainer as trainer_module  # noqa: E402
from grpo_fast.train import train  # noqa: E402
from grpo_fast.train.lifecycle import prepare  # noqa: E402
from grpo_fast.train.metrics import read_steps  # noqa: E402
from grpo_fast.train.vllm_engine import VLLMEngine  # noqa: E402

# a sync leaves vLLM's fp32 log-probs within a few float32 ulps of the trainer's; a missed one moves them by far more
IN_SYNC = 2e-5


def _vllm_config(tmp_path, **overrides):
    # lr 5e-2: every update moves the weights far enough that a stale engine shows
    values = {"rollout": "vllm", "steps": 4, "lr": "5e-2", **overrides}
    return small_config(tmp_path, **values)


def _gaps(config) -> list[float]:
    """Per step: the largest |trainer's old log-prob - vLLM's sampling log-prob| over the sampled tokens."""
    prepared = prepare(config)
    run = prepared.run
    gaps = []
    try:
        for _ in range(config.steps):
            gaps.append(trainer_module.train_step(run)["sampling/sampling_logp_difference/max"])
    finally:
        run.engine.close()
    return gaps


def _untied_model(directory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_fast.train.tasks import tiny_tokenizer

    tok = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("variant", ["tied", "untied", "lora"])
def test_engine_follows_every_update(tmp_path, variant):
    overrides = {"untied": {"model": _untied_model(tmp_path / "untied"), "lr": "5e-2"},
                 "lora": {"lora_r": "4", "lr": "2e-1"}}.get(variant, {})
    gaps = _gaps(_vllm_config(tmp_path, **overrides))
    assert max(gaps) < IN_SYNC, gaps


def test_a_skipped_sync_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(VLLMEngine, "update_weights", lambda self, model: None)
    gaps = _gaps(_vllm_config(tmp_path))
    assert gaps[0] < IN_SYNC  # built from the initial weights
    assert min(gaps[1:]) > 100 * IN_SYNC, gaps  # every later step samples from stale weights


def test_correction_reaches_the_loss(tmp_path, monkeypatch):
    """The ratio the trainer computes is the one grpo_loss gets, sliced per micro-batch (rows and columns)."""
    seen, computed = [], []
    real, real_correction = trainer_module.grpo_loss, trainer_module.run_correction

    def recording(*args, **kwargs):
        seen.append(kwargs["sampling_ratio"])
        return real(*args, **kwargs)

    def recorded_correction(run, ro, old_logps):
        ratio, metrics = real_correction(run, ro, old_logps)
        # a ratio that is not all ones, so that a slice of the wrong rows or columns shows
        ratio = ratio * torch.linspace(0.5, 1.5, ratio.numel()).view_as(ratio)
        computed.append(ratio)
        return ratio, metrics

    monkeypatch.setattr(trainer_module, "grpo_loss", recording)
    monkeypatch.setattr(trainer_module, "run_correction", recorded_correction)
    config = _vllm_config(tmp_path, steps=1, vllm_importance_sampling_mode="token_truncate",
                          micro_batch_size=4)
    prepared = prepare(config)
    metrics = trainer_module.train_step(prepared.run)
    prepared.run.engine.close()
    assert len(seen) == 4 and all(r is not None and r.shape[0] == 4 for r in seen)
    whole = computed[0]
    for i, r in enumerate(seen):  # micro-batch i: rows 4i..4i+3, its own leading columns
        torch.testing.assert_close(r, whole[4 * i : 4 * i + 4, : r.shape[1]], rtol=0, atol=0)
    assert metrics["sampling/importance_sampling_ratio/min"] > 0.99
    off = _vllm_config(tmp_path / "off", steps=1, vllm_importance_sampling_correction="false", micro_batch_size=4)
    seen.clear()
    prepared = prepare(off)
    metrics = trainer_module.train_step(prepared.run)
    prepared.run.engine.close()
    assert all(r is None for r in seen) and "sampling/importance_sampling_ratio/min" not in metrics


def test_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    whole = _vllm_config(tmp_path / "whole", steps=4)
    train(whole)
    first = _vllm_config(tmp_path / "split", steps=2, save_every=2)
    train(first)
    train(_vllm_config(tmp_path / "split", steps=4, resume="true"))
    keys = ("reward", "loss", "grad_norm", "sampling/sampling_logp_difference/max")
    a = read_steps(tmp_path / "whole" / "run" / "metrics.jsonl")
    b = read_steps(tmp_path / "split" / "run" / "metrics.jsonl")
    assert [s["step"] for s in b] == [1, 2, 3, 4]
    assert [[s[k] for k in keys] for s in a] == [[s[k] for k in keys] for s in b]
    header = json.loads((tmp_path / "whole" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["rollout"] == "vllm"
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "whole" / "run" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "split" / "run" / "model" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


DIST_ARGS = ["--rollout", "vllm", "--steps", "3", "--prompts-per-step", "4", "--group-size", "4",
             "--micro-batch-size", "8", "--generation-prompts", "2", "--eval-size", "8", "--save-every", "0",
             "--progress", "false", "--plot", "false", "--lr", "5e-2"]


def _cli_train(out, nproc: int, *extra: str) -> dict:
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file
    from train_helpers import REPO

    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    proc = subprocess.run([*launcher, "-m", "grpo_fast", "train", *DIST_ARGS, "--output-dir", str(out), *extra],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # vLLM's shutdown must not trip over the group
    return load_file(out / "model" / "model.safetensors")


@pytest.mark.slow
def test_two_processes_with_vllm_equal_one_process(tmp_path):
    """torchrun, 2 CPU processes (gloo), each with its own engine: DDP and FSDP2 (full tensors gathered for the push)
    train the same weights as one process, to the bit (each rank samples its prompt chunk with that chunk's seed)."""
    one = _cli_train(tmp_path / "one", 1)
    for strategy in ("ddp", "fsdp2"):
        two = _cli_train(tmp_path / strategy, 2, "--distributed", strategy)
        assert all(torch.equal(one[k], two[k]) for k in one), strategy


def test_which_engine_runs(tmp_path):
    """auto: hf off CUDA and where the vllm engine cannot run; an explicit vllm that cannot run names why."""
    from grpo_fast.train.engines import resolve_rollout

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = small_config(tmp_path)
    assert resolve_rollout(config, cpu)[0] == "hf"
    assert resolve_rollout(config, cuda) == ("vllm", "auto: vllm on CUDA")
    assert resolve_rollout(config, cuda, world_size=2)[0] == "hf"
    assert resolve_rollout(_vllm_config(tmp_path), cpu) == ("vllm", "asked for")
    with pytest.raises(ValueError, match="rollout: 'vllm' is not supported under torchrun on GPUs"):
        resolve_rollout(_vllm_config(tmp_path), cuda, world_size=2)
    tp = _vllm_config(tmp_path, vllm_tensor_parallel_size="2")
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2"):
        resolve_rollout(tp, cpu)
    vespo = _vllm_config(tmp_path, **{"loss.loss_type": "vespo"})
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode: vespo .* token_truncate or token_mask"):
        prepare(vespo)


def test_a_tool_run_on_vllm_follows_every_update(tmp_path):
    """The calc task with its tool on the vllm engine: multi-turn rows (token in, token out, the tool's tokens fed
    between turns), the engine in sync after every update on the model's tokens, the tool's masked out of the gap."""
    config = _vllm_config(tmp_path, dataset="builtin:calc", tools="calc", rewards="last_number", max_new_tokens=24,
                          sft_warmup_steps=40, prompts_per_step=4, group_size=8, micro_batch_size=16, eval_size=16,
                          lr="5e-3", steps=3)
    prepared = prepare(config)
    run = prepared.run
    try:
        steps = [trainer_module.train_step(run) for _ in range(config.steps)]
    finally:
        run.engine.close()
    for m in steps:
        assert m["tools/call_frequency"] > 0.5, m
        assert m["sampling/sampling_logp_difference/max"] < IN_SYNC, m
