"""``TrainConfig``: every option of ``grpo-fast train`` in one dataclass, loadable from TOML/YAML, overridable on
the command line (``--field value``, ``--loss.beta 0.04``). The help text of each field is its ``--help`` line."""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import json
import math
import numbers
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from grpo_fast.checks import FLOAT32_MAX, check_bool, temperature_value
from grpo_fast.config import GRPOLossConfig
from grpo_fast.dtypes import DTYPES

# the loss fields the trainer sets itself (from the sampling temperature, the model and max_new_tokens)
TRAINER_OWNED_LOSS_FIELDS = ("temperature", "softcap", "max_completion_length")
# the option behind each of them (softcap is the model's)
TRAINER_OWNED_FROM = {"temperature": "temperature", "max_completion_length": "max_new_tokens"}
# torch's generators take 64-bit seeds; numpy's and vLLM's (which seeds numpy) take the seed modulo 2**32
MAX_SEED = 2**64 - 1


DEFAULT_LOSS = GRPOLossConfig(beta=0.04)
# TRL's vllm_importance_sampling_mode values (grpo_fast.train.sampling_correction computes each)
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# transformers' / TRL's optimizer names (TrainingArguments.optim); the first is TRL's default (torch >= 2.8)
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which schedulers and taskset set), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class TrainConfig:
    # model
    model: str = _f("tiny", "'tiny' (the built-in 80k-parameter Qwen2 built from a config, trained from scratch) "
                    "or a local directory holding a transformers causal LM and its tokenizer (a config.json without weights: "
                    "that architecture with random weights)")
    tokenizer: str | None = _f(None, "tokenizer directory when it is not the model's")
    dtype: str = _f("auto", "compute dtype of the forward passes (autocast; trained weights stay float32): auto "
                    "(bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    device: str = _f("auto", "auto (cuda when available), cpu, cuda, cuda:N")
    threads: int | None = _f(None, "CPU threads for torch, at most the CPUs this process may use (None: 1 for the "
                             "tiny model, whose small matmuls gain nothing from more and stall when the machine is "
                             "busy; torch's default otherwise)")
    impl: str = _f("auto", "kernel path of the fused ops: auto (triton on CUDA), torch, triton, reference")
    lora_r: int = _f(0, "LoRA rank (0: train every parameter); the reference model is then the base with the "
                     "adapters disabled (needs peft)")
    lora_alpha: int = _f(16, "LoRA alpha")
    lora_target_modules: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj"], "modules that get LoRA adapters")
    merge_lora: bool = _f(False, "LoRA runs: write the adapters merged into the base weights to output_dir/model "
                          "(a plain model directory) instead of the adapter in PEFT's format; with load_in_4bit the "
                          "base's 4-bit weights dequantized, in float32")
    load_in_4bit: bool = _f(False, "QLoRA: the frozen base's decoder linear layers in 4 bits (bitsandbytes; the "
                            "embeddings, the lm_head and the norms stay in the compute dtype, which the 4-bit matmuls "
                            "compute in); needs lora_r > 0 and bitsandbytes (pip install 'grpo-fast[quant]')")
    bnb_4bit_quant_type: str = _f("nf4", "load_in_4bit's data type: nf4 (QLoRA's NormalFloat) or fp4")
    bnb_4bit_use_double_quant: bool = _f(True, "load_in_4bit: quantize the blocks' scales too (QLoRA's double "
                                         "quantization: 0.127 instead of 0.5 bits per weight for them)")
    gradient_checkpointing: bool = _f(False, "recompute decoder activations in the backward to save memory")
    distributed: str = _f("ddp", "under torchrun (WORLD_SIZE > 1): ddp (a replica per process) or fsdp2 (parameters, "
                          "gradients and optimizer states sharded with torch's fully_shard); ignored in one process")
    # data
    dataset: str = _f("builtin:digits", "builtin:NAME (digits, max) or a local .jsonl/.json/.parquet file with a "
                      "prompt column plus the columns the rewards need (answer, tests)")
    eval_dataset: str | None = _f(None, "held-out prompts for the before/after evaluation (a builtin task uses its "
                                  "own held-out split; a file dataset without one is not evaluated)")
    prompt_column: str = _f("prompt", "column that holds the prompt (a string or a list of chat messages)")
    system_prompt: str | None = _f(None, "system message put before each prompt when the tokenizer has a chat "
                                   "template")
    max_prompt_length: int = _f(512, "prompts longer than this many tokens are refused with an error")
    eval_size: int = _f(256, "prompts in the before/after evaluation (greedy decoding, one completion each)")
    # rewards
    rewards: list[str] = _f(["math"], "reward functions: math, exact, format, code, or module:function / "
                            "path.py:function; none: the environment's get_reward() alone (TRL's reward_funcs=[])")
    reward_weights: list[float] = _f([], "one weight per reward function (empty: all 1)")
    # GRPO
    steps: int = _f(800, "training steps; each samples one generation and makes mu optimizer updates on it")
    prompts_per_step: int = _f(16, "distinct prompts per generation")
    group_size: int = _f(16, "completions sampled per prompt (G)")
    mu: int = _f(1, "policy updates per generation (TRL's num_iterations); old log-probs are computed when > 1")
    generation_prompts: int = _f(0, "prompts sampled at once (their groups' KV caches bound generation memory; "
                                 "0: all prompts_per_step together)")
    micro_batch_size: int = _f(64, "completions per forward/backward; the generation's rows are accumulated")
    token_mean: str = _f("micro_batch", "what bnpo's token-mean loss and the entropy bonus average over: "
                         "micro_batch (TRL's: each micro-batch's token mean, the micro-batches' means averaged, so the "
                         "result depends on micro_batch_size) or generation (the token mean of the whole generation, "
                         "whatever the micro-batches)")
    disable_dropout: bool = _f(False, "switch every dropout of the policy and the reference off (TRL's "
                               "disable_dropout, default False; on, the old, reference and policy passes of a sample "
                               "see the same function)")
    shared_prefix: str = _f("auto", "run each group's prompt once per training forward (grpo_fast.shared_prefix_"
                            "forward): auto (when it cuts the tokens through the model by >= 1.3x and the model and "
                            "micro_batch_size allow it; otherwise one warning), on (an error when it cannot), off")
    max_new_tokens: int = _f(4, "longest completion; sampling stops earlier at EOS")
    temperature: float = _f(1.0, "sampling temperature (the loss uses the same)")
    top_p: float = _f(1.0, "nucleus sampling (1.0: off)")
    top_k: int = _f(0, "top-k sampling (0: off)")
    scale_rewards: str = _f("group", "advantage scaling: group (TRL default), batch, none")
    # tools (multi-turn rollouts; docs/agents.md)
    tools: list[str] = _f([], "tools the model may call in its completions (TRL's tools=): built-in calc, python, "
                          "or module:function / path.py:function, a typed function with a docstring (from Python "
                          "also the functions themselves); a call's result is fed back, never trained")
    environment: str | None = _f(None, "a class, module:Class or path.py:Class, one instance per completion (TRL's "
                                 "environment_factory): reset(**record) starts it (a returned string extends the "
                                 "prompt), its public methods are tools, an optional get_reward() a reward of "
                                 "weight 1")
    max_tool_calling_iterations: int | None = _f(None, "rounds of tool calls per completion (TRL's; None: as many "
                                                 "as max_new_tokens allows)")
    max_tool_response_length: int | None = _f(None, "a tool result longer than this many tokens is cut to it "
                                              "(counted in tools/truncated_results; None: no limit)")
    tool_timeout: float = _f(30.0, "seconds a tool call may run; a call past it is answered with an error message")
    tool_workers: int = _f(8, "tool calls of different completions run concurrently in this many threads")
    sft_warmup_steps: int = _f(0, "supervised steps on demonstrations of a built-in tool task (builtin:calc: the "
                               "calls written out) before GRPO, so the model knows the call format; 0: none")
    # rollout engine
    rollout: str = _f("auto", "the engine that samples completions: hf (grpo-fast's transformers loop on the policy "
                      "itself), vllm (vllm.LLM in this process, TRL's vllm_mode='colocate'; weights pushed after "
                      "every optimizer update), auto (vllm on one CUDA process when vLLM is installed and "
                      "the run is one it supports: no 4-bit base, no tensor parallelism; else hf)")
    vllm_gpu_memory_utilization: float = _f(0.3, "vllm: the fraction of GPU memory the engine may take for weights "
                                            "and KV cache (TRL's default; ignored when vllm_kv_cache_mib is set)")
    vllm_kv_cache_mib: int | None = _f(None, "vllm: the KV cache in MiB (None: on CUDA, vllm_gpu_memory_utilization "
                                       "decides; on a CPU, what one generation's rows need at full length, "
                                       "(generation_prompts or prompts_per_step) x group_size x "
                                       "(vllm_max_model_length + 32) tokens, since vLLM's own CPU default reserves "
                                       "most of host memory)")
    vllm_max_model_length: int | None = _f(None, "vllm: the longest prompt + completion (None: max_prompt_length + "
                                           "max_new_tokens, capped at the model's context)")
    vllm_tensor_parallel_size: int = _f(1, "vllm: GPUs the engine shards each model over (TRL's "
                                        "vllm_tensor_parallel_size)")
    vllm_enable_sleep_mode: bool = _f(False, "vllm: free the engine's GPU memory (weights and KV cache) during the "
                                      "policy update and take it back before generating (CUDA only)")
    vllm_importance_sampling_correction: bool = _f(True, "vllm: weight each token's loss by exp(trainer's old "
                                                   "log-prob - vLLM's sampling log-prob), the old log-probs "
                                                   "recomputed by the trainer (TRL's default)")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "token_truncate, token_mask, sequence_truncate or "
                                            "sequence_mask (TRL's default): a ratio per token or per sequence (the "
                                            "sum of the differences), clamped to the bounds or zeroed outside them")
    vllm_importance_sampling_clip_min: float | None = _f(None, "lower bound of the ratio (None: none)")
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "upper bound of the ratio (None: none)")
    loss: GRPOLossConfig = _f(DEFAULT_LOSS, "the GRPO loss (README: Semantics); set its fields with "
                              "--loss.NAME. beta defaults to 0.04 (the GRPO paper's KL weight) rather than TRL's 0.0")
    # optimisation
    lr: float | None = _f(None, "AdamW learning rate (None: 5e-4 for the tiny model, 1e-6 otherwise)")
    optim: str = _f("adamw_torch_fused", "the optimizer, by transformers' names (TRL's default): adamw_torch_fused "
                    "or adamw_torch (torch's AdamW, fused or not), adamw_8bit (bitsandbytes' 8-bit AdamW: 2 bytes of "
                    "states per trained parameter instead of 8), paged_adamw_8bit, paged_adamw_32bit (bitsandbytes, "
                    "states paged out to CPU memory when the GPU runs short: CUDA only)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_betas: list[float] = _f([0.9, 0.99], "AdamW betas")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0: no clipping)")
    warmup_steps: int = _f(10, "linear learning-rate warm-up, in optimizer updates (update k, counted from 0, "
                           "uses k / warmup_steps of lr: transformers' and TRL's schedules)")
    lr_schedule: str = _f("constant", "after warm-up: constant, linear (to 0), cosine (to 0)")
    # logging and checkpoints
    output_dir: str = _f("runs/grpo-fast", "metrics.jsonl, the plot, config.json, checkpoints/ and the trained model "
                         "(model/: a save_pretrained directory) go here")
    log_every: int = _f(1, "write a metrics line every N steps (TRL's logging_steps): to metrics.jsonl and the "
                        "--report-to trackers, and, when stderr is not a terminal, as a plain progress line")
    progress: bool = _f(True, "show progress: a bar when stderr is a terminal; otherwise (a log file, a pipe) one "
                        "plain line every log_every steps: step, reward, KL, loss, step time, ETA")
    plot: bool = _f(True, "write reward_kl.png (reward and KL, raw and smoothed) at every checkpoint and at the end "
                    "(needs matplotlib)")
    report_to: list[str] = _f(["none"], "experiment trackers that get every metrics.jsonl row, at its step, and the "
                              "run's config (TRL's report_to, with its default none): tensorboard (event files in "
                              "output_dir/tensorboard), wandb, trackio, a comma-separated list of them, all (those "
                              "whose client is installed) or none. Each needs its client (pip install "
                              "'grpo-fast[wandb]'); a missing client or a service out of reach is one warning and "
                              "the run goes on. Only rank 0 reports")
    run_name: str | None = _f(None, "the run's name in the trackers (TRL's run_name; None: wandb's and trackio's "
                              "generated names)")
    project: str | None = _f(None, "the trackers' project (TRL's project; None: $WANDB_PROJECT for wandb, else "
                             "grpo-fast)")
    log_completions_every: int = _f(0, "every N steps, the step's prompts, completions, each reward function's "
                                    "score, the total reward and the advantages go to output_dir/completions.jsonl "
                                    "and to each tracker's completions table (TRL's log_completions, which logs "
                                    "every logging_steps; 0: off). Rank 0's completions in a distributed run")
    num_completions_to_print: int | None = _f(4, "of those, how many are also printed to the log (TRL's "
                                              "num_completions_to_print; None: all, TRL's default; 0: none)")
    save_every: int = _f(100, "checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "how many checkpoints to keep, the newest (0: every one)")
    resume: bool = _f(False, "continue from the newest complete checkpoint in output_dir")
    overwrite: bool = _f(False, "start over in an output_dir that holds an earlier run (its checkpoints are deleted)")
    seed: int = _f(0, "seeds the model init, the prompt order, the sampling and the global Python, numpy and torch "
                   "generators (which a reward function may draw from)")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # numpy scalars (from Python callers) are numbers like any other
            value = getattr(self, f.name)
            if isinstance(value, list):
                setattr(self, f.name, [_from_numpy(x) for x in value])
            else:
                setattr(self, f.name, _from_numpy(value))
        if isinstance(self.loss, dict):
            self.loss = dataclasses.replace(DEFAULT_LOSS, **self.loss)
        for name in TRAINER_OWNED_LOSS_FIELDS:
            if getattr(self.loss, name) != getattr(GRPOLossConfig, name):
                raise ValueError(
                    f"TrainConfig.loss.{name} is set by the trainer (temperature from --temperature, softcap from "
                    f"the model, max_completion_length from --max-new-tokens); got loss.{name}="
                    f"{getattr(self.loss, name)!r}"
                )
        self.validate()

    def _validate_vllm(self):
        if not (isinstance(self.vllm_gpu_memory_utilization, (int, float)) and 0 < self.vllm_gpu_memory_utilization <= 1):
            raise ValueError("TrainConfig.vllm_gpu_memory_utilization must be in (0, 1], got "
                             f"{self.vllm_gpu_memory_utilization!r}")
        for name in ("vllm_kv_cache_mib", "vllm_max_model_length", "vllm_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainConfig.{name} must be an int >= 1{' or None' if name != 'vllm_tensor_parallel_size' else ''}, got {value!r}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for name, value in (("vllm_importance_sampling_clip_min", low), ("vllm_importance_sampling_clip_max", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"TrainConfig.{name} must be a number >= 0 or None, got {value!r}")
        if low is not None and high is not None and low > high:
            raise ValueError(f"TrainConfig.vllm_importance_sampling_clip_min ({low}) must be <= "
                             f"vllm_importance_sampling_clip_max ({high})")

    def _validate_tools(self):
        if not isinstance(self.tools, list) or any(not (callable(t) or (isinstance(t, str) and t.strip()))
                                                   for t in self.tools):
            raise ValueError(f"TrainConfig.tools must be a list of tool names, module:function / path.py:function "
                             f"specs or functions, got {reprlib.repr(self.tools)}")
        if self.environment is not None and not (callable(self.environment) or (isinstance(self.environment, str)
                                                                               and self.environment.strip())):
            raise ValueError(f"TrainConfig.environment must be None, a class or a module:Class / path.py:Class spec, "
                             f"got {reprlib.repr(self.environment)}")
        for name in ("max_tool_calling_iterations", "max_tool_response_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainConfig.{name} must be an int >= 1 or None, got {value!r}")
        if isinstance(self.tool_workers, bool) or not isinstance(self.tool_workers, int) or self.tool_workers < 1:
            raise ValueError(f"TrainConfig.tool_workers must be an int >= 1, got {self.tool_workers!r}")
        if (isinstance(self.tool_timeout, bool) or not isinstance(self.tool_timeout, (int, float))
                or not 0 < self.tool_timeout < math.inf):
            raise ValueError(f"TrainConfig.tool_timeout must be a finite number of seconds > 0, got "
                             f"{self.tool_timeout!r}")
        if isinstance(self.sft_warmup_steps, bool) or not isinstance(self.sft_warmup_steps, int) \
                or self.sft_warmup_steps < 0:
            raise ValueError(f"TrainConfig.sft_warmup_steps must be an int >= 0, got {self.sft_warmup_steps!r}")

    def _validate_reporting(self):
        from grpo_fast.train.tracking import check_report_to

        check_report_to(self.report_to)
        for name in ("run_name", "project"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(f"TrainConfig.{name} must be a non-empty string or None, got {value!r}")
        every = self.log_completions_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"TrainConfig.log_completions_every must be an int >= 0 (0: off), got {every!r}")
        shown = self.num_completions_to_print
        if shown is not None and (isinstance(shown, bool) or not isinstance(shown, int) or shown < 0):
            raise ValueError(f"TrainConfig.num_completions_to_print must be an int >= 0 or None (all), got {shown!r}")

    def validate(self):
        for f in dataclasses.fields(self):  # from Python, "no" or 1 would read as true
            if _annotation(TrainConfig, f.name) is bool:
                check_bool(f"TrainConfig.{f.name}", getattr(self, f.name))
        choices = {
            "dtype": ("auto", *DTYPES),
            "impl": ("auto", "torch", "triton", "reference"),
            "shared_prefix": ("auto", "on", "off"),
            "token_mean": ("micro_batch", "generation"),
            "distributed": ("ddp", "fsdp2"),
            "scale_rewards": ("group", "batch", "none"),
            "lr_schedule": ("constant", "linear", "cosine"),
            "optim": OPTIMIZERS,
            "bnb_4bit_quant_type": ("nf4", "fp4"),
            "rollout": ("auto", "hf", "vllm"),
            "vllm_importance_sampling_mode": IMPORTANCE_SAMPLING_MODES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"TrainConfig.device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if not isinstance(self.output_dir, (str, os.PathLike)) or not str(self.output_dir).strip():
            # "" is the current directory to pathlib: a run would write (and --overwrite delete) there
            raise ValueError(f"TrainConfig.output_dir must name a directory, got {self.output_dir!r}")
        self._validate_reporting()
        positive = ("steps", "prompts_per_step", "group_size", "mu", "micro_batch_size", "max_new_tokens",
                    "max_prompt_length", "eval_size", "log_every")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("lora_r", "warmup_steps", "save_every", "keep_checkpoints", "seed", "generation_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {value!r}")
        if self.shared_prefix == "on" and self.micro_batch_size % self.group_size:
            raise ValueError(f"TrainConfig.shared_prefix 'on' needs whole groups in every micro-batch: micro_batch_size "
                             f"must be a multiple of group_size {self.group_size}, got {self.micro_batch_size}")
        self._validate_vllm()
        if self.group_size < 2:
            raise ValueError(f"TrainConfig.group_size must be >= 2 (advantages compare a group's completions), "
                             f"got {self.group_size}")
        for name, low, high in (("top_p", 0.0, 1.0), ("weight_decay", 0.0, FLOAT32_MAX),
                                ("max_grad_norm", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
                raise ValueError(f"TrainConfig.{name} must be in [{low}, {high:.3g}], got {value!r}")
        if self.top_p == 0.0:
            raise ValueError("TrainConfig.top_p must be > 0 (1.0 switches nucleus sampling off), got 0.0")
        if self.temperature == 0.0:
            raise ValueError("TrainConfig.temperature must be > 0 for training (GRPO needs diverse samples), got 0.0")
        temperature_value("TrainConfig.temperature", self.temperature)  # sampling's and the loss's
        check_seed("TrainConfig.seed", self.seed)
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"TrainConfig.threads must be an int >= 1 or None, got {self.threads!r}")
        if self.threads is not None and self.threads > (cpus := usable_cpus()):
            # torch's thread pools at thousands of threads crash the process (a segmentation fault in step 1)
            raise ValueError(f"TrainConfig.threads must be at most the {cpus} CPUs this process may use, got "
                             f"{self.threads}")
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))
                                    or not (0 < self.lr < math.inf)):
            raise ValueError(f"TrainConfig.lr must be a finite number > 0 or None, got {self.lr!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"TrainConfig.top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, int) or self.lora_alpha < 1:
            raise ValueError(f"TrainConfig.lora_alpha must be an int >= 1, got {self.lora_alpha!r}")
        if self.resume and self.overwrite:
            raise ValueError("TrainConfig.resume and TrainConfig.overwrite exclude each other (resume continues the "
                             "run in output_dir, overwrite deletes its checkpoints and starts over); pass one, got both")
        if self.load_in_4bit and not self.lora_r:
            raise ValueError("TrainConfig.load_in_4bit needs LoRA (lora_r > 0): the 4-bit base is frozen and only "
                             "adapters train on it; pass --lora-r R (e.g. 16), got lora_r=0")
        if self.merge_lora and not self.lora_r:
            raise ValueError("TrainConfig.merge_lora needs a LoRA run (lora_r > 0): a full fine-tune writes full "
                             "weights already; got lora_r=0")
        if "none" in self.rewards:
            if self.rewards != ["none"]:
                raise ValueError(f"TrainConfig.rewards: none stands alone (the environment's get_reward() as the "
                                 f"only reward), got {self.rewards}")
            self.rewards = []  # the environment's reward alone (checked where the environment is loaded)
        if not self.rewards and not self.environment:
            raise ValueError("TrainConfig.rewards must name at least one reward function (or none with an environment "
                             "whose get_reward() scores the rows), got an empty list")
        bad = [w for w in self.reward_weights if isinstance(w, bool) or not isinstance(w, (int, float))
               or not math.isfinite(w)]
        if bad:
            raise ValueError(f"TrainConfig.reward_weights must be finite numbers, got {self.reward_weights!r}")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"TrainConfig.reward_weights must have one weight per reward ({len(self.rewards)}: "
                             f"{self.rewards}), got {len(self.reward_weights)}: {self.reward_weights}")
        self._validate_tools()
        if len(self.adam_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"TrainConfig.adam_betas must be two numbers in [0, 1), got {self.adam_betas!r}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["loss"] = json.loads(self.loss.to_json())
        out["tools"] = [object_spec(t) for t in self.tools]  # functions from Python: the spec that names them
        out["environment"] = None if self.environment is None else object_spec(self.environment)
        return out


def object_spec(value) -> str:
    """A tool's or an environment's spec as config.json records it: a string as given, a function or class as
    ``module:qualified_name``."""
    if isinstance(value, str):
        return value
    return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"


def config_changes(saved: dict, now: dict, keep=(), prefix: str = "") -> list[str]:
    """``"name: old -> new"`` for every option whose value differs between two :meth:`TrainConfig.to_dict` dicts,
    nested ones (the loss's) field by field (``loss.beta: 0.04 -> 0.1``, not both whole dicts); options named in
    ``keep`` are left out, and one missing from ``saved`` (an older run's) counts as None there."""
    changes = []
    for name in sorted(now):
        old, new = saved.get(name), now[name]
        if prefix + name in keep or old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, keep, f"{prefix}{name}.")
        else:
            changes.append(f"{prefix}{name}: {_short(old)} -> {_short(new)}")
    return changes


