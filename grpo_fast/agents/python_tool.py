"""The ``python`` tool: the model's code runs in the code sandbox, and the model reads what it printed.

Each call is a fresh interpreter behind every layer of :mod:`grpo_fast.sandbox` (process group, rlimits, namespaces,
Landlock, seccomp, the audit hook) and its limits; nothing persists between calls. The tool message is what the code
printed, then the value of its last line when that is an expression (as a notebook shows it), or the error that
stopped it, cut to ``max_chars`` characters. Nothing a tool call computes decides a reward: rewards are computed
afterwards, in the trainer's process, from the transcript (and the code reward runs its tests in a sandbox of its
own).
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_fast.sandbox import SandboxLimits, run_python

__all__ = ["make_python_tool", "python"]

DEFAULT_MAX_CHARS = 2000


def make_python_tool(limits: SandboxLimits | None = None, max_chars: int = DEFAULT_MAX_CHARS) -> Callable[[str], str]:
    """A ``python`` tool with these sandbox limits and this longest message."""
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 32:
        raise ValueError(f"make_python_tool: max_chars must be an int >= 32, got {max_chars!r}")
    limits = SandboxLimits() if limits is None else limits

    def python(code: str) -> str:
        """Run Python code in a fresh sandboxed interpreter and return what it printed, then the value of its last
        line if that is an expression, or the error that stopped it. Only the standard library is available; files,
        network and processes are not; every call starts from scratch.

        Args:
            code: the Python source to run.
        """
        return run_python(code, limits).text(max_chars)

    return python


python = make_python_tool()
