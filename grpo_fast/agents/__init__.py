"""Agentic GRPO: rollouts in which the model calls tools, reads their results and goes on.

- :mod:`~grpo_fast.agents.tools`: tools (typed, documented functions) and environments (``reset(**record)``, public
  methods as tools, an optional ``get_reward``), with TRL's meaning; :class:`ToolRunner` runs the calls.
- :mod:`~grpo_fast.agents.formats`: how calls and results look in tokens (the chat template's, or the tiny model's
  compact one).
- :mod:`~grpo_fast.agents.turns`: the multi-turn loop inside the sampler (tool tokens fed, never trained).
- :mod:`~grpo_fast.agents.session`: a run's :class:`Agent`.
- :mod:`~grpo_fast.agents.python_tool`: the ``python`` tool on the code sandbox.
"""

from grpo_fast.agents.formats import ChatTemplateFormat, CompactFormat, tool_format
from grpo_fast.agents.session import BUILTIN_TOOLS, Agent, AgentOptions
from grpo_fast.agents.tools import Tool, ToolCall, ToolRunner, ToolSet, as_tool, environment_tools
from grpo_fast.agents.turns import ToolTurns, TurnStats

__all__ = [
    "BUILTIN_TOOLS", "Agent", "AgentOptions", "ChatTemplateFormat", "CompactFormat", "Tool", "ToolCall", "ToolRunner",
    "ToolSet", "ToolTurns", "TurnStats", "as_tool", "environment_tools", "tool_format",
]
