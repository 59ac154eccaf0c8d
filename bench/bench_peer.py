"""Peer comparison: the default task trained for the same steps with grpo-fast and with TRL's GRPOTrainer.

Both trainers run the default ``grpo-fast train`` configuration (grpo_fast/train/config.py ``TrainConfig``): the
built-in ``digits`` task ("max 3 8 1 6=" -> "8", 4096 training prompts, math reward), the tiny 2-layer Qwen2 of
``grpo_fast.train.tasks.tiny_model`` built from the seed (saved with ``save_pretrained`` and loaded by TRL, so both
start from identical weights), 16 prompts x 16 completions per optimizer step in micro-batches of 64 (TRL:
``per_device_train_batch_size=64``, ``gradient_accumulation_steps=4``, one generation per step, ``num_iterations=1``),
at most 4 new tokens, temperature 1.0, top_p 1.0, no top-k, loss dapo, beta 0.04 with the bias-corrected KL, epsilon
0.2, AdamW lr 5e-4 with betas (0.9, 0.99), no weight decay, gradient clipping at 1.0, 10 warm-up steps then a
constant learning rate, advantages scaled per group, fp32 on the CPU.

Every option is mapped explicitly: ``trl_args`` builds ``GRPOConfig``'s keyword arguments, ``COUNTERPARTS`` names the
``GRPOConfig`` fields each ``TrainConfig`` / ``GRPOLossConfig`` field sets, and ``NOT_MAPPED`` says why each other
field has none (options TRL cannot reproduce are refused when set). tests/test_bench_peer.py derives the coverage
from the dataclasses: a new field fails it until it is classified, and a field named like a ``GRPOConfig`` field must
be passed, so nothing falls to TRL's default silently. ``TRL_PINNED`` sets the ``GRPOConfig`` fields without an
option of ours whose TRL default is not what grpo-fast does.

Each (seed, trainer) runs in its own fresh process (``bench.harness.run_isolated``), one after the other, and reports:

  step_ms         per optimizer step: sampling, rewards, advantages, forward/backward and the optimizer step
                  (grpo-fast: its ``time_step_s``; TRL: a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``,
                  which leaves out the Trainer's fetch of the step's 256 dataset rows and its logging)
  peak_rss_mib    the process's peak resident set (imports, model, data, evaluations and training included);
                  libs_rss_mib: its resident set once the trainer's libraries are imported (TRL's pull in datasets,
                  accelerate, ...), run_peak_mib: the difference, what the run itself added
  reward          the mean reward of each step's 256 sampled completions (the reward curve); final_reward_avg: its
                  mean over the last 100 steps
  eval_*          held-out reward before and after training: greedy decoding of the 256 held-out prompts, scored
                  with the math reward (grpo-fast's own ``evaluate``, for TRL pointed at TRL's model)

Not aligned (each trainer's own behaviour): the prompt order and the sampling random streams (both seeded by the
seed, but differently), and TRL prefills each prompt once per completion where grpo-fast prefills once per prompt.

Threads: ``--threads`` (default 1) for both. The tiny model's matmuls gain nothing from a second thread, and on a
2-core machine shared with other jobs OpenMP's threads stall each other: at load average 4, 2 threads made a
grpo-fast step 50x slower (10 s instead of 0.2 s) and a TRL step 2x slower (one 5-step check).

Outputs: ``--out`` (default ``bench/results/peer_cpu.csv``, one summary row per seed and trainer with the load average
at start and end: the machine may be shared), ``<out>_curve.csv`` (seed, trainer, step, reward, step_ms) and
``<out>.png`` (reward curves; step time and peak memory). Both CSVs are rewritten after every run, so a stopped
benchmark keeps the runs it finished.

    python -m bench.bench_peer                    # seeds 0 1 2, 800 steps each, the default run
    python -m bench.bench_peer --seeds 0 --steps 5   # a quick check
    python -m bench.bench_peer --trainers trl --keep # add TRL's runs to the grpo-fast runs already in the CSV
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_peer.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from grpo_fast.benchmarking import PhaseTimer
from grpo_fast.train.model import checkpointing_arguments

TRAINERS = ("grpo_fast", "trl")
FINAL_WINDOW = 100  # final_reward_avg: mean reward of the last this many steps


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces


def default_config(steps: int, seed: int, output_dir: str, **overrides):
    """The default ``grpo-fast train`` config with ``steps`` and ``seed``, on the CPU; no progress bar, plot or
    checkpoints on the way."""
    from grpo_fast.train import build_config

    values = {"steps": steps, "seed": seed, "output_dir": output_dir, "device": "cpu", "progress": False,
              "plot": False, "save_every": 0, **overrides}
    return build_config(overrides={k: str(v) for k, v in values.items()})


# TrainConfig field ("loss.NAME": a GRPOLossConfig field) -> the GRPOConfig fields trl_args sets from it
COUNTERPARTS = {
    "steps": ("max_steps",),  # x mu: TRL counts optimizer updates, grpo-fast generations
    "seed": ("seed",),
    "output_dir": ("output_dir",),  # TRL's own temporary directory
    "group_size": ("num_generations",),
    # one optimizer step = one generation of prompts_per_step x group_size completions, in micro-batches
    # (TRL derives generation_batch_size from these, and refuses it set beside steps_per_generation)
    "prompts_per_step": ("gradient_accumulation_steps", "steps_per_generation"),
    "micro_batch_size": ("per_device_train_batch_size",),
    "mu": ("num_iterations",),
    "max_new_tokens": ("max_completion_length",),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "scale_rewards": ("scale_rewards",),
    "reward_weights": ("reward_weights",),
    # transformers 5.2x renamed it activation_checkpointing; GRPOConfig's default of the old name is True
    "gradient_checkpointing": tuple(checkpointing_arguments(False)),
    "dtype": ("bf16", "fp16"),
    "device": ("use_cpu",),
    "lr": ("learning_rate",),
    "optim": ("optim",),  # transformers' names, TRL's default
    "weight_decay": ("weight_decay",),
    "adam_betas": ("adam_beta1", "adam_beta2"),
    "max_grad_norm": ("max_grad_norm",),
    "disable_dropout": ("disable_dropout",),
    "warmup_steps": ("warmup_steps",),
    "lr_schedule": ("lr_scheduler_type",),
    "progress": ("disable_tqdm",),
    "max_tool_calling_iterations": ("max_tool_calling_iterations",),
    # experiment tracking: the same trackers, run name and project on both sides (the bench's default: none)
    "report_to": ("report_to",),
    "run_name": ("run_name",),
    "project": ("project",),
    "num_completions_to_print": ("num_completions_to_print",),
    "rollout": ("use_vllm", "vllm_mode"),  # both sample with their transformers loops here: hf / use_vllm=False
    **{name: (name,) for name in (
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max")},
    **{f"loss.{name}": (name,) for name in (
        "loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "use_bias_correction_kl",
        "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
        "vespo_lambda_neg", "top_entropy_quantile", "entropy_coef")},
}

# fields without a GRPOConfig counterpart, and how the bench handles them (REFUSED: trl_args refuses a value other
# than the default, which TRL could not reproduce)
REFUSED = "refused unless default"
NOT_MAPPED = {
    "model": f"{REFUSED}: the tiny model, saved and passed to GRPOTrainer(model=...)",
    "tokenizer": f"{REFUSED}: the tiny tokenizer, GRPOTrainer(processing_class=...)",
    "threads": "torch.set_num_threads(--threads) in both processes",
    "impl": "grpo-fast's kernel path: TRL computes its own loss",
    "lora_r": f"{REFUSED}: LoRA would be GRPOTrainer(peft_config=...)",
    "lora_alpha": "only with lora_r",
    "lora_target_modules": "only with lora_r",
    "merge_lora": "only with lora_r (what output_dir/model holds)",
    "load_in_4bit": f"{REFUSED}: needs lora_r; GRPOConfig(model_init_kwargs={{'quantization_config': ...}}) with a "
                    "peft_config (bench/bench_qlora.py compares the two trainers that way)",
    "bnb_4bit_quant_type": "only with load_in_4bit",
    "bnb_4bit_use_double_quant": "only with load_in_4bit",
    "distributed": "one process: ignored by both",
    "dataset": "builtin tasks only: GRPOTrainer(train_dataset=...) of the same records",
    "eval_dataset": "both are scored by grpo-fast's evaluate on the task's held-out split",
    "prompt_column": f"{REFUSED}: TRL reads the 'prompt' column",
    "system_prompt": f"{REFUSED}: GRPOConfig has no system prompt (the task's plain prompts reach both sides as they "
                     "are)",
    "max_prompt_length": "grpo-fast's limit refuses longer prompts (never truncates); the task's prompts fit",
    "eval_size": "both are scored by grpo-fast's evaluate",
    "rewards": "GRPOTrainer(reward_funcs=...): the same functions (grpo_fast.train.rewards.load_reward)",
    "generation_prompts": "how many prompts grpo-fast samples at once (memory); TRL samples the generation at once",
    "shared_prefix": "grpo-fast's prompt-sharing forward (speed); TRL runs every row's prompt",
    "token_mean": f"{REFUSED}: TRL averages each micro-batch's token mean (token_mean='micro_batch')",
    "log_every": "the curve needs every step: grpo-fast logs every step by default, TRL gets logging_steps=1",
    "plot": "grpo-fast's plot, off in the bench",
    "save_every": "no checkpoints in either (TRL: save_strategy='no')",
    "keep_checkpoints": "no checkpoints in either",
    "resume": "fresh runs only",
    "overwrite": "fresh temporary directories",
    "loss.temperature": "set by grpo-fast's trainer from TrainConfig.temperature, which maps",
    "loss.max_completion_length": "set by grpo-fast's trainer from TrainConfig.max_new_tokens, which maps",
    "loss.softcap": "the model's final_logit_softcapping, read by both from the same model",
    "loss.dro_beta": "only with loss_type dro, which TRL 1.16 lacks (trl_args refuses the loss types TRL lacks)",
    "vllm_kv_cache_mib": "vllm only (TRL sizes vLLM's memory by vllm_gpu_memory_utilization alone)",
    "tools": "GRPOTrainer(tools=...): the same functions (build_trl_trainer's trainer_kwargs)",
    "environment": "GRPOTrainer(environment_factory=...): the same class (build_trl_trainer's trainer_kwargs)",
    "max_tool_response_length": f"{REFUSED}: TRL 1.16 feeds a tool's whole result",
    "tool_timeout": "TRL waits for a tool without a limit; the comparison's tools return at once",
    "tool_workers": "how many tool calls grpo-fast runs at once (speed); TRL runs them one after the other",
    "sft_warmup_steps": f"{REFUSED}: the warm-up runs before either trainer, both start from its saved model",
    "log_completions_every": f"{REFUSED}: the bench logs no completion tables on either side (TRL: log_completions "
                             "off, its default)",
}

# GRPOConfig fields without an option of ours whose TRL default is not what grpo-fast does
TRL_PINNED = {
    "adam_epsilon": 1e-8,
    "mask_truncated_completions": False,  # a truncated completion keeps its loss in grpo-fast
}

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}  # ours -> TRL's


def trl_args(cfg, output_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments for the run ``cfg`` (a ``TrainConfig``) describes; ``COUNTERPARTS`` and
    ``TRL_PINNED`` list what it sets. A ``ValueError`` names an option TRL cannot reproduce."""
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.trainer import MODEL_LR, TINY_LR

    defaults = TrainConfig(output_dir=cfg.output_dir)
    for name, why in NOT_MAPPED.items():
        if why.startswith(REFUSED) and getattr(cfg, name) != getattr(defaults, name):
            raise ValueError(f"bench_peer: {name}={getattr(cfg, name)!r} has no TRL counterpart here ({why})")
    if not cfg.dataset.startswith("builtin:"):
        raise ValueError(f"bench_peer: dataset must be a builtin task, got {cfg.dataset!r}")
    rows = cfg.prompts_per_step * cfg.group_size
    if rows % cfg.micro_batch_size:
        raise ValueError(f"{rows} completions per step do not split into micro-batches of {cfg.micro_batch_size}")
    if cfg.device != "cpu":
        raise ValueError(f"bench_peer: both trainers run on the CPU (TRL: use_cpu=True); got device={cfg.device!r}")
    if cfg.rollout not in ("auto", "hf"):
        raise ValueError(f"bench_peer: both trainers sample with their own transformers loops (rollout hf, TRL's "
                         f"use_vllm=False); got rollout={cfg.rollout!r}")
    if not cfg.loss.loss_type.in_trl:
        raise ValueError(f"bench_peer: loss_type={cfg.loss.loss_type.value!r} is not one of TRL 1.16's loss types "
                         f"(it comes from verl's registry)")
    dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    accumulation = rows // cfg.micro_batch_size
    loss = cfg.loss
    return dict(
        output_dir=output_dir, max_steps=cfg.steps * cfg.mu, seed=cfg.seed,  # TRL counts optimizer updates
        num_generations=cfg.group_size, per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation, num_iterations=cfg.mu,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        scale_rewards=cfg.scale_rewards, reward_weights=list(cfg.reward_weights) or [1.0] * len(cfg.rewards),
        **checkpointing_arguments(cfg.gradient_checkpointing),
        bf16=dtype == "bfloat16", fp16=dtype == "float16", use_cpu=True,
        learning_rate=cfg.lr or (TINY_LR if cfg.model == "tiny" else MODEL_LR), optim=cfg.optim,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], max_grad_norm=cfg.max_grad_norm,
        disable_dropout=cfg.disable_dropout,
        warmup_steps=cfg.warmup_steps, lr_scheduler_type=SCHEDULES[cfg.lr_schedule], disable_tqdm=not cfg.progress,
        loss_type=loss.loss_type.value, beta=loss.beta, epsilon=loss.epsilon, epsilon_high=loss.epsilon_high,
        delta=loss.delta, importance_sampling_level=loss.importance_sampling_level,
        use_bias_correction_kl=loss.use_bias_correction_kl,
        sapo_temperature_pos=loss.sapo_temperature_pos, sapo_temperature_neg=loss.sapo_temperature_neg,
        vespo_k_pos=loss.vespo_k_pos, vespo_lambda_pos=loss.vespo_lambda_pos, vespo_k_neg=loss.vespo_k_neg,
        vespo_lambda_neg=loss.vespo_lambda_neg, top_entropy_quantile=loss.top_entropy_quantile,
        entropy_coef=loss.entropy_coef,
        use_vllm=False, vllm_mode="colocate", vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_max_model_length=cfg.vllm_max_model_length, vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size,
        vllm_enable_sleep_mode=cfg.vllm_enable_sleep_mode,
        vllm_importance_sampling_correction=cfg.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=cfg.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=cfg.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max,
        max_tool_calling_iterations=cfg.max_tool_calling_iterations,
        report_to=list(cfg.report_to), run_name=cfg.run_name, project=cfg.project,
        num_completions_to_print=cfg.num_completions_to_print,
        **TRL_PINNED,
        # bench plumbing: every step logged, nothing saved, no workers
        logging_steps=1, save_strategy="no", dataloader_num_workers=0,
    )


