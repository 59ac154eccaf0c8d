"""The trainer's side of agentic rollouts: the run's :class:`~grpo_fast.agents.Agent` from its options, the prompts
an environment extends, and what the reward functions receive for a multi-turn row.

``rollout.rollout`` calls these when the run has tools (``--tools``, ``--environment``); the loop itself
(``trainer.train_step``) only reads the metrics the trace carries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_fast.agents import Agent, AgentOptions, BUILTIN_TOOLS
from grpo_fast.agents.session import turn_metrics
from grpo_fast.agents.tools import as_tool, tool_set
from grpo_fast.agents.turns import TurnStats
from grpo_fast.train.config import object_spec
from grpo_fast.train.rewards import load_object
from grpo_fast.train.tasks import TASK_SIZE, TOOL_TASKS, builtin_records, calc_demonstration

logger = logging.getLogger("grpo_fast.train")

__all__ = ["AgentTrace", "build_agent", "environment_reward", "extend_prompt", "reward_sources", "tool_schemas",
           "transcripts", "warm_up"]


@dataclass
class AgentTrace:
    """What a generation's tool use left for the rewards and the metrics (``Rollout.trace``)."""

    environments: list[Any]
    records: list[dict]  # the records as the rollout used them: prompts extended by the environments' reset()
    stats: list[TurnStats] = field(default_factory=list)
    rows: int = 0

    def metrics(self) -> dict[str, float]:
        total = TurnStats(calls_per_row=[])
        for s in self.stats:
            total.calls += s.calls
            total.failures += s.failures
            total.truncated_results += s.truncated_results
            total.dropped_results += s.dropped_results
            total.calls_per_row += s.calls_per_row
        return turn_metrics(total, self.rows)


def build_agent(config, tokenizer, eos_ids: list[int]) -> Agent | None:
    """The run's agent, or None for a run without tools (``TrainConfig.tools``: built-in names ``calc`` and
    ``python``, ``module:function`` / ``path.py:function`` specs or functions; ``TrainConfig.environment``: a spec or
    the class)."""
    if not config.tools and not config.environment:
        return None
    task = config.dataset.removeprefix("builtin:") if config.dataset.startswith("builtin:") else None
    if config.model == "tiny" and task not in TOOL_TASKS:
        raise ValueError(f"TrainConfig.tools: the tiny model's character tokenizer writes tool calls only in the "
                         f"built-in tool tasks ({', '.join('builtin:' + t for t in TOOL_TASKS)}), got dataset="
                         f"{config.dataset!r}; other datasets take tools with a chat model (--model DIR) whose chat "
                         "template renders them")
    tools, factory = _tool_objects(config)
    options = AgentOptions(config.max_tool_calling_iterations, config.max_tool_response_length,
                           config.tool_timeout, config.tool_workers)
    try:
        return Agent(tools, factory, tokenizer, eos_ids, options)
    except ValueError as e:  # the tokenizer cannot carry the tools, two share a name
        raise ValueError(f"TrainConfig.{'tools' if config.tools else 'environment'}: {e}") from None


def _tool_objects(config) -> tuple[list, Any]:
    """The run's tool functions and environment factory (None), loaded from their specs."""
    tools = [tool if callable(tool) else load_object(tool, "tool", BUILTIN_TOOLS) for tool in config.tools]
    factory = config.environment
    if isinstance(factory, str):
        factory = load_object(factory, "environment", {})
    return tools, factory


def tool_schemas(config) -> list[dict] | None:
    """The tools' JSON schemas as the chat template shows them in every prompt (an environment's methods included,
    from one instance), for the pre-flight prompt-length check; None for a run without tools. Refuses, before the
    model loads, a run whose only reward would be an environment without ``get_reward()``."""
    if not config.tools and not config.environment:
        return None
    tools, factory = _tool_objects(config)
    environment = None if factory is None else factory()
    if not config.rewards and not callable(getattr(type(environment), "get_reward", None)):
        raise ValueError(_NO_REWARD.format(type(environment).__name__))
    try:
        return tool_set([as_tool(fn, "tools") for fn in tools], environment).schemas
    except ValueError as e:
        raise ValueError(f"TrainConfig.{'tools' if config.tools else 'environment'}: {e}") from None


WARMUP_LR, WARMUP_BATCH = 3e-3, 32  # the supervised warm-up's AdamW learning rate and demonstrations per step