_REPR = reprlib.Repr()  # a saved value can be anything a checkpoint holds: shown short, never walked whole
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 8
_REPR.maxlevel = 3


def _short(value) -> str:
    try:
        return _REPR.repr(value)
    except Exception:  # a repr that raises (an int past 4300 digits)
        return f"<a {type(value).__name__}>"


def check_seed(label: str, seed) -> int:
    """A seed in ``[0, MAX_SEED]``, which every generator a run seeds takes (``label`` names it)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{label} must be an int in [0, {MAX_SEED}] (torch's generators take 64-bit seeds), "
                         f"got {seed!r}")
    return seed


# ---------------------------------------------------------------------------------------------- files and flags


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _annotation(cls, name):
    return _hints(cls)[name]


def _parse_value(cls, name: str, raw):
    """Converts a command-line string (or a TOML/YAML value) to the field's type; errors name the field."""
    hint = _annotation(cls, name)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and str in args:  # ``LossType | str``: validated by the target
        return raw
    try:
        if optional and raw is None:  # JSON's and YAML's null
            return None
        if isinstance(raw, str):
            if optional and raw.lower() in ("none", "null"):
                return None
            if origin is list:
                return [args[0](x.strip()) for x in raw.split(",") if x.strip()]
            if hint is bool:
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("expected true or false")
            return hint(raw)
        if origin is list:
            if not isinstance(raw, (list, tuple)):
                raise ValueError("expected a list")
            return [_plain(x, args[0], f"item {i}") for i, x in enumerate(raw)]
        return _plain(raw, hint, None)
    except (TypeError, ValueError) as e:
        type_name = f"a list of {args[0].__name__}" if origin is list else getattr(hint, "__name__", str(hint))
        raise ValueError(f"{cls.__name__}.{name}: expected {type_name}{' or None' if optional else ''}, "
                         f"got {raw!r} ({e})") from None


