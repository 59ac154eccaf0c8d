"""The trainer's side of agentic rollouts: the run's :class:`~grpo_fast.agents.Agent` from its options, the prompts
an environment extends, and what the reward functions receive for a multi-turn row.

``rollout.rollout`` calls these when the run has tools (``--tools``, ``--environment``); the loop itself
(``trainer.train_step``) only reads the metrics the trace carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_fast.agents import Agent, AgentOptions, BUILTIN_TOOLS
from grpo_fast.agents.session import turn_metrics
from grpo_fast.agents.turns import TurnStats
from grpo_fast.train.rewards import load_object
from grpo_fast.train.tasks import TOOL_TASKS

__all__ = ["AgentTrace", "build_agent", "environment_reward", "extend_prompt", "transcripts"]


@dataclass
class AgentTrace:
    """What a generation's tool use left for the rewards and the metrics (``Rollout.trace``)."""

    environments: list[Any]
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
    """The run's agent, or None for a run without tools. Built-in tool names: ``python``, ``calc``, and ``builtin``
    (the tool of a built-in tool task: ``--dataset builtin:calc --tools builtin``)."""
    if not config.tools and not config.environment:
        return None
    builtins = dict(BUILTIN_TOOLS)
    task = config.dataset.split(":", 1)[1] if config.dataset.startswith("builtin:") else None
    if task in TOOL_TASKS:
        builtins["builtin"] = TOOL_TASKS[task]
    tools = [load_object(spec, "tool", builtins) for spec in config.tools]
    factory = load_object(config.environment, "environment", {}) if config.environment else None
    options = AgentOptions(config.max_tool_calling_iterations, config.max_tool_response_length,
                           config.tool_timeout_s, config.tool_workers)
    return Agent(tools, factory, tokenizer, eos_ids, options)


def extend_prompt(prompt: str | list[dict], observation: str | None) -> str | list[dict]:
    """The prompt with an environment's ``reset`` string appended to its last user message (TRL's rule)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        messages.append({"role": "user", "content": observation})
    else:
        messages[last]["content"] = (messages[last].get("content") or "") + observation
    return messages


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


def environment_reward(name: str):
    """A reward function that asks each row's environment (``environments=``) for its ``get_reward()``, named after
    the environment's class (TRL's: weight 1)."""

    def reward(prompts, completions, environments=None, **kwargs):
        if environments is None:
            raise ValueError(f"the {name} reward needs the rollout's environments")
        return [env.get_reward() for env in environments]

    reward.__name__ = reward.__qualname__ = name
    return reward
