"""A run's agent: its tools and environment, built once, and what each generation needs from them.

:class:`Agent` loads the tools (``module:function``, ``path/to/file.py:function`` or a built-in name) and the
environment class, picks the tool-call format for the tokenizer, and for each generation makes one environment
instance per row (``reset(**record)``), the rows' tool sets and the :class:`~grpo_fast.agents.turns.ToolTurns` the
sampler asks. After the generation it hands the rewards the transcripts (TRL's message lists for a conversational
prompt, the text for a plain one) and the environments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_fast.agents.formats import tool_format
from grpo_fast.agents.tools import Tool, ToolRunner, ToolSet, as_tool, environment_tools, tool_set
from grpo_fast.agents.turns import ToolTurns, TurnStats

logger = logging.getLogger("grpo_fast.train")

__all__ = ["Agent", "AgentOptions", "BUILTIN_TOOLS"]

# name -> "module:function" (resolved lazily)
BUILTIN_TOOLS: dict[str, str] = {
    "calc": "grpo_fast.train.tasks:calc",
    "python": "grpo_fast.agents.python_tool:python",
}


@dataclass(frozen=True)
class AgentOptions:
    """How tool calls are run (TRL's names where TRL has the option)."""

    max_tool_calling_iterations: int | None = None  # rounds of calls per row; None: no limit but the length budget
    max_tool_response_length: int | None = None  # tokens; a longer result is cut to it (counted in the metrics)
    tool_timeout_s: float = 30.0
    tool_workers: int = 8


class Agent:
    """The tools and environment of a run (module docstring).

    Args:
        tools: the run's tool functions.
        environment_factory: a class or callable making one environment instance (or None).
        tokenizer: the run's tokenizer; ``eos_ids`` the tokens that end a turn.
        options: :class:`AgentOptions`.
    """

    def __init__(self, tools: Sequence[Callable], environment_factory: Callable | None, tokenizer,
                 eos_ids: Sequence[int], options: AgentOptions = AgentOptions()) -> None:
        if not tools and environment_factory is None:
            raise ValueError("Agent needs tools or an environment")
        self.functions: list[Tool] = [as_tool(fn, "tools") for fn in tools]
        names = [tool.name for tool in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: two tools share a name ({', '.join(sorted(names))}); each needs its own")
        self.environment_factory = environment_factory
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.options = options
        self.runner = ToolRunner(options.tool_workers, options.tool_timeout_s)
        self._formats: dict[tuple[str, ...], Any] = {}
        probe = None if environment_factory is None else environment_factory()
        if probe is not None:
            environment_tools(probe, "environment")  # refused here, once, rather than at the first step
        self.environment_name = None if probe is None else type(probe).__name__
        self.has_environment_reward = callable(getattr(type(probe), "get_reward", None))  # on the class, as reset
        self.tools = self._tool_set(probe)  # what every row offers (its own environment instance's methods)
        self.format = self._format(self.tools)
        logger.info("agent: tools %s, %s%s", ", ".join(self.tools.tools), type(self.format).__name__,
                    f", environment {self.environment_name}" if self.environment_name else "")

    def _tool_set(self, environment: Any) -> ToolSet:
        return tool_set(self.functions, environment, "environment")

    def _format(self, tools: ToolSet):
        key = tuple(tools.tools)
        if key not in self._formats:
            self._formats[key] = tool_format(self.tokenizer, tools.schemas, self.eos_ids)
        return self._formats[key]

    @property
    def schemas(self) -> list[dict]:
        """The tools as the chat template shows them (an environment's methods included)."""
        return self.tools.schemas

    def start(self, records: Sequence[dict], group_size: int) -> tuple[list[Any], list[str | None]]:
        """One environment per row (``records`` repeated ``group_size`` times, as the rollout lays rows out), reset
        with its record; returns them and, per record, the string ``reset`` returned (appended to the prompt), or
        None. A group's rows must get the same string: grpo-fast prefills a group's prompt once."""
        if self.environment_factory is None:
            return [None] * (len(records) * group_size), [None] * len(records)
        environments, observations = [], []
        for i, record in enumerate(records):
            group = [self.environment_factory() for _ in range(group_size)]
            seen = [env.reset(**record) for env in group]
            if any(obs is not None and not isinstance(obs, str) for obs in seen):
                bad = next(obs for obs in seen if obs is not None and not isinstance(obs, str))
                raise TypeError(f"environment: {self.environment_name}.reset must return None or a str (appended to "
                                f"the prompt), got {type(bad).__name__}")
            if len(set(seen)) > 1:
                raise ValueError(f"environment: {self.environment_name}.reset returned different strings for the "
                                 f"{group_size} rows of record {i} ({seen[0]!r:.60} and {seen[1]!r:.60}); grpo-fast "
                                 "prefills a group's prompt once, so the rows of a record must start from the same "
                                 "prompt (seed the environment from the record)")
            environments.extend(group)
            observations.append(seen[0])
        return environments, observations

    def turns(self, environments: Sequence[Any], prompts: Sequence[list[int]], *, max_new_tokens: int,
              context: int | None) -> ToolTurns:
        """The tool loop of one generation over rows with these environments and (unpadded) prompt ids."""
        tools = [self._tool_set(env) for env in environments]
        return ToolTurns(self._format(tools[0]), tools, self.runner, prompts, max_new_tokens=max_new_tokens,
                         context=context, max_iterations=self.options.max_tool_calling_iterations,
                         max_result_tokens=self.options.max_tool_response_length, tokenizer=self.tokenizer)

    def close(self) -> None:
        self.runner.close()


def turn_metrics(stats: TurnStats, rows: int) -> dict[str, float]:
    """A generation's tool metrics (TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` among them)."""
    calls_per_row = stats.calls_per_row
    return {
        "tools/call_frequency": stats.calls / max(rows, 1),
        "tools/failure_frequency": stats.failures / max(stats.calls, 1),
        "tools/rows_with_calls": sum(c > 0 for c in calls_per_row) / max(rows, 1),
        "tools/truncated_results": float(stats.truncated_results),
        "tools/dropped_results": float(stats.dropped_results),
    }