# the libraries each trainer loads; libs_rss_mib is the resident set once they are imported, before anything is built
LIBRARIES = {
    "grpo_fast": ("transformers.models.qwen2.modeling_qwen2", "math_verify", "grpo_fast.train.trainer"),
    "trl": ("transformers.models.qwen2.modeling_qwen2", "math_verify", "grpo_fast.train.trainer", "datasets",
            "trl.trainer.grpo_trainer"),
}


def _start(trainer: str, threads: int) -> dict:
    import importlib
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.set_num_threads(threads)
    harness.reset_peak_rss()
    start = dict(trainer=trainer, load_start=os.getloadavg()[0], t0=time.perf_counter())
    for module in LIBRARIES[trainer]:
        importlib.import_module(module)
    return dict(start, libs_rss_bytes=harness.rss_bytes())


def _result(start: dict, curve: list[dict], eval_before, eval_after, **extra) -> dict:
    return dict(start, curve=curve, eval_before=eval_before, eval_after=eval_after,
                peak_rss_bytes=harness.peak_rss_bytes(), load_end=os.getloadavg()[0],
                wall_s=time.perf_counter() - start["t0"], **extra)


# --------------------------------------------------------------------------------------------------------------------
# The two trainers (each runs inside an isolated child process)


def run_grpo_fast(steps: int, seed: int, threads: int, overrides: dict | None = None, paired: bool = False) -> dict:
    """grpo-fast's ``train`` on the default config; the per-step curve and the held-out rewards (``paired``: nothing
    changes, its prompt order and sampling stream are what a paired TRL run follows)."""
    start = _start("grpo_fast", threads)
    from grpo_fast.train import train
    from grpo_fast.train.metrics import read_steps

    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        summary = train(default_config(steps, seed, tmp, **(overrides or {})))
        curve = [dict(step=s["step"], reward=s["reward"], step_ms=1e3 * s["time_step_s"])
                 for s in read_steps(Path(tmp) / "metrics.jsonl")]
    return _result(start, curve, summary.eval_before, summary.eval_after)