def _from_numpy(value):
    """A numpy scalar (or 0-d array) as the Python bool, int or float it holds; anything else as it is."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _plain(value, hint, where: str | None):
    """A file's value (TOML, YAML, or a dict from Python) as ``hint``: numbers of any kind that registers with
    ``numbers`` (numpy scalars included) become int or float; a str, list or bool must be one. Other hints
    (enums, dataclasses) are left to the field's own validation."""
    prefix = f"{where} is " if where else ""
    is_bool = isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")  # numpy's is no bool subclass
    if hint is bool:
        if not is_bool:
            raise ValueError(f"{prefix}{type(value).__name__}, expected true or false")
        return bool(value)
    if hint is int:
        if is_bool or not isinstance(value, numbers.Integral):
            raise ValueError(f"{prefix}{type(value).__name__}, expected a whole number")
        return int(value)
    if hint is float:
        if is_bool or not isinstance(value, numbers.Real):
            raise ValueError(f"{prefix}{type(value).__name__}, expected a number")
        return float(value)
    if hint is str and isinstance(value, os.PathLike):
        return os.fspath(value)
    if hint is str and not isinstance(value, str):
        raise ValueError(f"{prefix}{type(value).__name__}, expected a string")
    return value


# a run's config.json: how that run started, not an option of the run it describes
RUN_ACTIONS = ("resume", "overwrite")
# TRL's GRPOConfig names for options that mean exactly what grpo-fast's mean: taken as flags and in config files
TRL_ALIASES = {"learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
               "num_iterations": "mu"}
