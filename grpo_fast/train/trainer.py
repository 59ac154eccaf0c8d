"""The GRPO training loop: rollout -> rewards -> group advantages -> (old, reference log-probs) -> mu updates.

Each piece is a small function; ``train`` composes them in one loop. The policy loss goes through ``grpo_loss`` on
the decoder's last hidden states and the lm_head weight, so no ``[rows, T, V]`` logits are ever built in training.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_fast import fused_logprobs, group_advantages, grpo_loss
from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.dispatch import resolve_impl
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.data import PromptSampler, load_records, render_prompt
from grpo_fast.train.forward import completion_hidden, head_of, unwrap
from grpo_fast.train.metrics import MetricsLog, plot_metrics
from grpo_fast.train.rewards import compute_rewards, load_reward, reward_name
from grpo_fast.train.rollout import Rollout, SamplingParams, generate
from grpo_fast.train.tasks import builtin_records, tiny_model, tiny_tokenizer

logger = logging.getLogger("grpo_fast.train")

# loss types whose reduction is a sum over tokens divided by num_items_in_batch (DESIGN.md §4)
TOKEN_SUM_LOSSES = (LossType.DAPO, LossType.CISPO, LossType.VESPO)
BUILTIN_REWARDS = ["math"]
TINY_LR, MODEL_LR = 5e-4, 1e-6


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
    generator: torch.Generator
    reward_funcs: list
    reward_weights: torch.Tensor
    loss_config: GRPOLossConfig
    eval_records: list[dict]
    device: torch.device
    step: int = 0
    skipped_updates: int = 0
    history: list[dict] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device: {name!r} asked for, but torch.cuda.is_available() is False")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model_and_tokenizer(config: TrainConfig, device, dtype):
    if config.model == "tiny":
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, config.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(config.model)
        if not path.is_dir():
            raise FileNotFoundError(
                f"TrainConfig.model: expected 'tiny' or a local model directory, got {config.model!r} (not a "
                "directory; grpo-fast never downloads models: save one with save_pretrained first)"
            )
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, padding_side="left")
        if _has_weights(path):
            model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
        else:  # a config.json alone: the architecture with fresh weights from the seed
            from transformers import AutoConfig

            logger.warning("model %s has no weights: building it from its config.json with random weights (seed %d)",
                           path, config.seed)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = model.to(device=device, dtype=dtype)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tokenizer


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.safetensors.index.json"))


def attach_lora(model, config: TrainConfig):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("TrainConfig.lora_r > 0 needs peft (pip install peft)") from None
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, target_modules=config.lora_target_modules,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def load_datasets(config: TrainConfig) -> tuple[list[dict], list[dict]]:
    if config.dataset.startswith("builtin:"):
        name = config.dataset.split(":", 1)[1]
        train = builtin_records(name, "train", 4096)
        evaluation = builtin_records(name, "eval", config.eval_size)
        return train, evaluation
    needs = ("answer",) if any(r == "math" for r in config.rewards) else ()
    needs += ("tests",) if any(r == "code" for r in config.rewards) else ()
    train = load_records(config.dataset, prompt_column=config.prompt_column, required=needs)
    evaluation = []
    if config.eval_dataset:
        evaluation = load_records(config.eval_dataset, prompt_column=config.prompt_column, required=needs,
                                  limit=config.eval_size)
    return train, evaluation


def lr_lambda(config: TrainConfig, total_updates: int):
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        if config.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def setup(config: TrainConfig) -> Run:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    threads = config.threads or (1 if config.model == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(config, device, dtype)
    ref_model = None
    if config.lora_r > 0:
        model = attach_lora(model, config)  # the reference is the base with the adapters disabled
    elif config.loss.beta != 0.0:
        ref_model = _frozen_copy(model)
    head = head_of(model)
    loss_config = dataclasses.replace(
        config.loss, temperature=config.temperature, softcap=head.softcap, max_completion_length=config.max_new_tokens
    )
    train_records, eval_records = load_datasets(config)
    names = config.rewards or BUILTIN_REWARDS
    reward_funcs = [load_reward(name) for name in names]
    weights = config.reward_weights or [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"TrainConfig.reward_weights: expected {len(reward_funcs)} weights (rewards: {names}), "
                         f"got {weights}")
    lr = config.lr or (TINY_LR if config.model == "tiny" else MODEL_LR)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(config.adam_betas), weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, config.steps * config.mu))
    generator = torch.Generator(device=device).manual_seed(config.seed)
    sampler = PromptSampler(train_records, config.prompts_per_step, seed=config.seed)
    impl = resolve_impl(config.impl, head.weight.device, "grpo_loss", head.weight.dtype)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in params)
    logger.info(
        "model %s: %s, %.2fM parameters (%.2fM trained), %s on %s (%d CPU threads); fused-loss kernel path: %s; reference model: %s; "
        "rewards: %s; %d training prompts, %d held-out",
        config.model, type(model).__name__, n_params / 1e6, n_train / 1e6, dtype, device, torch.get_num_threads(), impl,
        "adapters disabled" if config.lora_r else ("frozen copy" if ref_model is not None else "none (beta=0)"),
        ", ".join(reward_name(f) for f in reward_funcs), len(train_records), len(eval_records),
    )
    return Run(config=config, model=model, ref_model=ref_model, tokenizer=tokenizer, optimizer=optimizer,
               scheduler=scheduler, sampler=sampler, generator=generator, reward_funcs=reward_funcs,
               reward_weights=torch.tensor(weights, dtype=torch.float32), loss_config=loss_config,
               eval_records=eval_records, device=device)


def _frozen_copy(model):
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


# ------------------------------------------------------------------------------------------------ the steps


def encode_prompts(run: Run, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    texts = [render_prompt(run.tokenizer, r[run.config.prompt_column], system_prompt=run.config.system_prompt)
             for r in records]
    enc = run.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    if enc.input_ids.shape[1] > run.config.max_prompt_length:
        longest = int(enc.attention_mask.sum(1).argmax())
        raise ValueError(
            f"TrainConfig.max_prompt_length: a prompt has {enc.input_ids.shape[1]} tokens, more than "
            f"{run.config.max_prompt_length}: {texts[longest][:80]!r}..."
        )
    return enc.input_ids.to(run.device), enc.attention_mask.to(run.device), texts


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS plus the model's generation-config EOS ids (chat models often end turns with another
    token, e.g. Llama-3's <|eot_id|>)."""
    ids = [tokenizer.eos_token_id]
    generation_config = getattr(unwrap(model), "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return sorted({i for i in ids if i is not None})


def rollout(run: Run, records: list[dict], group_size: int, params: SamplingParams) -> tuple[Rollout, list[str]]:
    prompt_ids, prompt_mask, _ = encode_prompts(run, records)
    result = generate(run.model, prompt_ids, prompt_mask, group_size, params,
                      eos_token_id=eos_token_ids(run.model, run.tokenizer), pad_token_id=run.tokenizer.pad_token_id,
                      generator=run.generator)
    completions = run.tokenizer.batch_decode(result.completion_ids, skip_special_tokens=True)
    return result, completions


def score(run: Run, records: list[dict], completions: list[str], group_size: int) -> torch.Tensor:
    """``[N, K]`` rewards (NaN: not scored) for the ``N = len(records) * group_size`` completions."""
    rows = [r for r in records for _ in range(group_size)]
    prompt_column = run.config.prompt_column
    names = dict.fromkeys(k for r in records for k in r if k != prompt_column)  # rows may differ in columns
    columns = {k: [r.get(k) for r in rows] for k in names}
    prompts = [r[prompt_column] for r in rows]
    return compute_rewards(run.reward_funcs, prompts, completions, columns)


def micro_batches(rollout_: Rollout, size: int):
    """Row slices of at most ``size`` rows, each trimmed to its own longest prompt and completion."""
    for start in range(0, rollout_.completion_ids.shape[0], size):
        rows = slice(start, start + size)
        pm, cm = rollout_.prompt_mask[rows], rollout_.completion_mask[rows]
        p0 = int((pm.sum(0) == 0).long().cumprod(0).sum())  # leading all-padding columns
        t1 = max(1, int(cm.sum(1).max()))
        yield rows, slice(p0, None), slice(0, t1)


def policy_hidden(model, ro: Rollout, rows, pcols, tcols):
    return completion_hidden(model, ro.prompt_ids[rows, pcols], ro.prompt_mask[rows, pcols],
                             ro.completion_ids[rows, tcols], ro.completion_mask[rows, tcols])


@torch.no_grad()
def logprobs_of(run: Run, model, ro: Rollout) -> torch.Tensor:
    """Per-token log-probs ``[N, T]`` of the sampled completions under ``model`` (old or reference policy)."""
    head = head_of(model)
    out = torch.zeros(ro.completion_ids.shape, dtype=torch.float32, device=run.device)
    for rows, pcols, tcols in micro_batches(ro, run.config.micro_batch_size):
        hidden = policy_hidden(model, ro, rows, pcols, tcols)
        out[rows, tcols] = fused_logprobs(hidden, head.weight, ro.completion_ids[rows, tcols], bias=head.bias,
                                          temperature=run.config.temperature, softcap=head.softcap,
                                          impl=run.config.impl).float()
    return out


def reference_logprobs(run: Run, ro: Rollout) -> torch.Tensor | None:
    if run.loss_config.beta == 0.0:
        return None
    if run.ref_model is not None:
        return logprobs_of(run, run.ref_model, ro)
    with run.model.disable_adapter():
        return logprobs_of(run, run.model, ro)


def micro_batch_scale(loss_type: LossType, rows: int, total_rows: int, tokens: float, total_tokens: float) -> float:
    """Weight of one micro-batch's loss so that the accumulated gradient equals the whole generation's.

    dapo/cispo/vespo already divide by ``num_items_in_batch`` (the generation's token count); bnpo's per-batch token
    mean is reweighted by the micro-batch's share of tokens; the per-sequence means (grpo, sapo, dr_grpo, luspo) by
    its share of rows.
    """
    if loss_type in TOKEN_SUM_LOSSES:
        return 1.0
    if loss_type == LossType.BNPO:
        return tokens / max(total_tokens, 1.0)
    return rows / total_rows


def policy_update(run: Run, ro: Rollout, advantages, old_logps, ref_logps) -> dict:
    """One optimizer update over the whole generation (gradient accumulation over micro-batches).

    A non-finite hidden state, loss or gradient norm skips the update: the gradients are dropped, the weights and the
    optimizer state are not touched, and the skip is counted.
    """
    cfg, model = run.config, run.model
    head = head_of(model)
    total_rows = ro.completion_ids.shape[0]
    total_tokens = float(ro.completion_mask.sum())
    run.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    finite = True
    logp_gap = []
    for rows, pcols, tcols in micro_batches(ro, cfg.micro_batch_size):
        hidden = policy_hidden(model, ro, rows, pcols, tcols)
        if not torch.isfinite(hidden).all():
            finite = False
            break
        mask = ro.completion_mask[rows, tcols]
        out = grpo_loss(
            hidden, head.weight, ro.completion_ids[rows, tcols], advantages[rows], mask,
            old_logps=None if old_logps is None else old_logps[rows, tcols],
            ref_logps=None if ref_logps is None else ref_logps[rows, tcols],
            num_items_in_batch=total_tokens, bias=head.bias, config=run.loss_config, impl=cfg.impl,
        )
        weight = micro_batch_scale(run.loss_config.loss_type, hidden.shape[0], total_rows, float(mask.sum()),
                                   total_tokens)
        loss = out.loss * weight
        if not torch.isfinite(loss):
            finite = False
            break
        loss.backward()
        share = hidden.shape[0] / total_rows
        _accumulate(sums, "loss", float(loss.detach()))
        for name in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
            value = getattr(out, name)
            if value is not None:
                _accumulate(sums, name, float(value) * share)
        logp_gap.append(((out.per_token_logps - ro.sampling_logps[rows, tcols]).abs() * mask).sum())
    grad_norm = float("nan")
    if finite:
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        finite = math.isfinite(grad_norm)
    if finite:
        run.optimizer.step()
        run.scheduler.step()
    else:  # like transformers' Trainer, a skipped update does not advance the schedule either
        run.optimizer.zero_grad(set_to_none=True)
        run.skipped_updates += 1
        logger.warning("step %d: non-finite loss or gradient; update skipped (%d so far), weights untouched",
                       run.step, run.skipped_updates)
    sums["grad_norm"] = grad_norm
    if logp_gap and old_logps is None:
        sums["sampling_logp_gap"] = float(torch.stack(logp_gap).sum()) / max(total_tokens, 1.0)
    return sums


def _accumulate(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


@torch.no_grad()
def evaluate(run: Run) -> float | None:
    """Mean weighted reward of greedy completions on the held-out prompts (None without any)."""
    if not run.eval_records:
        return None
    params = SamplingParams(max_new_tokens=run.config.max_new_tokens, temperature=0.0)
    total, count = 0.0, 0
    for start in range(0, len(run.eval_records), 128):
        records = run.eval_records[start : start + 128]
        _, completions = rollout(run, records, 1, params)
        rewards = score(run, records, completions, 1)
        combined = torch.nansum(rewards * run.reward_weights, dim=1)
        total += float(combined.sum())
        count += len(records)
    return total / count


def train_step(run: Run) -> dict:
    cfg = run.config
    t0 = time.perf_counter()
    records = run.sampler.next_batch()
    params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    ro, completions = rollout(run, records, cfg.group_size, params)
    t_gen = time.perf_counter() - t0
    rewards = score(run, records, completions, cfg.group_size)
    adv = group_advantages(rewards.to(run.device), group_size=cfg.group_size, scale=cfg.scale_rewards,
                           reward_weights=run.reward_weights.to(run.device))
    old_logps = logprobs_of(run, run.model, ro) if cfg.mu > 1 else None
    ref_logps = reference_logprobs(run, ro)
    sums: dict[str, float] = {}
    for _ in range(cfg.mu):
        for k, v in policy_update(run, ro, adv.advantages, old_logps, ref_logps).items():
            _accumulate(sums, k, v / cfg.mu)
    run.step += 1
    combined = torch.nansum(rewards * run.reward_weights, dim=1)
    metrics = {
        "step": run.step,
        "reward": float(combined.mean()),
        "reward_std": float(combined.std()) if combined.numel() > 1 else 0.0,
        **{f"rewards/{reward_name(f)}": float(torch.nanmean(rewards[:, k])) for k, f in enumerate(run.reward_funcs)},
        "frac_zero_std": float(adv.zero_std.float().mean()),
        "completion_length": float(ro.completion_lengths.float().mean()),
        "lr": run.scheduler.get_last_lr()[0],
        **sums,
        "skipped_updates": run.skipped_updates,
        "time_generate_s": t_gen,
        "time_step_s": time.perf_counter() - t0,
    }
    return metrics


# ------------------------------------------------------------------------------------------------ the loop


def save_checkpoint(run: Run, directory: Path) -> Path:
    state = {
        "step": run.step,
        "skipped_updates": run.skipped_updates,
        "model": {k: v for k, v in run.model.state_dict().items()},
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "rng": ckpt.rng_state(run.generator),
        "config": run.config.to_dict(),
    }
    path = ckpt.checkpoint_path(directory, run.step)
    ckpt.save_atomic(state, path)
    ckpt.prune(directory, run.config.keep_checkpoints)
    return path


def load_checkpoint(run: Run, directory: Path) -> bool:
    stale = ckpt.remove_stale_temporaries(directory)
    if stale:
        logger.warning("removed %d partial checkpoint file(s) left by an interrupted save", len(stale))
    found = ckpt.list_checkpoints(directory)
    if not found:
        logger.info("resume: no checkpoint in %s, starting from step 0", directory)
        return False
    step, path = found[-1]
    state = torch.load(path, map_location=run.device, weights_only=False)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    ckpt.set_rng_state(state["rng"], run.generator)
    run.step, run.skipped_updates = state["step"], state["skipped_updates"]
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

        return (f"grpo-fast: {self.steps} steps in {self.seconds:.0f} s; held-out reward {fmt(self.eval_before)} -> "
                f"{fmt(self.eval_after)}; {self.skipped_updates} skipped updates; outputs in {self.output_dir}")


def train(config: TrainConfig) -> Summary:
    """Runs ``config.steps`` GRPO steps; returns the before/after evaluation. Metrics go to
    ``output_dir/metrics.jsonl``, checkpoints to ``output_dir/checkpoints``."""
    t_start = time.perf_counter()
    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / "checkpoints"
    _check_output_dir(config, out_dir, ckpt_dir)
    run = setup(config)
    resumed = config.resume and load_checkpoint(run, ckpt_dir)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    log = MetricsLog(out_dir / "metrics.jsonl", truncate_after=run.step if resumed else 0)
    eval_before = log.header.get("eval_before") if resumed else None
    if not resumed:
        eval_before = evaluate(run)
        log.write_header({"eval_before": eval_before, "config": config.to_dict()})
    bar = _progress(config, run.step)
    try:
        while run.step < config.steps:
            metrics = train_step(run)
            if run.step % config.log_every == 0 or run.step == config.steps:
                log.write(metrics)
            bar.set_postfix(_postfix(metrics), refresh=False)
            bar.update(1)
            if config.save_every and run.step % config.save_every == 0 and run.step < config.steps:
                save_checkpoint(run, ckpt_dir)
    finally:
        bar.close()
    save_checkpoint(run, ckpt_dir)
    eval_after = evaluate(run)
    log.write_footer({"eval_after": eval_after})
    if config.plot:
        plot_metrics(out_dir / "metrics.jsonl", out_dir / "reward_kl.png")
    summary = Summary(run.step, eval_before, eval_after, run.skipped_updates, out_dir, time.perf_counter() - t_start)
    return summary


def _check_output_dir(config: TrainConfig, out_dir: Path, ckpt_dir: Path) -> None:
    """A new run never silently overwrites an earlier run's metrics and checkpoints."""
    earlier = ckpt.list_checkpoints(ckpt_dir) or (out_dir / "metrics.jsonl").exists()
    if earlier and not (config.resume or config.overwrite):
        raise FileExistsError(
            f"TrainConfig.output_dir: {out_dir} already holds a run (metrics.jsonl or checkpoints); pass --resume to "
            "continue it, --overwrite to start over in it, or choose another --output-dir"
        )
    if config.overwrite and not config.resume:
        for _, path in ckpt.list_checkpoints(ckpt_dir):
            path.unlink()


def _progress(config: TrainConfig, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, disable=not config.progress, desc="grpo-fast", unit="step",
                dynamic_ncols=True)


def _postfix(m: dict) -> dict:
    keys = (("reward", "reward"), ("kl", "kl"), ("entropy", "ent"), ("clip_ratio_region", "clip"))
    return {short: f"{m[k]:.3f}" for k, short in keys if k in m}
