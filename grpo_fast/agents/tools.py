"""Tools and environments, with TRL's meaning: what a rollout may call, and how a call is run.

A **tool** is a typed Python function with a Google-style docstring (``Args:`` naming each parameter); its JSON
schema (``transformers.utils.get_json_schema``) is what the chat template shows the model. An **environment** is a
class (or any callable returning an instance) with ``reset(**record)`` and public methods, which are its tools; one
instance serves one rollout row, so rows never share state. ``reset`` may return a string, appended to the prompt (to
the content of a conversation's last message: TRL's rule), which the rewards then receive; an optional
``get_reward()`` scores the finished row (a reward source of weight 1, named after the class).

A call's result reaches the model as ``str(result)``. A tool that raises, times out, is unknown or gets arguments it
does not take answers ``{'error': '...'}`` instead: the row goes on, the step never crashes, and the failure is
counted in the metrics. Calls of different rows run concurrently (a thread pool), the calls of one row in order.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Tool", "ToolCall", "ToolRunner", "ToolSet", "as_tool", "environment_tools", "tool_set"]


@dataclass(frozen=True)
class Tool:
    """One callable tool: its name, JSON schema (the chat template's ``tools`` entry) and function."""

    name: str
    schema: dict
    fn: Callable[..., Any]

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.schema["function"]["parameters"].get("required", ()))

    @property
    def parameters(self) -> tuple[str, ...]:
        return tuple(self.schema["function"]["parameters"].get("properties", {}))


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's name and its arguments (already parsed from the turn's text)."""

    name: str
    arguments: dict = field(default_factory=dict)


def as_tool(fn: Callable[..., Any], where: str = "tools") -> Tool:
    """The :class:`Tool` of a typed, documented function (or bound method); raises ``ValueError`` naming ``where``
    and the function when its schema cannot be built (a parameter without a type hint or without a line under
    ``Args:``)."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", None)
    if not callable(fn) or not name:
        raise TypeError(f"{where}: a tool must be a function, got {type(fn).__name__} {fn!r:.80}")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"{where}: tool {name!r} needs a type hint on every parameter and a Google-style docstring "
                         f"with a line for each under 'Args:' (TRL's rule): {e}") from None
    return Tool(name, schema, fn)


def environment_tools(instance: Any, where: str = "environment") -> list[Tool]:
    """The tools of an environment instance: the public functions its class defines (inherited ones included), other
    than ``reset`` and ``get_reward``, bound to the instance. Listed on the class, as TRL does: a property is never
    run to find them, and a callable the instance merely holds in an attribute is not a tool."""
    cls = type(instance)
    if not callable(getattr(cls, "reset", None)):
        raise TypeError(f"{where}: an environment must define a callable reset(**record), "
                        f"{cls.__name__} does not")
    tools = []
    for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        tools.append(as_tool(getattr(instance, name), f"{where} {cls.__name__}.{name}"))
    if not tools:
        raise ValueError(f"{where}: {type(instance).__name__} has no public method to offer as a tool")
    return tools


@dataclass
class ToolSet:
    """The tools one rollout row may call: the run's functions, plus its environment's methods when it has one."""

    tools: dict[str, Tool]
    environment: Any = None

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]


def tool_set(functions: Sequence[Tool], environment: Any = None, where: str = "environment") -> ToolSet:
    """The :class:`ToolSet` of a row: ``functions`` and, if given, the environment instance's methods (a name both
    define is refused: the model could not tell which it calls)."""
    tools = {tool.name: tool for tool in functions}
    if environment is not None:
        for tool in environment_tools(environment, where):
            if tool.name in tools:
                raise ValueError(f"{where}: {type(environment).__name__}.{tool.name} has the name of a tool the run "
                                 "already offers; rename one of them")
            tools[tool.name] = tool
    return ToolSet(tools, environment)


@dataclass
class _Outcome:
    text: str
    failed: bool


class ToolRunner:
    """Runs the calls of many rows: the rows concurrently (``workers`` threads), each row's calls in order.

    ``timeout_s`` bounds each call's wait: a call still running past it answers ``{'error': 'timed out ...'}`` and
    its thread is left to finish on its own (Python cannot stop a thread; a tool that can hang, such as the
    ``python`` tool, must bound itself, as the sandbox does by killing its process).
    """

    def __init__(self, workers: int = 8, timeout_s: float = 30.0) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"tool workers must be an int >= 1, got {workers!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"tool timeout must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo-fast-tool")

    def run(self, batch: Sequence[tuple[ToolSet, Sequence[ToolCall]]]) -> list[list[tuple[str, str, bool]]]:
        """For each row ``(tools, calls)``, the ``(name, result text, failed)`` of each call, in order."""
        futures: list[Future] = [self._pool.submit(self._row, tools, calls) for tools, calls in batch]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _row(self, tools: ToolSet, calls: Sequence[ToolCall]) -> list[tuple[str, str, bool]]:
        out = []
        for call in calls:
            outcome = self._call(tools, call)
            out.append((call.name, outcome.text, outcome.failed))
        return out

    def _call(self, tools: ToolSet, call: ToolCall) -> _Outcome:
        tool = tools.tools.get(call.name)
        if tool is None:
            return _Outcome(str({"error": f"Tool {call.name} not found."}), True)
        unknown = sorted(set(call.arguments) - set(tool.parameters))
        missing = sorted(set(tool.required) - set(call.arguments))
        if unknown or missing:
            problem = "; ".join(part for part in (
                f"unknown arguments {', '.join(unknown)}" if unknown else "",
                f"missing arguments {', '.join(missing)}" if missing else "") if part)
            return _Outcome(str({"error": f"{call.name}: {problem}"}), True)
        result: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                value = tool.fn(**call.arguments)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                result["value"] = value
            except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's to read, never the run's
                result["error"] = str(e) or type(e).__name__  # TRL's str(e); the type where that says nothing
            finally:
                done.set()

        thread = threading.Thread(target=target, name=f"grpo-fast-tool-{call.name}", daemon=True)
        thread.start()
        if not done.wait(self.timeout_s):
            return _Outcome(str({"error": f"{call.name} timed out after {self.timeout_s:g} s"}), True)
        if "error" in result:
            return _Outcome(str({"error": result["error"]}), True)
        return _Outcome(str(result["value"]), False)


async def _awaited(value: Any) -> Any:
    return await value