# TRL's names for what grpo-fast splits otherwise: refused, with the options to use
TRL_NEAR = {"per_device_train_batch_size": "did you mean --micro-batch-size? (completions per forward/backward on a "
            "device, as TRL's per_device_train_batch_size counts them; TRL also sizes each generation from it, "
            "grpo-fast from --prompts-per-step x --group-size)",
            "gradient_accumulation_steps": "grpo-fast accumulates over each step's --prompts-per-step x --group-size "
            "completions in micro-batches of --micro-batch-size (one optimizer update per generation, times --mu)",
            "logging_steps": "did you mean --log-every? (that step's row every N steps; TRL averages the steps since "
            "its last log)",
            **{name: f"did you mean --loss.{name}? (the loss's options are --loss.NAME, TRL's names)" for name in (
                "beta", "loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
                "top_entropy_quantile", "entropy_coef", "use_bias_correction_kl")}}


def run_options(output_dir: str | Path) -> dict:
    """The options of the run in ``output_dir``, from the ``config.json`` every run writes there: what ``--resume``
    continues with where no flag or ``--config`` sets an option ({} without that file). Left out: ``output_dir``
    (the run is the directory it was read from, wherever it moved) and :data:`RUN_ACTIONS`."""
    path = Path(output_dir) / "config.json"
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--resume: {path}, the run's options, cannot be read ({e}); give the run's options again "
                         "with --config FILE or flags") from None
    if not isinstance(values, dict):
        raise ValueError(f"--resume: {path} must hold the run's options as a JSON object, got "
                         f"{type(values).__name__}")
    return {k: v for k, v in values.items() if k not in (*RUN_ACTIONS, "output_dir")}


