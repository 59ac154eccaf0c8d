"""The GRPO training step: rollout -> rewards -> group advantages -> (old, reference log-probs) -> mu updates.

Each piece is a small function; ``train_step`` composes them, and ``grpo_fast.train.lifecycle`` runs the steps in one
loop (with the checks before it, checkpoints, Ctrl-C and the evaluations). The policy loss goes through ``grpo_loss``
on the decoder's last hidden states and the lm_head weight, so no ``[rows, T, V]`` logits are ever built in training.
``setup``, at the end, builds the ``Run`` the steps share.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from grpo_fast.agents import Agent

from grpo_fast import fused_logprobs, group_advantages, grpo_loss
from grpo_fast.config import GRPOLossConfig
from grpo_fast.dispatch import resolve_impl
from grpo_fast.loss import micro_batch_scale, token_mean_weight
from grpo_fast.train.shared_prefix import enable as enable_shared_prefix
from grpo_fast.train.shared_prefix import shared_prefix_forward, token_counts, unsupported_reason
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train import distributed as dist_
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.data import (PromptSampler, check_prompts, check_record_file, load_located_records,
                                  unknown_characters)
from grpo_fast.train.engines import engine_of, resolve_rollout
from grpo_fast.train.forward import completion_hidden, head_of, unwrap
from grpo_fast.train.model import (attach_lora, autocast, check_context, check_head, context_length, frozen_copy,
                                   load_model_and_tokenizer, lr_scheduler, make_optimizer, resolve_device,
                                   resolve_dtype, saved_model_config, tokenizer_of)
from grpo_fast.train.agentic import build_agent, reward_sources, tool_schemas, warm_up
from grpo_fast.train.rewards import load_reward, reward_metrics, reward_name, score, weighted_reward
from grpo_fast.train.rollout import Rollout, SamplingParams, eos_token_ids, rollout
from grpo_fast.train.sampling_correction import run_correction
from grpo_fast.train.tasks import TASK_SIZE, TASKS, builtin_records

logger = logging.getLogger("grpo_fast.train")

TINY_LR, MODEL_LR = 5e-4, 1e-6
SHARED_PREFIX_MIN_SAVING = 1.3  # auto mode shares the prompt when it cuts the tokens through the model this much


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
    engine: object | None = None  # the rollout engine (rollout.engine_of), built at the first generation
    agent: Agent | None = None  # the run's tools and environment (--tools, --environment), None without
    context: int | None = None  # the model's positions, which a multi-turn row must fit
    sample: Sample | None = None  # the last step's completions when it logs them (--log-completions-every), rank 0


@dataclass
class Sample:
    """A step's completions as ``--log-completions-every`` logs them: this rank's prompts (as the reward functions
    saw them) and completions, group by group; each reward function's scores ``[n, F]`` (NaN: unscored), their
    weighted total ``[n]`` and the advantages ``[n]``."""

    prompts: list
    completions: list
    rewards: torch.Tensor
    total: torch.Tensor
    advantages: torch.Tensor


# ------------------------------------------------------------------------------------------------ the step


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
                              first_chunk=world.rank * math.ceil(len(records) / chunk), engine=engine_of(run))
    t_gen = time.perf_counter() - t0
    run.engine.sleep()  # vllm with sleep mode: its memory is the policy update's until the next generation
    token_metrics = plan_shared_prefix(run, ro)
    # advantages and reward metrics on the global batch (batch scaling needs it), identical on every rank
    # with tools: the prompts as the environments' reset() extended them, and the environments themselves
    scored, environments = (ro.trace.records, ro.trace.environments) if ro.trace is not None else (records, None)
    rewards = dist_.gather_rows(score(run, scored, completions, cfg.group_size, environments).to(run.device), world)
    adv = group_advantages(rewards, group_size=cfg.group_size, scale=cfg.scale_rewards,
                           reward_weights=run.reward_weights.to(run.device))
    n_local = ro.completion_ids.shape[0]
    advantages = adv.advantages[world.rank * n_local : (world.rank + 1) * n_local]
    correct = run.engine.name == "vllm" and cfg.vllm_importance_sampling_correction  # TRL's off-policy correction
    old_logps = logprobs_of(run, run.policy, ro) if cfg.mu > 1 or correct else None
    ref_logps = reference_logprobs(run, ro) if run.loss_config.beta != 0.0 else None
    ratio, sums = None, {}
    if ((cfg.mu > 1 or correct) and old_logps is None) or (run.loss_config.beta != 0.0 and ref_logps is None):
        _count_skip(run, "non-finite hidden states or log-probs in the old or reference pass")
    else:
        if correct:
            ratio, sampling_metrics = run_correction(run, ro, old_logps)
            sums.update(sampling_metrics)
        for _ in range(cfg.mu):
            for k, v in policy_update(run, ro, advantages, old_logps, ref_logps, ratio).items():
                _accumulate(sums, k, v / cfg.mu)
    run.step += 1
    combined = weighted_reward(run, rewards.cpu())
    run.sample = None
    if cfg.log_completions_every and run.step % cfg.log_completions_every == 0 and world.is_main:
        mine = slice(world.rank * n_local, (world.rank + 1) * n_local)
        run.sample = Sample([r[cfg.prompt_column] for r in scored for _ in range(cfg.group_size)], list(completions),
                            rewards[mine].cpu(), combined[mine], advantages.cpu())
    length_sum, rows = dist_.sum_across([float(ro.completion_lengths.sum()), float(n_local)], world, run.device)
    return {
        "step": run.step,
        "reward": float(combined.mean()),
        "reward_std": float(combined.view(-1, cfg.group_size).std(dim=1).mean()),  # TRL's: mean of group stds
        **{f"rewards/{reward_name(f)}": float(torch.nanmean(rewards[:, k])) for k, f in enumerate(run.reward_funcs)},
        **reward_metrics(run.reward_funcs),
        "frac_zero_std": float(adv.zero_std.float().mean()),
        "completion_length": length_sum / rows,
        **(ro.trace.metrics() if ro.trace is not None else {}),  # this rank's tool calls
        "lr": lr,
        **sums,
        **token_metrics,
        "skipped_updates": run.skipped_updates,
        "rollout/cached_prompt_tokens": float(run.engine.cached_prompt_tokens),
        "time_generate_s": t_gen,
        "time_sync_s": run.engine.last_sync_s,
        "time_step_s": time.perf_counter() - t0,
    }


def policy_update(run: Run, ro: Rollout, advantages, old_logps, ref_logps, sampling_ratio=None) -> dict:
    """One optimizer update over the whole generation (gradient accumulation over micro-batches; in a distributed
    run over every rank's micro-batches, the gradients reduced on the last one).

    A non-finite hidden state, loss or gradient norm skips the update: the gradients are dropped, the weights, the
    optimizer state and the schedule are not touched, and the skip is counted. Metrics are token-weighted means over
    the generation (the loss: the accumulated total); a skipped update reports only its NaN gradient norm.
    """
    cfg, world = run.config, run.world
    total_rows, total_tokens = dist_.sum_across(
        [float(ro.completion_ids.shape[0]), float(ro.trained_mask.sum())], world, run.device)
    run.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    finite = True
    logp_gap = 0.0
    batches = list(micro_batches(ro, cfg.micro_batch_size))
    for i, (rows, pcols, tcols) in enumerate(batches):
        with dist_.gradient_sync(run.policy, sync=i == len(batches) - 1):
            loss, out, share = run.policy(_micro_batch_loss, run, ro, rows, pcols, tcols, advantages, old_logps,
                                          ref_logps, sampling_ratio, total_rows, total_tokens,
                                          len(batches) * world.size)
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
        mask = ro.trained_mask[rows, tcols]
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


def _count_skip(run: Run, why: str) -> None:
    run.skipped_updates += 1
    if run.dtype == torch.float16:  # the likeliest cause there, which no check can name without a sync of its own
        why += " (float16: a logit or activation beyond +-65504 overflows; --dtype bfloat16 has float32's range)"
    logger.warning("step %d: %s; update skipped (%d so far), weights untouched", run.step + 1, why,
                   run.skipped_updates)


def _accumulate(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


# ------------------------------------------------------------------------------------------------ its pieces


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
    the hidden states, or the log-probs of trained tokens, are not finite on any rank (every rank then skips the
    step). Finite hidden states give non-finite log-probs when float16 logits overflow (beyond +-65504): one check
    of the whole output, one host sync per pass."""
    out = torch.zeros(ro.completion_ids.shape, dtype=torch.float32, device=run.device)
    finite = True
    for rows, pcols, tcols in micro_batches(ro, run.config.micro_batch_size):
        # every micro-batch runs even after a non-finite one: under FSDP2 all ranks must make the same forwards
        logps = policy(_micro_batch_logprobs, run, ro, rows, pcols, tcols)
        if logps is None:
            finite = False
        else:
            out[rows, tcols] = logps
    finite = finite and bool((torch.isfinite(out) | (ro.trained_mask == 0)).all())
    return out if dist_.all_true(finite, run.world, run.device) else None


def reference_logprobs(run: Run, ro: Rollout) -> torch.Tensor | None:
    if run.ref_policy is not None:
        return logprobs_of(run, run.ref_policy, ro)
    with run.model.disable_adapter():
        return logprobs_of(run, run.policy, ro)


def micro_batch_config(config: GRPOLossConfig, weight: float, token_weight: float) -> GRPOLossConfig:
    """The entropy bonus is a token mean whatever the loss type: its coefficient is rescaled so that after the
    micro-batch weight it counts with ``token_weight`` (:func:`token_mean_weight`)."""
    if config.entropy_coef == 0.0:
        return config
    return dataclasses.replace(config, entropy_coef=config.entropy_coef * token_weight / weight)


def _micro_batch_loss(model, run: Run, ro: Rollout, rows, pcols, tcols, advantages, old_logps, ref_logps,
                      sampling_ratio, total_rows: float, total_tokens: float, micro_batches: int):
    """The micro-batch's weighted share of the generation's loss and its ``LossOutput``; runs inside the policy's
    forward. Non-finite hidden states give a NaN loss that reaches every weight (and no output), so the gradients
    turn non-finite on every rank together and all of them skip the update."""
    hidden, weight, bias, _ = hidden_and_head(run, model, ro, rows, pcols, tcols)
    if not torch.isfinite(hidden).all():
        return (hidden.float().sum() + weight.float().sum()) * float("nan"), None, 0.0
    mask = ro.trained_mask[rows, tcols]  # tool tokens are context: attended to, never trained
    tokens = float(mask.sum())
    share = tokens / max(total_tokens, 1.0)  # the micro-batch's share of the generation's tokens (metrics)
    token_weight = token_mean_weight(run.config.token_mean, tokens, total_tokens, micro_batches)
    scale = micro_batch_scale(run.loss_config.loss_type, hidden.shape[0] / total_rows, token_weight)
    out = grpo_loss(
        hidden, weight, ro.completion_ids[rows, tcols], advantages[rows], mask,
        old_logps=None if old_logps is None else old_logps[rows, tcols],
        ref_logps=None if ref_logps is None else ref_logps[rows, tcols],
        sampling_ratio=None if sampling_ratio is None else sampling_ratio[rows, tcols if sampling_ratio.shape[1] > 1
                                                                          else slice(None)],
        num_items_in_batch=total_tokens, bias=bias, impl=run.config.impl,
        config=micro_batch_config(run.loss_config, scale, token_weight),
    )
    return out.loss * scale, out, share


# ------------------------------------------------------------------------------------------------ set-up


def setup(config: TrainConfig) -> Run:
    check_dataset_files(config)  # a mistyped --dataset in a second, before the devices, imports and the model
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
    # the data, the prompts' lengths and the model's context before the weights load (a missing file, a prompt or
    # --max-new-tokens too long for the model: found in seconds, not after minutes of loading)
    engine, _ = resolve_rollout(config, device, world.size)
    train_located, eval_located = located_datasets(config)
    tokenizer = tokenizer_of(config)
    longest = check_dataset_prompts(config, train_located + eval_located, tokenizer)
    if world.is_main:
        warn_unknown_characters(config, train_located + eval_located, tokenizer)
    check_context(config, saved_model_config(config), longest, engine)
    ckpt.seed_rngs(config.seed)  # Python's, numpy's and torch's: a reward function may draw from any
    # full fine-tuning keeps float32 master weights; with LoRA the frozen base is stored in the compute dtype
    model, tokenizer = load_model_and_tokenizer(config, device, dtype if config.lora_r else torch.float32, tokenizer)
    check_context(config, unwrap(model).config, longest, engine)  # the tiny model's, and the config the load read
    check_head(model, len(tokenizer), device)
    agent = build_agent(config, tokenizer, eos_token_ids(model, tokenizer))
    if config.sft_warmup_steps:  # before the reference copy: the reference is the warmed-up model
        warm_up(config, model, tokenizer, agent)
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
    train_records, eval_records = [r for _, r in train_located], [r for _, r in eval_located]
    reward_funcs = [load_reward(name) for name in config.rewards]
    reward_funcs, weights = reward_sources(reward_funcs, config.reward_weights or [1.0] * len(reward_funcs), agent)
    lr = config.lr or (TINY_LR if config.model == "tiny" else MODEL_LR)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, config, lr, device, model)
    scheduler = lr_scheduler(optimizer, config, config.steps * config.mu)
    sampler = PromptSampler(train_records, config.prompts_per_step, seed=config.seed)
    # (under FSDP2 the DTensors' global sizes; a 4-bit weight by its unpacked shape)
    n_params = sum(getattr(getattr(p, "quant_state", None), "shape", p.shape).numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    logger.info(
        "model %s: %s, %.2fM parameters (%.2fM trained, float32 master weights%s; optimizer %s), compute %s on %s (%d "
        "CPU thread%s%s); fused-loss kernel path: %s; shared-prefix forward: %s; reference model: %s; rewards: %s; %d "
        "training prompts, %d held-out",
        config.model, type(unwrap(model)).__name__, n_params / 1e6, n_train / 1e6,
        f"; the base's linear layers in 4 bits ({config.bnb_4bit_quant_type})" if config.load_in_4bit else "",
        config.optim, dtype, device,
        torch.get_num_threads(), "" if torch.get_num_threads() == 1 else "s",
        f"; {world.size} processes, {world.strategy}" if world.distributed else "",
        impl, ("off" if not shared_ok else "on" if config.shared_prefix == "on"
                                        else f"auto (when it saves >= {SHARED_PREFIX_MIN_SAVING}x tokens)"),
        "adapters disabled" if config.lora_r else ("frozen copy" if ref_model is not None else "none (beta=0)"),
        ", ".join(reward_name(f) for f in reward_funcs), len(train_records), len(eval_records),
    )
    return Run(config=config, model=model, ref_model=ref_model, tokenizer=tokenizer, optimizer=optimizer,
               scheduler=scheduler, sampler=sampler, reward_funcs=reward_funcs,
               reward_weights=torch.tensor(weights, dtype=torch.float32), loss_config=loss_config,
               eval_records=eval_records, device=device, dtype=dtype, world=world, policy=policy,
               ref_policy=ref_policy, shared_prefix_ok=shared_ok, agent=agent,
               context=(context_length(unwrap(model).config) or (None,))[0])


def load_datasets(config: TrainConfig, tokenizer=None) -> tuple[list[dict], list[dict]]:
    """The training and held-out records; with a ``tokenizer``, every prompt of both is checked first
    (:func:`check_prompts`: none empty, none longer than ``max_prompt_length``), the error naming the record."""
    train, evaluation = located_datasets(config)
    if tokenizer is not None:
        check_dataset_prompts(config, train + evaluation, tokenizer)
    return [r for _, r in train], [r for _, r in evaluation]


def located_datasets(config: TrainConfig) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """The training and held-out records, each with where it is (``"data.jsonl, line 3"``); a file that is not
    there, or not a dataset, is an error naming ``TrainConfig.dataset`` / ``eval_dataset``."""
    if config.dataset.startswith("builtin:"):
        name = config.dataset.split(":", 1)[1]
        if name not in TASKS:
            raise ValueError(f"TrainConfig.dataset: unknown builtin task {name!r}; expected builtin:NAME with NAME "
                             f"one of {', '.join(TASKS)}, or a .jsonl/.json/.parquet file")
        train = [(f"{config.dataset}, record {i}", r) for i, r in enumerate(builtin_records(name, "train", TASK_SIZE))]
        evaluation = [(f"{config.dataset} (held-out), record {i}", r)
                      for i, r in enumerate(builtin_records(name, "eval", config.eval_size))]
        columns = list(train[0][1])
        if config.prompt_column not in columns:
            raise ValueError(f"TrainConfig.prompt_column: expected a column of {config.dataset}'s records "
                             f"({', '.join(map(repr, columns))}; the prompt is 'prompt'), got {config.prompt_column!r}")
        return train, evaluation
    needs = ("answer",) if any(r in ("math", "exact", "last_number") for r in config.rewards) else ()
    needs += ("tests",) if any(r == "code" for r in config.rewards) else ()
    if config.eval_dataset:  # both files' names before either is read
        check_record_file(config.eval_dataset, "TrainConfig.eval_dataset")
    train = load_located_records(config.dataset, prompt_column=config.prompt_column, required=needs,
                                 option="TrainConfig.dataset")
    evaluation = []
    if config.eval_dataset:
        evaluation = load_located_records(config.eval_dataset, prompt_column=config.prompt_column, required=needs,
                                          limit=config.eval_size, option="TrainConfig.eval_dataset")
    return train, evaluation


def check_dataset_files(config: TrainConfig) -> None:
    """The files ``--dataset`` and ``--eval-dataset`` name are there and of a supported type (the errors name the
    option); :func:`located_datasets` reads them later."""
    if not config.dataset.startswith("builtin:"):
        check_record_file(config.dataset, "TrainConfig.dataset")
    if config.eval_dataset:
        check_record_file(config.eval_dataset, "TrainConfig.eval_dataset")


def warn_unknown_characters(config: TrainConfig, located: list[tuple[str, dict]], tokenizer) -> None:
    """One warning, before training, naming the characters of the prompts (and answers) that the tokenizer reads as
    its unknown token, with how often each occurs: the model sees them all as one token and can never write them
    (the tiny model's 20-token vocabulary has no ``+``, ``-`` or ``*``: docs/train.md)."""
    columns = [config.prompt_column]
    if located and "answer" in located[0][1] and config.prompt_column != "answer":
        columns.append("answer")
    found = unknown_characters(located, tokenizer, columns, config.system_prompt)
    if not found:
        return
    def show(chars: dict[str, int]) -> str:
        shown = ", ".join(f"{c!r} x{n}" for c, n in list(chars.items())[:16])
        return shown + (f" and {len(chars) - 16} more" if len(chars) > 16 else "")

    whose = ("the tiny model's character tokenizer (its vocabulary: docs/train.md, \"The tiny model's tokenizer\")"
             if config.model == "tiny" else f"the tokenizer of {config.tokenizer or config.model}")
    logger.warning("%s reads these characters of the dataset as %s, which the model cannot tell apart or write: %s",
                   whose, tokenizer.unk_token,
                   "; ".join(f"{len(chars)} in column {column!r} ({show(chars)})" for column, chars in found.items()))


def check_dataset_prompts(config: TrainConfig, located: list[tuple[str, dict]], tokenizer) -> tuple[str, int] | None:
    """:func:`check_prompts` with the run's options; returns where the longest prompt is and its length."""
    return check_prompts(located, tokenizer, prompt_column=config.prompt_column,
                         max_prompt_length=config.max_prompt_length, system_prompt=config.system_prompt,
                         count_tokens=len if config.model == "tiny" else None,  # its tokenizer: a token a character
                         tools=tool_schemas(config))  # rendered into every prompt, as the rollout does


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