def save_initial_model(directory, seed: int) -> str:
    """grpo-fast's tiny model for ``seed`` and its tokenizer, saved for ``from_pretrained``."""
    from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def build_trl_trainer(cfg, model_dir: str, output_dir: str, callbacks=(), records: list | None = None,
                      **trainer_kwargs):
    """TRL's ``GRPOTrainer`` for the run ``cfg`` describes, on the model saved in ``model_dir``; ``records``: these
    training records in this order (TRL's shuffle off) instead of the task's, shuffled by TRL; ``trainer_kwargs``:
    more arguments of ``GRPOTrainer`` (``rollout_func``)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grpo_fast.train.rewards import load_reward
    from grpo_fast.train.tasks import TASK_SIZE, builtin_records, tiny_tokenizer

    args = GRPOConfig(**trl_args(cfg, output_dir), **({} if records is None else {"shuffle_dataset": False}))
    dataset_name = cfg.dataset.split(":", 1)[1]
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=[load_reward(name) for name in cfg.rewards],
        args=args,
        train_dataset=Dataset.from_list(builtin_records(dataset_name, "train", TASK_SIZE) if records is None
                                        else records),
        processing_class=tiny_tokenizer(),  # not AutoTokenizer: that would rebuild Qwen2's BPE (tests/trl_fixtures)
        callbacks=list(callbacks),
        **trainer_kwargs,
    )


def paired_trl(trainer, cfg, steps: int):
    """Common random numbers for ``trainer`` (TRL's, built with ``records=paired_records(cfg, steps)``): before each
    generation TRL's global torch generator is seeded with the seed grpo-fast's sampler uses at that step
    (``grpo_fast.train.rollout.sampling_seed``), so that the two trainers draw their completions from one random
    stream and see the same prompts in the same order (lockstep_trl: the same weights and stream give the same
    completions). The two runs then differ only by what the trainers compute, and by float rounding once it tips a
    sample."""
    from grpo_fast.train.rollout import sampling_seed

    original = trainer._generate

    def generate(prompts):
        torch.manual_seed(sampling_seed(cfg.seed, trainer.state.global_step // cfg.mu, 0))
        return original(prompts)

    trainer._generate = generate
    return trainer


def paired_records(cfg, steps: int) -> list[dict]:
    """The training records of ``steps`` generations in the order grpo-fast's sampler hands them out."""
    from grpo_fast.train.data import PromptSampler
    from grpo_fast.train.tasks import TASK_SIZE, builtin_records

    sampler = PromptSampler(builtin_records(cfg.dataset.split(":", 1)[1], "train", TASK_SIZE), cfg.prompts_per_step,
                            seed=cfg.seed)
    return [r for _ in range(steps) for r in sampler.next_batch()]


def step_timer(after_step=None):
    """A ``TrainerCallback`` timing each of TRL's steps (its ``ms``: one wall time per step, ``PhaseTimer``): TRL's
    Trainer drives the loop, so its step hooks mark the steps' ends. ``after_step(state, model)``, when given, runs
    after each step's time is taken (a held-out evaluation, say), outside the timing."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.timer = PhaseTimer("cpu", ("step",))

        @property
        def ms(self) -> list[float]:
            return self.timer.ms["step"]

        def on_step_begin(self, args, state, control, **kwargs):
            self.timer.start("step")

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.timer.stop("step")
            if after_step is not None:
                after_step(state, model)

    return StepTimer()


def run_trl(steps: int, seed: int, threads: int, overrides: dict | None = None, paired: bool = False) -> dict:
    """TRL's ``GRPOTrainer`` on the same task, model weights and settings; the same outputs as ``run_grpo_fast``.
    ``paired``: grpo-fast's prompt order and sampling stream (:func:`paired_trl`)."""
    start = _start("trl", threads)
    from grpo_fast.train.distributed import PolicyForward
    from grpo_fast.train.evaluation import evaluate
    from grpo_fast.train.trainer import setup

    cfg = default_config(steps, seed, "unused", **(overrides or {}))
    timer = step_timer()
    # grpo-fast's own held-out evaluation (same prompts, greedy decoding, reward), pointed at TRL's model below;
    # set up first, so that TRL's Trainer seeds the random streams after it as it always does
    scorer = setup(cfg)
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        model_dir = save_initial_model(Path(tmp) / "model", seed)
        trainer = build_trl_trainer(cfg, model_dir, str(Path(tmp) / "out"), callbacks=[timer],
                                    records=paired_records(cfg, steps) if paired else None)
        if paired:
            paired_trl(trainer, cfg, steps)
        scorer.model, scorer.policy = trainer.model, PolicyForward(trainer.model)  # every pass goes through policy
        eval_before = evaluate(scorer)
        trainer.train()
        eval_after = evaluate(scorer)
    rewards = {h["step"]: h["reward"] for h in trainer.state.log_history if "reward" in h}
    curve = [dict(step=i + 1, reward=rewards.get(i + 1, math.nan), step_ms=ms) for i, ms in enumerate(timer.ms)]
    return _result(start, curve, eval_before, eval_after, trl=importlib.metadata.version("trl"))


# --------------------------------------------------------------------------------------------------------------------
# Driver


def summary_row(r: dict) -> dict:
    ms = [c["step_ms"] for c in r["curve"]]
    last = [c["reward"] for c in r["curve"][-FINAL_WINDOW:] if math.isfinite(c["reward"])]
    mib = lambda b: round(b / harness.MIB, 1)  # noqa: E731
    return dict(trainer=r["trainer"], steps=len(ms), median_step_ms=round(statistics.median(ms), 1),
                total_train_s=round(sum(ms) / 1e3, 1), peak_rss_mib=mib(r["peak_rss_bytes"]),
                libs_rss_mib=mib(r["libs_rss_bytes"]), run_peak_mib=mib(r["peak_rss_bytes"] - r["libs_rss_bytes"]),
                eval_before=round(r["eval_before"], 4), eval_after=round(r["eval_after"], 4),
                final_reward_avg=round(statistics.fmean(last), 4) if last else math.nan,
                wall_s=round(r["wall_s"], 1), load_avg_start=round(r["load_start"], 2),
                load_avg_end=round(r["load_end"], 2), trl=r.get("trl", ""), error="")


def curve_path(out: Path) -> Path:
    return out.with_name(out.stem + "_curve.csv")


def spread(values: list[float]) -> str:
    """``mean ± sample standard deviation (min-max, n)`` of the seeds' values."""
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f} ({min(values):.3f}-{max(values):.3f}, n={len(values)})"


