"""A run's held-out evaluation (:func:`evaluate`, before and after training) and ``grpo-fast eval``: the same
evaluation for any saved model.

The model directory is what a run leaves in ``output_dir/model`` or what ``grpo-fast export`` writes: full weights,
or a PEFT adapter (loaded onto its base model and merged). The prompts, the reward functions, the chat template and
the generation are the trainer's (``rollout.rollout``, ``rewards.score``), so greedy decoding of the held-out split
of a run reproduces its ``eval_after`` exactly. With ``samples`` K > 1 every prompt gets K completions sampled at
``temperature``: mean@K is the mean reward over all of them, pass@K the fraction of prompts with at least one
completion whose (weighted) reward reaches ``pass_threshold``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("grpo_fast.train")

ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_MAX_NEW_TOKENS = 256  # when the model's generation_config.json does not say
RESULT_FILE = "eval.json"  # the default --output, inside the model directory
# the TrainConfig fields evaluate_model fills from eval's flags: an error about one names the flag the user typed
_FLAGS = {"model": "--model", "tokenizer": "--model", "dataset": "--dataset", "eval_dataset": "--dataset",
          "rewards": "--rewards", "reward_weights": "--reward-weights", "eval_size": "--limit",
          "micro_batch_size": "--batch-size", "max_new_tokens": "--max-new-tokens", "prompt_column": "--prompt-column",
          "system_prompt": "--system-prompt", "max_prompt_length": "--max-prompt-length", "device": "--device",
          "dtype": "--dtype", "seed": "--seed", "tools": "--tools", "environment": "--environment",
          "max_tool_calling_iterations": "--max-tool-calling-iterations",
          "max_tool_response_length": "--max-tool-response-length"}


@torch.no_grad()
def evaluate(run, samples: int = 1, params=None, scores: list[torch.Tensor] | None = None,
             completions_out: list[list] | None = None,
             function_scores: list[torch.Tensor] | None = None) -> float | None:
    """Mean weighted reward of the held-out prompts' completions (None without any prompts, or when no reward
    function scored any of them: every one returned None): one greedy completion per prompt by default (the run's
    before/after evaluation), or ``samples`` completions per prompt drawn with ``params``. ``scores``, when given,
    receives one ``[samples]`` tensor of weighted rewards per prompt this rank scored, in order, NaN for a completion
    no function scored (``grpo-fast eval``'s pass@k); ``completions_out``, when given, the ``samples`` completions of
    each of those prompts (text, or a multi-turn completion's messages); ``function_scores``, when given, one
    ``[samples, functions]`` tensor per prompt of each reward source's own score (NaN: that function returned
    None). ``run`` is the trainer's ``Run``, ``params`` a
    ``SamplingParams``; completions are sampled and scored as in training (``rollout.rollout``, ``rewards.score``), by
    grpo-fast's own sampler on the policy whatever the run's rollout engine."""
    from grpo_fast.bnb_layout import inference_layout
    from grpo_fast.train import distributed as dist_
    from grpo_fast.train.forward import unwrap
    from grpo_fast.train.rewards import score, weighted_reward
    from grpo_fast.train.rollout import HFEngine, SamplingParams, rollout

    if not run.eval_records:
        return None
    params = params or SamplingParams(max_new_tokens=run.config.max_new_tokens, temperature=0.0)
    world = run.world
    mine = run.eval_records[world.rank :: world.size]  # greedy: any split gives the same completions
    total, scored = 0.0, 0
    chunk = max(1, run.config.micro_batch_size // samples)  # prompts per generation call
    # every rank makes the same number of generation calls (FSDP2 gathers weights in each); surplus calls are empty
    calls = math.ceil(math.ceil(len(run.eval_records) / world.size) / chunk)
    engine = HFEngine(run)
    # a repacked 4-bit layout (bnb_layout) is taken once for all the calls, not once per call
    with inference_layout(unwrap(run.model), engine.packed_4bit):
        for i in range(calls):
            part = mine[i * chunk : (i + 1) * chunk]
            # a surplus call generates, unscored; sampling seeds differ per call and rank
            # always on the policy itself (hf): held-out scores compare across rollout engines
            ro, completions = rollout(run, part or run.eval_records[:1], samples, params,
                                      first_chunk=world.rank * calls + i, engine=engine)
            if part:
                traced = ro.trace  # with tools: prompts as reset() extended them, and the environments
                per_function = score(run, part if traced is None else traced.records, completions, samples,
                                     None if traced is None else traced.environments)
                rewards = weighted_reward(run, per_function)
                total += float(rewards.sum())
                unscored = per_function.isnan().all(dim=1)  # every function returned None
                scored += int((~unscored).sum())
                if scores is not None:
                    scores.extend(rewards.masked_fill(unscored, math.nan).view(len(part), samples))
                if completions_out is not None:
                    completions_out.extend(list(completions[j * samples : (j + 1) * samples])
                                           for j in range(len(part)))
                if function_scores is not None:
                    function_scores.extend(per_function.view(len(part), samples, -1))
    total, scored = dist_.sum_across([total, float(scored)], world, run.device)
    if not scored:
        logger.warning("held-out evaluation: no reward function scored any of the %d completions (all returned None)",
                       len(run.eval_records) * samples)
        return None
    return total / (len(run.eval_records) * samples)


@dataclass
class EvalOptions:
    """What ``grpo-fast eval`` takes; ``check`` names the flag of a bad value."""

    model: str
    dataset: str
    rewards: list[str] = field(default_factory=lambda: ["math"])
    reward_weights: list[float] = field(default_factory=list)
    samples: int = 1
    temperature: float | None = None  # None: greedy for one sample, 1.0 for several
    top_p: float = 1.0
    max_new_tokens: int | None = None  # None: the model's generation_config max_new_tokens, else 256
    limit: int | None = None
    batch_size: int = 64
    prompt_column: str = "prompt"
    system_prompt: str | None = None
    max_prompt_length: int = 512
    pass_threshold: float = 1.0
    base_model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    tools: list[str] = field(default_factory=list)  # as the run's --tools: the model calls them as in training
    environment: str | None = None
    max_tool_calling_iterations: int | None = None
    max_tool_response_length: int | None = None

    def check(self) -> None:
        for flag, value in (("--samples", self.samples), ("--batch-size", self.batch_size),
                            ("--max-prompt-length", self.max_prompt_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}: expected an int >= 1, got {value!r}")
        for flag, value in (("--limit", self.limit), ("--max-new-tokens", self.max_new_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag}: expected an int >= 1, got {value!r}")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature: expected a number >= 0 (0: greedy), got {self.temperature!r}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"--temperature 0 is greedy decoding: the {self.samples} samples of --samples would all "
                             "be the same completion; sample with a temperature > 0, or use --samples 1")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"--top-p: expected a number in (0, 1], got {self.top_p!r}")
        if not math.isfinite(self.pass_threshold):
            raise ValueError(f"--pass-threshold: expected a finite number, got {self.pass_threshold!r}")
        if not self.rewards:
            raise ValueError("--rewards: expected at least one reward function (or none with an --environment whose "
                             "get_reward() scores the rows), got none")
        if "none" in self.rewards and self.rewards != ["none"]:
            raise ValueError(f"--rewards: none stands alone (the --environment's get_reward() as the only reward), "
                             f"got {','.join(self.rewards)}")
        if self.rewards == ["none"] and not self.environment:
            raise ValueError("--rewards none leaves the environment's get_reward() as the only reward: pass "
                             "--environment, got none")
        functions = [r for r in self.rewards if r != "none"]
        if self.reward_weights and len(self.reward_weights) != len(functions):
            raise ValueError(f"--reward-weights: expected one weight per reward function ({len(functions)}), got "
                             f"{len(self.reward_weights)}")
        model = Path(self.model)
        if not model.is_dir() or not ((model / "config.json").is_file() or (model / ADAPTER_CONFIG).is_file()):
            raise FileNotFoundError(f"--model: expected a model directory (output_dir/model of a run, or grpo-fast "
                                    f"export's OUT_DIR: config.json or {ADAPTER_CONFIG} inside), got {self.model!r}")
        if not self.dataset.startswith("builtin:") and not Path(self.dataset).is_file():
            raise FileNotFoundError(f"--dataset: expected builtin:NAME or a .jsonl/.json/.parquet file, got "
                                    f"{self.dataset!r}")

    @property
    def sampling_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.samples == 1 else 1.0


def load_saved_model(directory: str | Path, config, base_model: str | None = None):
    """(model, tokenizer) of a saved model directory, in eval mode, parameters in the compute dtype: full weights
    through the trainer's loader, or a PEFT adapter on its base (``base_model``, else the adapter's
    ``base_model_name_or_path``), merged."""
    import dataclasses

    from grpo_fast.train.checkpoint import check_weights
    from grpo_fast.train.model import load_model_and_tokenizer, resolve_device, resolve_dtype

    directory = Path(directory)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    adapter = directory / ADAPTER_CONFIG
    if not adapter.is_file():
        check_weights(directory, "--model", "model")
        model, tokenizer = load_model_and_tokenizer(config, device, dtype)
        return model.eval(), tokenizer
    try:
        from peft import PeftModel
    except ImportError:
        raise ImportError(f"--model: {directory} holds a LoRA adapter; loading it needs peft (pip install peft)"
                          ) from None
    base = base_model or json.loads(adapter.read_text()).get("base_model_name_or_path") or ""
    if not base or not Path(base).is_dir():
        raise FileNotFoundError(
            f"--base-model: the adapter in {directory} needs its base model directory; its {ADAPTER_CONFIG} names "
            f"{base!r}, which is not a directory (the built-in tiny model has none: export its run with --merge-lora)"
        )
    check_weights(directory, "--model", "adapter_model")
    check_weights(Path(base), "--base-model", "model")
    base_config = dataclasses.replace(config, model=base, tokenizer=str(directory))
    model, tokenizer = load_model_and_tokenizer(base_config, device, dtype)
    model = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    return model.eval(), tokenizer


def _flag_named(message: str) -> str:
    """``message`` with the TrainConfig fields eval sets from its flags named as those flags."""
    return re.sub(r"\bTrainConfig\.(\w+)", lambda m: _FLAGS.get(m.group(1), m.group(0)), message)


def evaluate_model(options: EvalOptions) -> dict:
    """Runs the evaluation; returns the JSON-ready result (the options, the metrics and every prompt's rewards).
    Errors about the options name eval's flags (``--device``), not the trainer's fields behind them."""
    from grpo_fast.train.rewards import RewardError

    try:
        return _evaluate(options)
    except RewardError:  # a reward function's failure names the function, not a flag
        raise
    except (ValueError, TypeError, OSError) as e:
        named = _flag_named(str(e))
        if named == str(e):
            raise
        raise type(e)(named) from None


def _evaluate(options: EvalOptions) -> dict:
    from grpo_fast.config import GRPOLossConfig
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.distributed import PolicyForward
    from grpo_fast.train.model import resolve_dtype
    from grpo_fast.train.rewards import load_reward
    from grpo_fast.train.agentic import build_agent, reward_sources, tool_schemas
    from grpo_fast.train.model import context_length
    from grpo_fast.train.rollout import SamplingParams, eos_token_ids
    from grpo_fast.train.trainer import Run, load_datasets

    options.check()
    model_dir = Path(options.model)
    saved_tokens = _generation_max_new_tokens(model_dir)
    max_new_tokens = options.max_new_tokens or saved_tokens or DEFAULT_MAX_NEW_TOKENS
    # a builtin task: its held-out split, 256 prompts as in a run; a file: all its prompts
    eval_size = options.limit or (256 if options.dataset.startswith("builtin:") else 2**62)
    # the run's view of the options (validated there too); the dataset's prompts are the held-out set
    config = TrainConfig(
        model=str(model_dir), dataset=options.dataset, eval_dataset=options.dataset, rewards=list(options.rewards),
        reward_weights=list(options.reward_weights), eval_size=eval_size,
        micro_batch_size=options.batch_size, max_new_tokens=max_new_tokens, prompt_column=options.prompt_column,
        system_prompt=options.system_prompt, max_prompt_length=options.max_prompt_length, device=options.device,
        dtype=options.dtype, seed=options.seed, loss=GRPOLossConfig(), output_dir="unused", tools=list(options.tools),
        environment=options.environment, max_tool_calling_iterations=options.max_tool_calling_iterations,
        max_tool_response_length=options.max_tool_response_length,
    )
    try:  # the rewards and the prompts before the model: bad input fails fast
        reward_funcs = [load_reward(name) for name in config.rewards]  # none: [] (the environment's alone)
    except (ValueError, ImportError, AttributeError, TypeError) as e:
        raise type(e)(f"--rewards: {e}") from None
    _, records = load_datasets(config)
    if not records:
        raise ValueError(f"--dataset: {options.dataset} has no prompts")
    try:
        tool_schemas(config)  # the tools, the environment and a reward source to score with, before the model
    except ValueError as e:
        if not str(e).startswith("TrainConfig.rewards: "):
            raise
        raise ValueError(f"--rewards: {str(e).removeprefix('TrainConfig.rewards: ')}") from None
    torch.manual_seed(options.seed)
    model, tokenizer = load_saved_model(model_dir, config, options.base_model)
    device = next(model.parameters()).device
    agent = build_agent(config, tokenizer, eos_token_ids(model, tokenizer))
    # as in training: the environment's reward, weight 1 (a run without any reward source was refused above)
    reward_funcs, weights = reward_sources(reward_funcs, options.reward_weights or [1.0] * len(reward_funcs), agent)
    run = Run(config=config, model=model, ref_model=None, tokenizer=tokenizer, optimizer=None, scheduler=None,
              sampler=None, reward_funcs=reward_funcs, reward_weights=torch.tensor(weights),
              loss_config=None, eval_records=records, device=device, dtype=resolve_dtype(options.dtype, device),
              policy=PolicyForward(model), agent=agent, context=(context_length(model.config) or (None,))[0])
    temperature = options.sampling_temperature
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=options.top_p)
    scores: list[torch.Tensor] = []
    texts: list[list] = []
    by_function: list[torch.Tensor] = []
    try:
        mean = evaluate(run, samples=options.samples, params=params, scores=scores, completions_out=texts,
                        function_scores=by_function)
    finally:
        if agent is not None:
            agent.close()
    per_prompt = torch.stack(scores)  # [prompts, samples], NaN where no reward function scored the completion
    passed = (per_prompt >= options.pass_threshold).any(dim=1)  # an unscored completion passes nothing
    k = options.samples
    names = list(config.rewards) + [f.__name__ for f in reward_funcs[len(config.rewards):]]

    def plain(values: torch.Tensor) -> list:
        return [None if math.isnan(x) else x for x in values.tolist()]

    return {
        # the sources scored: the functions named as given, then the environment's (named after its class)
        "model": str(model_dir), "dataset": options.dataset,
        "rewards": names,
        "reward_weights": weights, "prompts": len(records),
        "samples": k, "decoding": "greedy" if temperature == 0 else "sampled", "temperature": temperature,
        "top_p": options.top_p, "max_new_tokens": max_new_tokens, "seed": options.seed,
        "pass_threshold": options.pass_threshold,
        # nothing scored: both n/a (None), not 0
        f"mean@{k}": mean, f"pass@{k}": None if mean is None else int(passed.sum()) / len(passed),
        # each prompt's completions, the i-th scored rewards[i] (the weighted total; unscored: null) and, by each
        # reward source, scores[name][i] (that function's own score; null: it returned None)
        "per_prompt": [{"prompt": r[options.prompt_column], "rewards": plain(s), "completions": c,
                        "scores": {name: plain(f[:, j]) for j, name in enumerate(names)}}
                       for r, s, c, f in zip(records, per_prompt, texts, by_function)],
    }


def _generation_max_new_tokens(model_dir: Path) -> int | None:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_new_tokens")
    return value if isinstance(value, int) and value > 0 else None


def result_table(result: dict) -> str:
    """The result as a two-column markdown table."""
    k = result["samples"]
    decoding = ("greedy" if result["decoding"] == "greedy"
                else f"sampled, temperature {result['temperature']:g}, top_p {result['top_p']:g}")
    rows = [
        ("model", result["model"]), ("dataset", f"{result['dataset']} ({result['prompts']} prompts)"),
        ("rewards", ", ".join(f"{n} x {w:g}" for n, w in zip(result["rewards"], result["reward_weights"]))),
        ("completions per prompt", f"{k} ({decoding}, at most {result['max_new_tokens']} new tokens)"),
        (f"mean@{k} (mean reward)", _value(result[f"mean@{k}"])),
        (f"pass@{k} (reward >= {result['pass_threshold']:g})", _value(result[f"pass@{k}"])),
    ]
    width = max(len(a) for a, _ in rows)
    lines = [f"| {'':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    return "\n".join(lines + [f"| {a:<{width}} | {b} |" for a, b in rows])


def _value(x: float | None) -> str:
    return "n/a (no completion was scored)" if x is None else f"{x:.4f}"