def warm_up(config, model, tokenizer, agent: Agent | None) -> list[float]:
    """``config.sft_warmup_steps`` supervised steps on the demonstrations of the run's built-in tool task (the tool
    calls written out, the tool's tokens masked as in training; :func:`grpo_fast.agents.warmup.supervised_warmup`),
    from the run's seed; returns the losses. The run is deterministic, so a resumed run repeats it to rebuild the
    same reference model."""
    from grpo_fast.agents import CompactFormat
    from grpo_fast.agents.warmup import supervised_warmup

    task = config.dataset.removeprefix("builtin:")
    tool = TOOL_TASKS.get(task) if config.dataset.startswith("builtin:") else None
    if tool is None or agent is None or list(agent.tools.tools) != [tool.rsplit(":", 1)[1]] \
            or not isinstance(agent.format, CompactFormat):
        raise ValueError("TrainConfig.sft_warmup_steps: demonstrations exist for the built-in tool tasks ("
                         + ", ".join(f"--dataset builtin:{t} --tools {s.rsplit(':', 1)[1]}" for t, s in TOOL_TASKS.items())
                         + f") on the tiny model's tokenizer; got dataset={config.dataset!r}, tools="
                         f"{[object_spec(t) for t in config.tools]}, environment={config.environment!r}")
    records = builtin_records(task, "train", TASK_SIZE)
    demos = [calc_demonstration(r, tokenizer, agent.format) for r in records]
    started = time.perf_counter()
    losses = supervised_warmup(model, demos, steps=config.sft_warmup_steps, batch_size=WARMUP_BATCH, lr=WARMUP_LR,
                               seed=config.seed, pad_id=tokenizer.pad_token_id)
    logger.info("supervised warm-up: %d steps of %d demonstrations from %d, loss %.3f -> %.3f (%.1f s)",
                len(losses), WARMUP_BATCH, len(demos), losses[0], losses[-1], time.perf_counter() - started)
    return losses


def extend_prompt(prompt: str | list[dict], observation: str | None) -> str | list[dict]:
    """The prompt with an environment's ``reset`` string appended (TRL's rule): to a plain prompt's text, or to the
    content of a conversation's last message (a new copy; the record is left untouched)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    if not prompt:
        return [{"role": "user", "content": observation}]
    return [*prompt[:-1], {**prompt[-1], "content": (prompt[-1].get("content") or "") + observation}]


def transcripts(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor, messages: list[list[dict]],
                prompts: list) -> list:
    """What the reward functions receive for each row: TRL's message list (assistant and tool messages) for a
    conversational prompt, else the transcript's text (the model's and the tool's tokens, special tokens such as the
    compact format's ``<call>`` kept, padding and EOS dropped)."""
    drop = {tokenizer.pad_token_id, tokenizer.eos_token_id}
    out = []
    for row, (ids, mask) in enumerate(zip(completion_ids.tolist(), completion_mask.tolist())):
        if isinstance(prompts[row], list):
            out.append(messages[row])
        else:
            out.append(tokenizer.decode([t for t, m in zip(ids, mask) if m and t not in drop],
                                        skip_special_tokens=False))
    return out


def reward_sources(reward_funcs: list, weights: list[float], agent: Agent | None) -> tuple[list, list[float]]:
    """The run's reward functions and weights, the environment's ``get_reward()`` appended when it has one (TRL's:
    named after the class, weight 1); refuses a run left with none (``--rewards none`` without such an
    environment)."""
    reward_funcs, weights = list(reward_funcs), list(weights)
    if agent is not None and agent.has_environment_reward:
        reward_funcs.append(environment_reward(agent.environment_name))
        weights.append(1.0)
    if not reward_funcs:
        raise ValueError(_NO_REWARD.format(agent.environment_name if agent is not None else None))
    return reward_funcs, weights


_NO_REWARD = ("TrainConfig.rewards: no reward source; name a reward function, or give an environment with a "
              "get_reward() method (TRL's rule), got rewards=none and environment {} without get_reward()")


def environment_reward(name: str):
    """A reward function that asks each row's environment (``environments=``) for its ``get_reward()``, named after
    the environment's class (TRL's: weight 1)."""

    def reward(prompts, completions, environments=None, **kwargs):
        if environments is None:
            raise ValueError(f"the {name} reward needs the rollout's environments")
        return [env.get_reward() for env in environments]

    reward.__name__ = reward.__qualname__ = name
    return reward