def seed_table(rows: list[dict]) -> str:
    """Per trainer: mean ± sd over the seeds of the held-out reward after training and of the last-100-step reward."""
    body = []
    for name in TRAINERS:
        done = [r for r in rows if r["trainer"] == name and not r["error"]]
        if done:
            body.append([name, ", ".join(str(r["seed"]) for r in done),
                         spread([float(r["eval_after"]) for r in done]),
                         spread([float(r["final_reward_avg"]) for r in done]),
                         f"{statistics.median(float(r['median_step_ms']) for r in done):.0f}"])
    return harness.markdown_table(["trainer", "seeds", "held-out reward after (mean ± sd, min-max)",
                                   f"reward, last {FINAL_WINDOW} steps (mean ± sd, min-max)",
                                   "median ms / step"], body)


def plot(csv_path: Path, window: int = 25) -> Path:
    """The PNG (next to ``csv_path``) from the two CSVs alone: reward curves (each seed faint, the seeds' mean
    smoothed), step times, peak memory (median over the seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_fast.train.metrics import smooth

    rows = [r for r in harness.read_csv(csv_path) if not r["error"]]
    curves: dict[tuple[str, str], list[dict]] = {}
    for c in harness.read_csv(curve_path(csv_path)):
        curves.setdefault((c["trainer"], c.get("seed", "0")), []).append(c)
    colors = {"grpo_fast": "#1b7837", "trl": "#2166ac"}
    labels = {"grpo_fast": "grpo-fast", "trl": "TRL GRPOTrainer"}
    names = [n for n in TRAINERS if any(r["trainer"] == n for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [2.2, 2.2, 1]})
    for name in names:
        color, label = colors.get(name), labels.get(name, name)
        runs = [r for r in rows if r["trainer"] == name]
        per_seed = [curves[(name, r.get("seed", "0"))] for r in runs]
        steps = min(len(c) for c in per_seed)
        x = [int(c["step"]) for c in per_seed[0][:steps]]
        for curve in per_seed:
            axes[0].plot(x, [float(c["reward"]) for c in curve[:steps]], color=color, lw=0.5, alpha=0.2)
            axes[1].plot(x, [float(c["step_ms"]) for c in curve[:steps]], color=color, lw=0.5, alpha=0.4)
        mean = [statistics.fmean(float(c[i]["reward"]) for c in per_seed) for i in range(steps)]
        axes[0].plot(x, smooth(mean, window), color=color, lw=2,
                     label=f"{label}, mean of {len(per_seed)} seeds ({window}-step mean)")
        median_ms = statistics.median(float(r["median_step_ms"]) for r in runs)
        axes[1].plot([], [], color=color, label=f"{label} (median {median_ms:.0f} ms)")
    axes[0].set(xlabel="step", ylabel="mean reward of the step's samples", title="reward (default task)")
    axes[1].set(xlabel="step", ylabel="ms", title="step time", yscale="log")
    libs = [statistics.median(float(r["libs_rss_mib"]) for r in rows if r["trainer"] == n) for n in names]
    run = [statistics.median(float(r["run_peak_mib"]) for r in rows if r["trainer"] == n) for n in names]
    shown = [labels.get(n, n) for n in names]
    axes[2].bar(shown, libs, color="#cccccc", label="libraries imported")
    bars = axes[2].bar(shown, run, bottom=libs, color=[colors.get(n) for n in names], label="the run")
    axes[2].bar_label(bars, labels=[f"{a + b:.0f}" for a, b in zip(libs, run)])
    axes[2].set(ylabel="MiB", title="peak RSS of the process (median)")
    axes[2].legend(fontsize=8, loc="lower right")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(csv_path).with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def results_table(rows: list[dict]) -> str:
    headers = ["seed", "trainer", "steps", "median ms / step", "train s (sum of steps)", "peak RSS MiB",
               "of which libraries MiB", "held-out before", "held-out after", f"reward, last {FINAL_WINDOW} steps",
               "load avg start/end", "error"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["seed"], r["trainer"], "error"] + [""] * 8 + [r["error"][:80]])
            continue
        body.append([r["seed"], r["trainer"], r["steps"], r["median_step_ms"], r["total_train_s"], r["peak_rss_mib"],
                     r["libs_rss_mib"], f"{float(r['eval_before']):.3f}", f"{float(r['eval_after']):.3f}",
                     f"{float(r['final_reward_avg']):.3f}",
                     f"{float(r['load_avg_start']):.1f} / {float(r['load_avg_end']):.1f}", ""])
    return harness.markdown_table(headers, body)


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per trainer (default 800, the default run)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="model init, prompt order and sampling seeds; each runs both trainers (default 0 1 2)")
    p.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for both trainers (default 1)")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                   help="change a field of the default config for both trainers, e.g. group_size=8 (TrainConfig "
                        "names; TRL's settings follow through trl_args)")
    p.add_argument("--out", type=Path, default=harness.RESULTS_DIR / "peer_cpu.csv",
                   help="summary CSV; the curve goes to <out>_curve.csv and the plot to <out>.png")
    p.add_argument("--replot", action="store_true", help="only redraw <out>.png and print the tables from the CSVs")
    p.add_argument("--keep", action="store_true",
                   help="keep the finished runs of <out> (rows without error, and their curves) and run only the "
                        "missing (seed, trainer) pairs: a stopped benchmark continues, or another trainer is added")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per trainer process")
    p.add_argument("--paired", action="store_true",
                   help="common random numbers: TRL gets grpo-fast's prompt order and per-step sampling seeds, so the "
                        "two runs of a seed share their random stream and differ only by what the trainers compute")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.replot:
        rows = harness.read_csv(args.out)
        print(results_table(rows) + "\n\n" + seed_table(rows))
        print(f"plot: {plot(args.out)}")
        return 0
    threads = args.threads
    overrides = dict(item.split("=", 1) for item in args.set)
    for seed in args.seeds:  # a bad name or value, or an option TRL cannot reproduce, fails here, not in a child
        config = default_config(args.steps, seed, "unused", **overrides)
        if "trl" in args.trainers:
            trl_args(config, "unused")
    print(f"peer comparison on {harness.device_name('cpu')}, {threads} threads: default task, {args.steps} steps, "
          f"seeds {' '.join(map(str, args.seeds))}{'; ' + ' '.join(args.set) if args.set else ''}; trainers "
          f"{', '.join(args.trainers)}{'; paired (common random numbers)' if args.paired else ''}", flush=True)
    rows, curve_rows = [], []
    if args.keep and args.out.exists():
        rows = [r for r in harness.read_csv(args.out) if not r["error"]]
        kept = {(r["seed"], r["trainer"]) for r in rows}
        curve_rows = [c for c in harness.read_csv(curve_path(args.out)) if (c["seed"], c["trainer"]) in kept]
        print(f"  kept from {args.out}: {', '.join(f'seed {s} {t}' for s, t in sorted(kept)) or 'nothing'}")
    done = {(str(r["seed"]), r["trainer"]) for r in rows}
    for seed in args.seeds:
        for name in args.trainers:
            if (str(seed), name) in done:
                continue
            torch.set_num_threads(threads)  # env_fields records it
            env = harness.env_fields("cpu")
            print(f"  seed {seed} {name:>9} ... ", end="", flush=True)
            t0 = time.perf_counter()
            try:
                params = dict(steps=args.steps, seed=seed, threads=threads, overrides=overrides, paired=args.paired)
                r = harness.run_isolated(f"bench.bench_peer:run_{name}", params, timeout=args.timeout)
                row = summary_row(r)
                curve_rows += [dict(seed=seed, trainer=name, step=c["step"], reward=c["reward"],
                                    step_ms=round(c["step_ms"], 2)) for c in r["curve"]]
                print(f"{row['median_step_ms']:.0f} ms/step, peak {row['peak_rss_mib']:.0f} MiB, held-out "
                      f"{row['eval_before']:.3f} -> {row['eval_after']:.3f}, last-{FINAL_WINDOW} reward "
                      f"{row['final_reward_avg']:.3f}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            except harness.IsolatedError as e:
                row = dict(trainer=name, steps=args.steps, error=str(e))
                print(f"ERROR: {e}", flush=True)
            rows.append({"seed": seed, **row, "paired": args.paired, **env})
            # after every run: a stopped benchmark keeps what it finished
            harness.write_csv(args.out, rows)
            harness.write_csv(curve_path(args.out), curve_rows)
    png = plot(args.out) if curve_rows else None
    print()
    print(results_table(rows))
    print()
    print(seed_table(rows))
    print(f"\nCSV: {args.out}, {curve_path(args.out)}" + (f"; plot: {png}" if png else ""))
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