def read_config_file(path: str | Path) -> dict:
    """A TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON (``.json``: a run's own ``config.json``, whose
    ``resume`` and ``overwrite`` are left out, see :data:`RUN_ACTIONS`) file -> a dict of fields (``[loss]`` a
    nested table)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: {'not a file' if path.exists() else 'no such file'} {str(path)!r}")
    if path.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # the message says the line and column
            raise ValueError(f"--config: {path} is not valid TOML: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ImportError("--config: reading YAML needs PyYAML (pip install pyyaml), or use a .toml file") from None
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)  # 0-based
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--config: {path} is not valid YAML{where}: {problem}") from None
        data = {} if data is None else data
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--config: {path} is not valid JSON: {e}") from None
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in RUN_ACTIONS}
    else:
        raise ValueError(f"--config: expected a .toml, .yaml, .yml or .json (a run's config.json) file, got "
                         f"{str(path)!r}")
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a table of fields, got {type(data).__name__}")
    return data


def build_config(file_values: dict | None = None, overrides: dict[str, str] | None = None,
                 file_name: str = "config file", saved: dict | None = None,
                 saved_name: str = "the run's config.json") -> TrainConfig:
    """Defaults < ``saved`` < file values < command-line overrides. ``overrides`` keys are field names (``loss.beta``
    for the loss; TRL's names of the same options, :data:`TRL_ALIASES`, too). Unknown names raise an error that lists
    the nearest known ones; errors in ``file_values`` start with ``file_name``. ``saved``: a run's own options
    (:func:`run_options`, what ``--resume`` continues with), those this version does not have dropped; errors in
    them start with ``saved_name``."""
    values: dict = {}
    loss: dict = {}
    from_file: set[str] = set()  # the options whose value is the file's (a flag over one takes it back)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    loss_known = {f.name for f in dataclasses.fields(GRPOLossConfig)}

    def put(name, raw, source):
        name = TRL_ALIASES.get(name, name)
        if name.startswith("loss."):
            key = name[len("loss."):]
            if key not in loss_known:
                raise ValueError(_unknown(f"{source}: unknown loss option {key!r}", key, loss_known))
            loss[key] = _parse_value(GRPOLossConfig, key, raw)
            (from_file.add if source == file_name else from_file.discard)(name)
        elif name == "loss":
            if not isinstance(raw, dict):
                raise ValueError(f"{source}: loss must be a table of loss options ([loss] in TOML, a mapping in "
                                 f"YAML, --loss.NAME on the command line), got {raw!r}")
            for k, v in raw.items():
                put(f"loss.{k}", v, source)
        elif name in known and name != "loss":
            values[name] = _parse_value(TrainConfig, name, raw)
            (from_file.add if source == file_name else from_file.discard)(name)
        elif name in TRL_NEAR:
            raise ValueError(f"{source}: unknown option {name!r}; {TRL_NEAR[name]}")
        else:
            raise ValueError(_unknown(f"{source}: unknown option {name!r}", name, known | {"loss.*"}))

    for name, raw in (saved or {}).items():  # the run's own options: only those this version has
        if not isinstance(name, str) or name.replace("-", "_") not in known:
            continue
        if name == "loss" and isinstance(raw, dict):  # the fields the trainer sets are recorded at their defaults
            raw = {k: v for k, v in raw.items() if k in loss_known and k not in TRAINER_OWNED_LOSS_FIELDS}
        try:
            put(name.replace("-", "_"), raw, saved_name)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith(saved_name) else f"{saved_name}: {e}") from None
    for name, raw in (file_values or {}).items():
        if not isinstance(name, str):  # YAML keys may be numbers or booleans
            raise ValueError(f"{file_name}: option names are strings, got {name!r}")
        try:
            put(name.replace("-", "_"), raw, file_name)
        except ValueError as e:  # a bad value names the file it came from
            raise ValueError(str(e) if str(e).startswith(file_name) else f"{file_name}: {e}") from None
    for name, raw in (overrides or {}).items():
        put(name.replace("-", "_"), raw, "command line")
    try:  # the values' own checks (GRPOLossConfig's, TrainConfig.validate): one on a file's value names the file
        if loss:
            values["loss"] = dataclasses.replace(DEFAULT_LOSS, **loss)
        return TrainConfig(**values)
    except ValueError as e:
        named = {_option_name(*m) for m in re.findall(r"\b(TrainConfig|GRPOLossConfig)\.(\w+(?:\.\w+)?)", str(e))}
        if named & from_file:
            raise ValueError(f"{file_name}: {e}") from None
        raise


def resumed_config(file_values: dict | None = None, overrides: dict[str, str] | None = None,
                   file_name: str = "config file") -> TrainConfig:
    """:func:`build_config`, and with ``resume`` over the options of the run being resumed (:func:`run_options`:
    its ``config.json``): ``--resume --output-dir DIR`` alone continues the run as it was; an option the file or
    the flags set is taken as given (and checked against the checkpoint's when it loads)."""
    def given(name: str, default):
        for source in (overrides or {}, file_values or {}):
            for key in (name, name.replace("_", "-")):
                if key in source:
                    return _parse_value(TrainConfig, name, source[key])
        return default

    resume, output_dir = given("resume", False), given("output_dir", TrainConfig.output_dir)
    saved = run_options(output_dir) if resume is True and isinstance(output_dir, str) else {}
    return build_config(file_values, overrides, file_name=file_name, saved=saved,
                        saved_name=f"--resume: {Path(output_dir) / 'config.json'}")


def _option_name(owner: str, field: str) -> str:
    """The option a message's ``GRPOLossConfig.beta`` / ``TrainConfig.loss.beta`` / ``TrainConfig.steps`` names:
    ``loss.beta``, ``loss.beta``, ``steps``."""
    return f"loss.{field}" if owner == "GRPOLossConfig" else field


def _unknown(message: str, name: str, known) -> str:
    import difflib

    near = difflib.get_close_matches(name, sorted(known), n=3)
    return message + (f"; did you mean {', '.join(near)}?" if near else f"; known: {', '.join(sorted(known))}")


# --help groups the options: each section starts at the named field and runs to the next one (field order)
SECTIONS = {"model": "model", "dataset": "data", "rewards": "rewards", "steps": "GRPO",
            "tools": "tools (multi-turn rollouts, TRL's tools= and environment_factory=)",
            "rollout": "rollout engine",
            "loss": "loss (TRL 1.16's GRPOTrainer semantics; dppo_tv, dppo_kl, gpg, dro: verl 0.9.1's)", "lr": "optimisation",
            "output_dir": "logging and checkpoints"}


def field_help() -> list[tuple[str, str, str, str]]:
    """(section, flag, default, help) for every option, the loss's fields included (for ``--help``): the help
    of a field is its ``help`` metadata, ``TrainConfig``'s and ``GRPOLossConfig``'s alike."""
    rows = []
    section = ""
    for f in dataclasses.fields(TrainConfig):
        section = SECTIONS.get(f.name, section)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "loss":
            for lf in dataclasses.fields(GRPOLossConfig):
                if lf.name in TRAINER_OWNED_LOSS_FIELDS:
                    continue
                value = getattr(default, lf.name)
                rows.append((section, f"--loss.{lf.name}", _show(value), lf.metadata["help"]))
            continue
        rows.append((section, f"--{f.name.replace('_', '-')}", _show(default), f.metadata["help"]))
    return rows


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "(empty)"
    return getattr(value, "value", value).__str__()
