"""The GRPO training loop: rollout -> rewards -> group advantages -> (old, reference log-probs) -> mu updates.

Each piece is a small function; ``train`` composes them in one loop. The policy loss goes through ``grpo_loss`` on
the decoder's last hidden states and the lm_head weight, so no ``[rows, T, V]`` logits are ever built in training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_fast import fused_logprobs, group_advantages, grpo_loss
from grpo_fast.config import GRPOLossConfig
from grpo_fast.dispatch import resolve_impl
from grpo_fast.loss import micro_batch_scale
from grpo_fast.train.shared_prefix import enable as enable_shared_prefix
from grpo_fast.train.shared_prefix import shared_prefix_forward, token_counts, unsupported_reason
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train import distributed as dist_
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.data import PromptSampler, check_prompts, load_located_records, render_prompt
from grpo_fast.train.export import MODEL_DIR, base_model_path, full_state_dict, save_model
from grpo_fast.train.forward import completion_hidden, head_of, unwrap
from grpo_fast.train.metrics import MetricsLog, plot_metrics, read_steps
from grpo_fast.train.model import (
    attach_lora,
    autocast,
    check_head,
    frozen_copy,
    load_model_and_tokenizer,
    load_trained_state,
    make_optimizer,
    resolve_device,
    resolve_dtype,
    trained_state,
)
from grpo_fast.train.rewards import RewardError, compute_rewards, load_reward, reward_metrics, reward_name
from grpo_fast.train.rollout import Rollout, SamplingParams, concat_rollouts, generate
from grpo_fast.train.tasks import TASK_SIZE, builtin_records

logger = logging.getLogger("grpo_fast.train")

TINY_LR, MODEL_LR = 5e-4, 1e-6
SHARED_PREFIX_MIN_SAVING = 1.3  # auto mode shares the prompt when it cuts the tokens through the model this much


# ------------------------------------------------------------------------------------------------ set-up


@dataclass
class Run:
    """Everything the loop mutates, and what a checkpoint saves."""

    config: TrainConfig
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    reward_funcs: list
    reward_weights: torch.Tensor
    loss_config: GRPOLossConfig
    eval_records: list[dict]
    device: torch.device
    dtype: torch.dtype  # the compute dtype (autocast); trained parameters stay float32
    world: dist_.World = dist_.World()
    policy: torch.nn.Module | None = None  # what every pass calls: PolicyForward(model), under DDP/FSDP2 if distributed
    ref_policy: torch.nn.Module | None = None
    shared_prefix_ok: bool = False  # the model and options allow the shared-prefix forward
    shared_prefix_active: bool = False  # this step's training forwards use it
    step: int = 0
    skipped_updates: int = 0


def load_datasets(config: TrainConfig, tokenizer=None) -> tuple[list[dict], list[dict]]:
    """The training and held-out records; with a ``tokenizer``, every prompt of both is checked first
    (:func:`check_prompts`: none empty, none longer than ``max_prompt_length``), the error naming the record."""
    if config.dataset.startswith("builtin:"):
        name = config.dataset.split(":", 1)[1]
        train = [(f"{config.dataset}, record {i}", r) for i, r in enumerate(builtin_records(name, "train", TASK_SIZE))]
        evaluation = [(f"{config.dataset} (held-out), record {i}", r)
                      for i, r in enumerate(builtin_records(name, "eval", config.eval_size))]
        columns = list(train[0][1])
        if config.prompt_column not in columns:
            raise ValueError(f"TrainConfig.prompt_column: expected a column of {config.dataset}'s records "
                             f"({', '.join(map(repr, columns))}; the prompt is 'prompt'), got {config.prompt_column!r}")
    else:
        needs = ("answer",) if any(r in ("math", "exact") for r in config.rewards) else ()
        needs += ("tests",) if any(r == "code" for r in config.rewards) else ()
        train = load_located_records(config.dataset, prompt_column=config.prompt_column, required=needs)
        evaluation = []
        if config.eval_dataset:
            evaluation = load_located_records(config.eval_dataset, prompt_column=config.prompt_column,
                                              required=needs, limit=config.eval_size)
    if tokenizer is not None:
        check_prompts(train + evaluation, tokenizer, prompt_column=config.prompt_column,
                      max_prompt_length=config.max_prompt_length, system_prompt=config.system_prompt,
                      count_tokens=len if config.model == "tiny" else None)  # its tokenizer: one token a character
    return [r for _, r in train], [r for _, r in evaluation]


def lr_lambda(config: TrainConfig, total_updates: int):
    """The learning-rate factor of optimizer update ``update`` (counted from 0): transformers' schedules with warm-up
    (``get_{constant,linear,cosine}_schedule_with_warmup``, TRL's ``lr_scheduler_type``), so update ``k < warmup``
    uses ``k / warmup`` of the learning rate (the first update is made with lr 0) and update ``warmup`` the full
    one."""
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return update / warmup
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        if config.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def setup(config: TrainConfig) -> Run:
    device = dist_.local_device(resolve_device(config.device))
    dtype = resolve_dtype(config.dtype, device)
    try:  # before the model loads: --impl triton on a CPU is known at once
        impl = resolve_impl(config.impl, device, "grpo_loss", dtype)
    except RuntimeError as e:
        raise ValueError(f"TrainConfig.impl: {e}") from None
    world = dist_.init(config.distributed, device)
    if config.prompts_per_step % world.size:
        raise ValueError(f"TrainConfig.prompts_per_step must be a multiple of the {world.size} processes (each rank "
                         f"takes whole groups), got {config.prompts_per_step}")
    if world.strategy == "fsdp2" and config.load_in_4bit:
        raise ValueError("TrainConfig.load_in_4bit: a 4-bit base under FSDP2 is not supported (FSDP2 shards floating-"
                         "point parameters, not bitsandbytes' packed ones); a 4-bit base trains in one process or "
                         "under --distributed ddp")
    if world.strategy == "fsdp2" and config.optim not in ("adamw_torch", "adamw_torch_fused"):
        raise ValueError(f"TrainConfig.optim: {config.optim} under FSDP2 is not supported (bitsandbytes' optimizers "
                         "are not tested on its sharded DTensor parameters); use adamw_torch_fused or adamw_torch, "
                         f"or --distributed ddp; got optim={config.optim}")
    if world.strategy == "fsdp2" and config.lora_r:
        raise ValueError("TrainConfig.lora_r: LoRA under FSDP2 is not supported; use --distributed ddp (LoRA's "
                         f"adapters are small enough to replicate), got lora_r={config.lora_r}")
    threads = config.threads or (1 if config.model == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    ckpt.seed_rngs(config.seed)  # Python's, numpy's and torch's: a reward function may draw from any
    # full fine-tuning keeps float32 master weights; with LoRA the frozen base is stored in the compute dtype
    model, tokenizer = load_model_and_tokenizer(config, device, dtype if config.lora_r else torch.float32)
    check_head(model, len(tokenizer), device)
    ref_model = None
    if config.lora_r > 0:
        model = attach_lora(model, config)  # the reference is the base with the adapters disabled
    elif config.loss.beta != 0.0:
        ref_model = frozen_copy(model, dtype)
    shared_ok = shared_prefix_allowed(config, [m for m in (model, ref_model) if m is not None])
    policy = dist_.wrap(model, world, device)  # FSDP2 shards the parameters here: the optimizer comes after
    ref_policy = None if ref_model is None else dist_.wrap(ref_model, world, device, trainable=False)
    head = head_of(model)
    loss_config = dataclasses.replace(
        config.loss, temperature=config.temperature, softcap=head.softcap, max_completion_length=config.max_new_tokens
    )
    train_records, eval_records = load_datasets(config, tokenizer)
    reward_funcs = [load_reward(name) for name in config.rewards]
    weights = config.reward_weights or [1.0] * len(reward_funcs)  # TrainConfig checked the count
    lr = config.lr or (TINY_LR if config.model == "tiny" else MODEL_LR)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, config, lr, device, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, config.steps * config.mu))
    sampler = PromptSampler(train_records, config.prompts_per_step, seed=config.seed)
    # (under FSDP2 the DTensors' global sizes; a 4-bit weight by its unpacked shape)
    n_params = sum(getattr(getattr(p, "quant_state", None), "shape", p.shape).numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    logger.info(
        "model %s: %s, %.2fM parameters (%.2fM trained, float32 master weights%s; optimizer %s), compute %s on %s (%d "
        "CPU threads%s); fused-loss kernel path: %s; shared-prefix forward: %s; reference model: %s; rewards: %s; %d "
        "training prompts, %d held-out",
        config.model, type(unwrap(model)).__name__, n_params / 1e6, n_train / 1e6,
        f"; the base's linear layers in 4 bits ({config.bnb_4bit_quant_type})" if config.load_in_4bit else "",
        config.optim, dtype, device,
        torch.get_num_threads(), f"; {world.size} processes, {world.strategy}" if world.distributed else "",
        impl, ("off" if not shared_ok else "on" if config.shared_prefix == "on"
                                        else f"auto (when it saves >= {SHARED_PREFIX_MIN_SAVING}x tokens)"),
        "adapters disabled" if config.lora_r else ("frozen copy" if ref_model is not None else "none (beta=0)"),
        ", ".join(reward_name(f) for f in reward_funcs), len(train_records), len(eval_records),
    )
    return Run(config=config, model=model, ref_model=ref_model, tokenizer=tokenizer, optimizer=optimizer,
               scheduler=scheduler, sampler=sampler, reward_funcs=reward_funcs,
               reward_weights=torch.tensor(weights, dtype=torch.float32), loss_config=loss_config,
               eval_records=eval_records, device=device, dtype=dtype, world=world, policy=policy,
               ref_policy=ref_policy, shared_prefix_ok=shared_ok)


def shared_prefix_allowed(config: TrainConfig, models: list) -> bool:
    """Whether the training forwards may share each group's prompt; switches the models' attention to the wrapping
    implementation when they may. ``auto`` falls back with one warning, ``on`` raises, when they may not."""
    if config.shared_prefix == "off":
        return False
    reason = unsupported_reason(models[0])
    if reason is None and config.micro_batch_size % config.group_size:
        reason = (f"micro_batch_size {config.micro_batch_size} is not a multiple of group_size {config.group_size} "
                  f"(a micro-batch must hold whole groups)")
    if reason is not None:
        if config.shared_prefix == "on":
            raise ValueError(f"TrainConfig.shared_prefix is 'on' but {reason}")
        logger.warning("shared-prefix forward off: %s", reason)
        return False
    for model in models:
        enable_shared_prefix(model)
    return True


# ------------------------------------------------------------------------------------------------ the steps


def encode_prompts(run: Run, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [render_prompt(run.tokenizer, r[run.config.prompt_column], system_prompt=run.config.system_prompt)
             for r in records]
    enc = run.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    if enc.input_ids.shape[1] > run.config.max_prompt_length:
        longest = int(enc.attention_mask.sum(1).argmax())
        raise ValueError(
            f"TrainConfig.max_prompt_length: a prompt has {enc.input_ids.shape[1]} tokens, more than "
            f"{run.config.max_prompt_length}: {texts[longest][:80]!r}..."
        )
    return enc.input_ids.to(run.device), enc.attention_mask.to(run.device)


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (chat models often end turns with another
    token, e.g. Llama-3's <|eot_id|>)."""
    ids = [tokenizer.eos_token_id]
    generation_config = getattr(unwrap(model), "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return sorted({i for i in ids if i is not None})


def sampling_seed(seed: int, step: int, chunk_index: int) -> int:
    """The seed of the sampling RNG of prompt chunk ``chunk_index`` at step ``step`` (counted from 0) of a run
    seeded ``seed``."""
    return ((seed * 1_000_003 + step) * 1_000_033 + chunk_index) % (2**63)


def sampling_generator(run: Run, chunk_index: int) -> torch.Generator:
    """The sampling RNG of one prompt chunk: seeded by (seed, step, chunk), so a resumed run or a run on another
    number of processes samples the same completions for the same prompts."""
    return torch.Generator(device=run.device).manual_seed(sampling_seed(run.config.seed, run.step, chunk_index))


def rollout(run: Run, records: list[dict], group_size: int, params: SamplingParams,
            first_chunk: int = 0) -> tuple[Rollout, list[str]]:
    """Samples ``group_size`` completions per record, ``generation_prompts`` prompts at a time (their KV caches are
    what bounds generation memory); chunk ``i`` samples with ``sampling_generator(first_chunk + i)``."""
    if dist_.inner_model(run.policy) is not run.model:  # e.g. run.model replaced without its wrapper
        raise RuntimeError("Run.policy wraps another model than Run.model; replace both (distributed.wrap)")
    chunk = run.config.generation_prompts or len(records)
    eos = eos_token_ids(run.model, run.tokenizer)
    parts = []
    for i, start in enumerate(range(0, len(records), chunk)):
        prompt_ids, prompt_mask = encode_prompts(run, records[start : start + chunk])
        with torch.no_grad(), autocast(run.device, run.dtype):  # no_grad outside DDP's forward: no backward follows
            parts.append(run.policy(generate, prompt_ids, prompt_mask, group_size, params, eos_token_id=eos,
                                    pad_token_id=run.tokenizer.pad_token_id,
                                    generator=sampling_generator(run, first_chunk + i)))
    result = concat_rollouts(parts, run.tokenizer.pad_token_id)
    completions = run.tokenizer.batch_decode(result.completion_ids, skip_special_tokens=True)
    return result, completions


def score(run: Run, records: list[dict], completions: list[str], group_size: int) -> torch.Tensor:
    """``[N, K]`` rewards (NaN: not scored) for the ``N = len(records) * group_size`` completions.

    As in TRL, a completion of a conversational prompt (a list of messages) reaches the reward functions as
    ``[{"role": "assistant", "content": text}]``, a plain-text prompt's as the text.
    """
    rows = [r for r in records for _ in range(group_size)]
    prompt_column = run.config.prompt_column
    names = dict.fromkeys(k for r in records for k in r if k != prompt_column)  # rows may differ in columns
    columns = {k: [r.get(k) for r in rows] for k in names}
    prompts = [r[prompt_column] for r in rows]
    completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                   for p, c in zip(prompts, completions)]
    return compute_rewards(run.reward_funcs, prompts, completions, columns)


def micro_batches(rollout_: Rollout, size: int):
    """Row slices of at most ``size`` rows, each trimmed to its own longest prompt and completion."""
    for start in range(0, rollout_.completion_ids.shape[0], size):
        rows = slice(start, start + size)
        pm, cm = rollout_.prompt_mask[rows], rollout_.completion_mask[rows]
        p0 = int((pm.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        t1 = max(1, int(cm.sum(1).max()))
        yield rows, slice(p0, None), slice(0, t1)


def plan_shared_prefix(run: Run, ro: Rollout) -> dict:
    """Decide whether this step's training forwards share the prompts, from the tokens each option puts through the
    model (padded micro-batch shapes); log when the decision changes. Returns the step's token metrics."""
    cfg = run.config
    unshared = shared = 0
    for rows, pcols, tcols in micro_batches(ro, cfg.micro_batch_size):
        n = ro.completion_ids[rows].shape[0]
        P, T = ro.prompt_ids[rows, pcols].shape[1], ro.completion_ids[rows, tcols].shape[1]
        u = n * (P + T)
        # a micro-batch of part of a group (micro_batch_size < group_size) cannot share its prompt
        s = token_counts(P, T, n // cfg.group_size, cfg.group_size)[1] if n % cfg.group_size == 0 else u
        unshared, shared = unshared + u, shared + s
    unshared, shared = dist_.sum_across([unshared, shared], run.world, run.device)  # one decision on every rank
    saving = unshared / shared
    active = run.shared_prefix_ok and (cfg.shared_prefix == "on" or saving >= SHARED_PREFIX_MIN_SAVING)
    if active != run.shared_prefix_active or run.step == 0:
        logger.info("shared-prefix forward %s at step %d: %d tokens per training forward instead of %d (%.2fx%s)",
                    "on" if active else "off", run.step + 1, int(shared if active else unshared), int(unshared), saving,
                    "" if run.shared_prefix_ok else "; shared_prefix=off" if cfg.shared_prefix == "off"
                    else "; not possible for this model or options")
    run.shared_prefix_active = active
    return {"forward_tokens": float(shared if active else unshared), "prefix_saving": saving if active else 1.0}


def hidden_and_head(run: Run, model, ro: Rollout, rows, pcols, tcols):
    """The micro-batch's completion hidden states and the lm_head, both in the compute dtype (the weight's cast is
    differentiable: its gradient reaches the float32 master weight)."""
    args = (ro.prompt_ids[rows, pcols], ro.prompt_mask[rows, pcols], ro.completion_ids[rows, tcols],
            ro.completion_mask[rows, tcols])
    with autocast(run.device, run.dtype):
        if run.shared_prefix_active:  # micro-batches hold whole groups: one prompt row per group
            G = run.config.group_size
            hidden = shared_prefix_forward(model, args[0][::G], args[1][::G], *args[2:], group_size=G)
        else:
            hidden = completion_hidden(model, *args)
    head = head_of(model)
    bias = None if head.bias is None else head.bias.to(run.dtype)
    return hidden.to(run.dtype), head.weight.to(run.dtype), bias, head.softcap


def _micro_batch_logprobs(model, run: Run, ro: Rollout, rows, pcols, tcols) -> torch.Tensor | None:
    hidden, weight, bias, softcap = hidden_and_head(run, model, ro, rows, pcols, tcols)
    if not torch.isfinite(hidden).all():
        return None
    return fused_logprobs(hidden, weight, ro.completion_ids[rows, tcols], bias=bias,
                          temperature=run.config.temperature, softcap=softcap, impl=run.config.impl).float()


@torch.no_grad()
def logprobs_of(run: Run, policy, ro: Rollout) -> torch.Tensor | None:
    """Per-token log-probs ``[N, T]`` of the sampled completions under ``policy`` (old or reference); None when
    the hidden states are not finite on any rank (every rank then skips the step)."""
    out = torch.zeros(ro.completion_ids.shape, dtype=torch.float32, device=run.device)
    finite = True
    for rows, pcols, tcols in micro_batches(ro, run.config.micro_batch_size):
        # every micro-batch runs even after a non-finite one: under FSDP2 all ranks must make the same forwards
        logps = policy(_micro_batch_logprobs, run, ro, rows, pcols, tcols)
        if logps is None:
            finite = False
        else:
            out[rows, tcols] = logps
    return out if dist_.all_true(finite, run.world, run.device) else None


def reference_logprobs(run: Run, ro: Rollout) -> torch.Tensor | None:
    if run.ref_policy is not None:
        return logprobs_of(run, run.ref_policy, ro)
    with run.model.disable_adapter():
        return logprobs_of(run, run.policy, ro)


def token_mean_weight(token_mean: str, tokens: float, total_tokens: float, micro_batches: int) -> float:
    """The weight of one micro-batch's token mean in the generation's: ``1 / micro_batches`` with
    ``token_mean="micro_batch"`` (TRL's: the micro-batches' token means averaged), its share of the generation's
    tokens with ``"generation"`` (the token mean of the whole generation)."""
    return 1.0 / micro_batches if token_mean == "micro_batch" else tokens / max(total_tokens, 1.0)


def micro_batch_config(config: GRPOLossConfig, weight: float, token_weight: float) -> GRPOLossConfig:
    """The entropy bonus is a token mean whatever the loss type: its coefficient is rescaled so that after the
    micro-batch weight it counts with ``token_weight`` (:func:`token_mean_weight`)."""
    if config.entropy_coef == 0.0:
        return config
    return dataclasses.replace(config, entropy_coef=config.entropy_coef * token_weight / weight)


def _micro_batch_loss(model, run: Run, ro: Rollout, rows, pcols, tcols, advantages, old_logps, ref_logps,
                      total_rows: float, total_tokens: float, micro_batches: int):
    """The micro-batch's weighted share of the generation's loss and its ``LossOutput``; runs inside the policy's
    forward. Non-finite hidden states give a NaN loss that reaches every weight (and no output), so the gradients
    turn non-finite on every rank together and all of them skip the update."""
    hidden, weight, bias, _ = hidden_and_head(run, model, ro, rows, pcols, tcols)
    if not torch.isfinite(hidden).all():
        return (hidden.float().sum() + weight.float().sum()) * float("nan"), None, 0.0
    mask = ro.completion_mask[rows, tcols]
    tokens = float(mask.sum())
    share = tokens / max(total_tokens, 1.0)  # the micro-batch's share of the generation's tokens (metrics)
    token_weight = token_mean_weight(run.config.token_mean, tokens, total_tokens, micro_batches)
    scale = micro_batch_scale(run.loss_config.loss_type, hidden.shape[0] / total_rows, token_weight)
    out = grpo_loss(
        hidden, weight, ro.completion_ids[rows, tcols], advantages[rows], mask,
        old_logps=None if old_logps is None else old_logps[rows, tcols],
        ref_logps=None if ref_logps is None else ref_logps[rows, tcols],
        num_items_in_batch=total_tokens, bias=bias, impl=run.config.impl,
        config=micro_batch_config(run.loss_config, scale, token_weight),
    )
    return out.loss * scale, out, share


def policy_update(run: Run, ro: Rollout, advantages, old_logps, ref_logps) -> dict:
    """One optimizer update over the whole generation (gradient accumulation over micro-batches; in a distributed
    run over every rank's micro-batches, the gradients reduced on the last one).

    A non-finite hidden state, loss or gradient norm skips the update: the gradients are dropped, the weights, the
    optimizer state and the schedule are not touched, and the skip is counted. Metrics are token-weighted means over
    the generation (the loss: the accumulated total); a skipped update reports only its NaN gradient norm.
    """
    cfg, world = run.config, run.world
    total_rows, total_tokens = dist_.sum_across(
        [float(ro.completion_ids.shape[0]), float(ro.completion_mask.sum())], world, run.device)
    run.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    finite = True
    logp_gap = 0.0
    batches = list(micro_batches(ro, cfg.micro_batch_size))
    for i, (rows, pcols, tcols) in enumerate(batches):
        with dist_.gradient_sync(run.policy, sync=i == len(batches) - 1):
            loss, out, share = run.policy(_micro_batch_loss, run, ro, rows, pcols, tcols, advantages, old_logps,
                                          ref_logps, total_rows, total_tokens, len(batches) * world.size)
            # every rank's loss is its part of the global loss; DDP and FSDP2 average gradients over the ranks
            (loss * world.size).backward()
        if out is None or not torch.isfinite(loss):
            finite = False
            continue
        _accumulate(sums, "loss", float(loss.detach()))
        for name in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
            value = getattr(out, name)
            if value is not None:
                _accumulate(sums, name, float(value) * share)
        mask = ro.completion_mask[rows, tcols]
        logp_gap += float(((out.per_token_logps - ro.sampling_logps[rows, tcols]).abs() * mask).sum())
    grad_norm = float("nan")
    if dist_.all_true(finite, world, run.device):
        params = [p for p in run.model.parameters() if p.grad is not None]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = dist_.grad_norm(params, max_norm)
    if not math.isfinite(grad_norm):  # like transformers' Trainer, a skipped update does not advance the schedule
        run.optimizer.zero_grad(set_to_none=True)
        _count_skip(run, "non-finite loss or gradient")
        return {"grad_norm": float("nan")}
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)  # the gradients are not kept through the next rollout
    run.scheduler.step()
    names = sorted(sums)
    sums = dict(zip(names, dist_.sum_across([sums[k] for k in names], world, run.device)))
    sums["grad_norm"] = grad_norm
    if old_logps is None:
        gap, = dist_.sum_across([logp_gap], world, run.device)
        sums["sampling_logp_gap"] = gap / max(total_tokens, 1.0)
    return sums


def weighted_reward(run: Run, rewards: torch.Tensor) -> torch.Tensor:
    """``[N]``: each completion's weighted sum over the reward functions (unscored ones count 0)."""
    return torch.nansum(rewards * run.reward_weights, dim=1)


def _count_skip(run: Run, why: str) -> None:
    run.skipped_updates += 1
    logger.warning("step %d: %s; update skipped (%d so far), weights untouched", run.step + 1, why,
                   run.skipped_updates)


def _accumulate(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


@torch.no_grad()
def evaluate(run: Run, samples: int = 1, params: SamplingParams | None = None,
             scores: list[torch.Tensor] | None = None) -> float | None:
    """Mean weighted reward of the held-out prompts' completions (None without any prompts, or when no reward
    function scored any of them: every one returned None): one greedy completion per prompt by default (the run's
    before/after evaluation), or ``samples`` completions per prompt drawn with ``params``. ``scores``, when given,
    receives one ``[samples]`` tensor of weighted rewards per prompt this rank scored, in order, NaN for a completion
    no function scored (``grpo-fast eval``'s pass@k)."""
    if not run.eval_records:
        return None
    params = params or SamplingParams(max_new_tokens=run.config.max_new_tokens, temperature=0.0)
    world = run.world
    mine = run.eval_records[world.rank :: world.size]  # greedy: any split gives the same completions
    total, scored = 0.0, 0
    chunk = max(1, run.config.micro_batch_size // samples)  # prompts per generation call
    # every rank makes the same number of generation calls (FSDP2 gathers weights in each); surplus calls are empty
    calls = math.ceil(math.ceil(len(run.eval_records) / world.size) / chunk)
    for i in range(calls):
        part = mine[i * chunk : (i + 1) * chunk]
        # a surplus call generates, unscored; sampling seeds differ per call and rank
        _, completions = rollout(run, part or run.eval_records[:1], samples, params,
                                 first_chunk=world.rank * calls + i)
        if part:
            per_function = score(run, part, completions, samples)
            rewards = weighted_reward(run, per_function)
            total += float(rewards.sum())
            unscored = per_function.isnan().all(dim=1)  # every function returned None
            scored += int((~unscored).sum())
            if scores is not None:
                scores.extend(rewards.masked_fill(unscored, math.nan).view(len(part), samples))
    total, scored = dist_.sum_across([total, float(scored)], world, run.device)
    if not scored:
        logger.warning("held-out evaluation: no reward function scored any of the %d completions (all returned None)",
                       len(run.eval_records) * samples)
        return None
    return total / (len(run.eval_records) * samples)


def train_step(run: Run) -> dict:
    """One generation and its ``mu`` policy updates; returns the step's metrics."""
    cfg = run.config
    t0 = time.perf_counter()
    lr = run.scheduler.get_last_lr()[0]
    world = run.world
    records = dist_.shard(run.sampler.next_batch(), world)  # whole groups per rank
    params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    chunk = cfg.generation_prompts or len(records)
    ro, completions = rollout(run, records, cfg.group_size, params,
                              first_chunk=world.rank * math.ceil(len(records) / chunk))
    t_gen = time.perf_counter() - t0
    token_metrics = plan_shared_prefix(run, ro)
    # advantages and reward metrics on the global batch (batch scaling needs it), identical on every rank
    rewards = dist_.gather_rows(score(run, records, completions, cfg.group_size).to(run.device), world)
    adv = group_advantages(rewards, group_size=cfg.group_size, scale=cfg.scale_rewards,
                           reward_weights=run.reward_weights.to(run.device))
    n_local = ro.completion_ids.shape[0]
    advantages = adv.advantages[world.rank * n_local : (world.rank + 1) * n_local]
    old_logps = logprobs_of(run, run.policy, ro) if cfg.mu > 1 else None
    ref_logps = reference_logprobs(run, ro) if run.loss_config.beta != 0.0 else None
    sums: dict[str, float] = {}
    if (cfg.mu > 1 and old_logps is None) or (run.loss_config.beta != 0.0 and ref_logps is None):
        _count_skip(run, "non-finite hidden states in the old or reference pass")
    else:
        for _ in range(cfg.mu):
            for k, v in policy_update(run, ro, advantages, old_logps, ref_logps).items():
                _accumulate(sums, k, v / cfg.mu)
    run.step += 1
    combined = weighted_reward(run, rewards.cpu())
    length_sum, rows = dist_.sum_across([float(ro.completion_lengths.sum()), float(n_local)], world, run.device)
    return {
        "step": run.step,
        "reward": float(combined.mean()),
        "reward_std": float(combined.view(-1, cfg.group_size).std(dim=1).mean()),  # TRL's: mean of group stds
        **{f"rewards/{reward_name(f)}": float(torch.nanmean(rewards[:, k])) for k, f in enumerate(run.reward_funcs)},
        **reward_metrics(run.reward_funcs),
        "frac_zero_std": float(adv.zero_std.float().mean()),
        "completion_length": length_sum / rows,
        "lr": lr,
        **sums,
        **token_metrics,
        "skipped_updates": run.skipped_updates,
        "time_generate_s": t_gen,
        "time_step_s": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------------ the loop


def save_checkpoint(run: Run, directory: Path) -> Path:
    """Model, optimizer, schedule, sampler position, RNG states and step; a directory of shards under FSDP2, one
    file otherwise (written by rank 0: DDP replicas are identical, which this checks first)."""
    world = run.world
    trainer_state = {
        "step": run.step,
        "skipped_updates": run.skipped_updates,
        "scheduler": run.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "rng": ckpt.rng_state(),
        "config": run.config.to_dict(),
    }
    sharded = world.strategy == "fsdp2"
    path = ckpt.checkpoint_path(directory, run.step, sharded=sharded)
    if sharded:
        ckpt.save_sharded(run.model, run.optimizer, trainer_state, path, world.is_main, lambda: dist_.barrier(world))
    else:
        dist_.check_replicas(run.model, world)
        if world.is_main:
            ckpt.save_atomic({**trainer_state, "model": trained_state(run.model, run.config),
                              "optimizer": run.optimizer.state_dict()}, path)
    if world.is_main:
        ckpt.prune(directory, run.config.keep_checkpoints)
    dist_.barrier(world)
    return path


# options a resumed run may change; any other difference from the checkpoint's config is refused
RESUMABLE_CHANGES = {"steps", "output_dir", "progress", "plot", "save_every", "keep_checkpoints", "resume",
                     "overwrite", "log_every", "threads", "eval_size", "eval_dataset", "impl",
                     "shared_prefix", "merge_lora"}


def load_checkpoint(run: Run, directory: Path) -> bool:
    """Restores the newest intact checkpoint in ``directory`` (False: there is none). A damaged newer one is named
    in a warning, skipped, and renamed ``*.damaged`` once the older one has loaded. A checkpoint refused as unsafe
    (its pickle needs more than tensors and plain values: planted, or of an older format) is not skipped: the resume
    stops there with its name, unread. Nothing in ``directory`` is touched before every check has passed: a
    checkpoint of other options, or one past ``--steps``, is refused."""
    world = run.world
    found = ckpt.list_checkpoints(directory)
    if not found:
        if world.is_main and ckpt.remove_stale_temporaries(directory):  # a save killed before any completed
            logger.warning("removed the partial checkpoint left by an interrupted save")
        logger.info("resume: no checkpoint in %s, starting from step 0", directory)
        return False
    damaged = []
    for step, path in reversed(found):
        try:
            state = ckpt.read_state(path)
            break
        except ckpt.DamagedCheckpoint as e:
            logger.warning("--resume: skipping a damaged checkpoint: %s", e)
            damaged.append((path, e))
        except ckpt.UnsafeCheckpoint as e:  # never run, never skipped for an older one: the user decides
            raise ValueError(f"--resume: {e}; nothing in {directory} was changed") from None
    else:
        reasons = "; ".join(str(e) for _, e in damaged)
        raise ValueError(f"--resume: every checkpoint in {directory} is damaged ({reasons}); restore one from a "
                         "copy, or start over with --overwrite")
    sharded = path.suffix == ".dcp"
    if sharded != (world.strategy == "fsdp2"):
        raise ValueError(f"--resume: {path} was written {'under' if sharded else 'without'} FSDP2; resume it "
                         f"{'under torchrun with --distributed fsdp2' if sharded else 'without FSDP2'}")
    saved, now = state["config"], run.config.to_dict()
    changed = sorted(k for k in now if k not in RESUMABLE_CHANGES and saved.get(k) != now[k])
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise ValueError(f"--resume: {path} was written by a run with other options ({diff}); resume with the same "
                         f"options (only {', '.join(sorted(RESUMABLE_CHANGES))} may change) or start a new run")
    if state["step"] > run.config.steps:
        raise ValueError(f"TrainConfig.steps: {path} is at step {state['step']}, past --steps {run.config.steps}; "
                         f"resume with --steps {state['step']} or more (nothing was changed)")
    try:
        if sharded:
            ckpt.load_sharded(run.model, run.optimizer, path)
        else:
            load_trained_state(run.model, state["model"], run.config)
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.sampler.load_state_dict(state["sampler"])
    except (RuntimeError, KeyError) as e:  # the same options, but another model or data behind the same names
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--resume: {path} does not fit this run ({type(e).__name__}: {reason})") from None
    ckpt.set_rng_state(state["rng"])
    run.step, run.skipped_updates = state["step"], state["skipped_updates"]
    dist_.barrier(world)  # every rank has read what it needs before rank 0 renames or removes anything
    if world.is_main:
        for broken, _ in damaged:
            logger.warning("--resume: renamed the damaged %s to %s", broken, ckpt.set_aside(broken))
        stale = ckpt.remove_stale_temporaries(directory)
        if stale:
            logger.warning("removed %d partial checkpoint(s) left by an interrupted save", len(stale))
    logger.info("resumed from %s (step %d)", path, step)
    return True


@dataclass
class Summary:
    steps: int
    eval_before: float | None
    eval_after: float | None
    skipped_updates: int
    output_dir: Path
    seconds: float

    def line(self) -> str:
        def fmt(x):
            return "n/a" if x is None else f"{x:.3f}"

        unscored = " (n/a: no held-out prompt was scored)" if None in (self.eval_before, self.eval_after) else ""
        return (f"grpo-fast: {self.steps} steps in {self.seconds:.0f} s; held-out reward {fmt(self.eval_before)} -> "
                f"{fmt(self.eval_after)}{unscored}; {self.skipped_updates} skipped updates; outputs in "
                f"{self.output_dir}")


@dataclass
class Prepared:
    """A run ready to train: set up, resumed if asked, its before-evaluation done and logged."""

    run: Run
    log: MetricsLog
    eval_before: float | None
    out_dir: Path
    started: float


def prepare(config: TrainConfig) -> Prepared:
    """Everything that can fail on the user's input (model, data, rewards, output directory, checkpoint), before
    the first step. Nothing is written before all of it has passed (the before-evaluation included), so a failed
    start leaves nothing that blocks the corrected rerun."""
    started = time.perf_counter()
    out_dir = Path(config.output_dir)
    ckpt_dir = out_dir / "checkpoints"
    _check_output_dir(config, out_dir, ckpt_dir)
    run = setup(config)
    main = run.world.is_main  # only rank 0 writes the metrics, the config and single-file checkpoints
    resumed = config.resume and load_checkpoint(run, ckpt_dir)
    eval_before = None if resumed else evaluate(run)
    resolved = config.to_dict()
    log = None
    if main:
        if config.overwrite and not config.resume:
            for _, path in ckpt.list_checkpoints(ckpt_dir):
                ckpt.remove(path)
        out_dir.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no empty directory behind
        (out_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        log = MetricsLog(out_dir / "metrics.jsonl", truncate_after=run.step if resumed else 0)
        if resumed:
            eval_before = log.header.get("eval_before")
        else:
            log.write_header({"eval_before": eval_before, "config": resolved})
    dist_.barrier(run.world)
    return Prepared(run, log, eval_before, out_dir, started)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`fit`. ``clean``: every rank finished its step and ``checkpoint`` holds it; otherwise the
    step in progress was abandoned and ``checkpoint`` is the newest one saved before it (None: none was)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None, clean: bool):
        super().__init__(message)
        self.step, self.checkpoint, self.clean = step, checkpoint, clean


class _StopOnInterrupt:
    """While active, the first SIGINT (Ctrl-C) only asks the loop to stop after the step in progress (which then
    saves a checkpoint); a second one raises KeyboardInterrupt at once. A SIGINT within ``same_press_s`` of the
    first counts as the same Ctrl-C: under torchrun every worker gets the terminal's SIGINT and then torchrun's own
    copy of it. Outside the main thread, where Python cannot take signals, it does nothing."""

    def __init__(self, same_press_s: float = 0.0):
        self.asked = False
        self.same_press_s = same_press_s
        self._first = 0.0
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame):
        if self.asked:
            if time.monotonic() - self._first < self.same_press_s:
                return
            raise KeyboardInterrupt
        self.asked, self._first = True, time.monotonic()
        logger.warning("Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again: stop now, losing the step)")

    def requested(self, run: Run) -> bool:
        """Whether any rank was asked to stop (every rank then stops at the same step)."""
        if not run.world.distributed:
            return self.asked
        return not dist_.all_true(not self.asked, run.world, run.device)


def fit(prepared: Prepared) -> Summary:
    """The loop: steps up to ``config.steps``, checkpoints, the after-evaluation and the plot.

    Ctrl-C finishes the step in progress, saves a checkpoint and raises :class:`TrainingInterrupted` (a
    KeyboardInterrupt); a second Ctrl-C abandons the step without saving it."""
    run, log, config = prepared.run, prepared.log, prepared.run.config
    ckpt_dir = prepared.out_dir / "checkpoints"
    main = run.world.is_main
    bar = _progress(config, run.step, enabled=main)
    try:
        with _StopOnInterrupt(same_press_s=5.0 if run.world.distributed else 0.0) as stop:
            while run.step < config.steps:
                before_step = run.sampler.state_dict(), ckpt.rng_state()  # what a failed step's checkpoint restores
                metrics = train_step(run)
                if main and (run.step % config.log_every == 0 or run.step == config.steps):
                    log.write(metrics)
                bar.set_postfix(_postfix(metrics), refresh=False)
                bar.update(1)
                if run.step < config.steps and stop.requested(run):
                    path = save_checkpoint(run, ckpt_dir)
                    raise TrainingInterrupted(f"stopped by Ctrl-C after step {run.step} of {config.steps}, saved in "
                                              f"{path}", run.step, path, clean=True)
                if config.save_every and run.step % config.save_every == 0 and run.step < config.steps:
                    save_checkpoint(run, ckpt_dir)
            path = save_checkpoint(run, ckpt_dir)
            if stop.requested(run):  # Ctrl-C in the last step: the run is saved whole, the evaluation not run
                raise TrainingInterrupted(f"stopped by Ctrl-C after the last step ({run.step}), saved in {path}; "
                                          "the after-evaluation was not run", run.step, path, clean=True)
    except TrainingInterrupted:
        raise
    except RewardError as e:  # before the step's update: the model and optimizer are those of the last step
        e.when = f"at step {run.step + 1}"
        e.checkpoint = _save_before_failed_step(run, ckpt_dir, *before_step)
        raise
    except KeyboardInterrupt:
        found = ckpt.list_checkpoints(ckpt_dir)  # (a save cut short left only a temporary, removed on resume)
        newest = found[-1][1] if found else None
        raise TrainingInterrupted(
            f"stopped at once by a second Ctrl-C after {run.step} of {config.steps} steps; "
            + (f"the newest checkpoint is {newest} (step {found[-1][0]}), later steps are lost" if newest
               else "no checkpoint was saved"),
            run.step, newest, clean=False) from None
    finally:
        bar.close()
    try:
        eval_after = evaluate(run)
    except KeyboardInterrupt:
        raise TrainingInterrupted(f"stopped by Ctrl-C in the after-evaluation; all {run.step} steps are saved in "
                                  f"{path}", run.step, path, clean=False) from None
    except RewardError as e:
        e.when, e.checkpoint = "in the evaluation after training", path
        raise
    save_trained_model(run, prepared.out_dir / MODEL_DIR)
    if main:
        log.write_footer({"eval_after": eval_after})
        if config.plot:
            plot_metrics(prepared.out_dir / "metrics.jsonl", prepared.out_dir / "reward_kl.png")
    return Summary(run.step, prepared.eval_before, eval_after, run.skipped_updates, prepared.out_dir,
                   time.perf_counter() - prepared.started)


def _save_before_failed_step(run: Run, ckpt_dir: Path, sampler_state: dict, rng_state: dict) -> Path | None:
    """The checkpoint ``--resume`` continues from after a step that failed before its update: the last completed
    step, with the sampler and RNG states from before the failed step (saved now unless a checkpoint of that step
    exists; None before any step). Under torchrun the other ranks may not have failed: nothing is saved, the newest
    checkpoint is named."""
    found = ckpt.list_checkpoints(ckpt_dir)
    if run.world.distributed or run.step == 0 or (found and found[-1][0] == run.step):
        return found[-1][1] if found else None
    run.sampler.load_state_dict(sampler_state)
    ckpt.set_rng_state(rng_state)
    return save_checkpoint(run, ckpt_dir)


def save_trained_model(run: Run, directory: Path) -> None:
    """The trained model as a ``save_pretrained`` directory (grpo_fast/train/export.py), written by rank 0; under
    FSDP2 every rank first joins the gathering of the full state dict. With ``merge_lora`` the adapters are merged
    into the model in place: call it last."""
    state = full_state_dict(run.model, run.world)
    if run.world.is_main:
        save_model(run.model, run.tokenizer, directory, merge_lora=run.config.merge_lora, state_dict=state,
                   base_model=base_model_path(run.config), max_new_tokens=run.config.max_new_tokens)
        logger.info("trained model written to %s", directory)
    dist_.barrier(run.world)


def train(config: TrainConfig) -> Summary:
    """Runs ``config.steps`` GRPO steps; returns the before/after evaluation. Metrics go to
    ``output_dir/metrics.jsonl``, checkpoints to ``output_dir/checkpoints``, the trained model to
    ``output_dir/model`` (``save_pretrained``)."""
    return fit(prepare(config))


def _check_output_dir(config: TrainConfig, out_dir: Path, ckpt_dir: Path) -> None:
    """The output directory takes files (it is not created: :func:`prepare` does that once every check has passed);
    a new run never silently overwrites an earlier run's metrics and checkpoints, and ``--resume`` needs a
    checkpoint to resume (as TRL's ``resume_from_checkpoint=True``). An earlier start that failed before its first
    step is no run."""
    for path in (out_dir, ckpt_dir):
        if path.exists() and not path.is_dir():
            raise ValueError(f"TrainConfig.output_dir: {path} is a file, expected a directory")
    ckpt.check_writable(out_dir, "TrainConfig.output_dir")
    metrics = out_dir / "metrics.jsonl"
    found = ckpt.list_checkpoints(ckpt_dir)
    earlier = found or (metrics.exists() and read_steps(metrics))
    if config.resume and not found:
        where = f"{out_dir} does not exist" if not out_dir.exists() else f"no checkpoint in {ckpt_dir}"
        instead = ("start over in it with --overwrite instead" if earlier
                   else "start the run without --resume")
        raise ValueError(f"--resume: nothing to resume ({where}); {instead}")
    if earlier and not (config.resume or config.overwrite):
        raise FileExistsError(
            f"TrainConfig.output_dir: {out_dir} already holds a run (metrics.jsonl or checkpoints); pass --resume to "
            "continue it, --overwrite to start over in it, or choose another --output-dir"
        )


def _progress(config: TrainConfig, initial: int, enabled: bool = True):
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, disable=not (config.progress and enabled), desc="grpo-fast",
                unit="step", dynamic_ncols=True)


def _postfix(m: dict) -> dict:
    keys = (("reward", "reward"), ("kl", "kl"), ("entropy", "ent"), ("clip_ratio_region", "clip"))
    return {short: f"{m[k]:.3f}" for k, short in keys if k in m}
