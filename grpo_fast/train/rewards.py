"""Reward functions in TRL's convention, the built-in rewards, a loader for user rewards and the reward matrix (of
a run's completions: :func:`score`).

A reward function is called as ``fn(prompts, completions, **columns) -> list[float | None]``: ``prompts`` and
``completions`` are strings or chat-message lists (``[{"role": ..., "content": ...}, ...]``) and every other dataset
column arrives as a keyword argument holding one value per completion (``answer=[...]``). A function takes
``**kwargs`` so that columns it does not use are ignored. ``None`` means "this function does not score this sample";
:func:`compute_rewards` turns it into NaN, which the group advantages skip.

Built-ins (:data:`BUILTIN_REWARDS`): ``math`` (:func:`math_reward`), ``exact`` (:func:`exact_reward`),
``last_number`` (:func:`last_number_reward`), ``format`` (:func:`format_reward`) and ``code``
(``grpo_fast.sandbox.code_reward``). :func:`load_reward` resolves those names as well as user functions given as
``module:function`` or ``path/to/file.py:function``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

RewardFn = Callable[..., list]

# name -> "module:function"; resolved lazily by load_reward, so that e.g. the sandbox is imported only when used.
BUILTIN_REWARDS: dict[str, str] = {
    "code": "grpo_fast.sandbox:code_reward",
    "exact": "grpo_fast.train.rewards:exact_reward",
    "format": "grpo_fast.train.rewards:format_reward",
    "last_number": "grpo_fast.train.rewards:last_number_reward",
    "math": "grpo_fast.train.rewards:math_reward",
}

# The common reasoning format: a think block, then an answer block, and nothing else.
THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"

# Seconds math_verify may spend parsing one string or comparing one gold/prediction pair (see _signal_timeout).
MATH_TIMEOUT_S = 5

_FLOAT32_MAX = torch.finfo(torch.float32).max
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MATH_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def completion_text(completion: str | Sequence[dict]) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat-message list."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    return completion[-1]["content"] or ""


def reward_name(fn: RewardFn) -> str:
    """A readable name for a reward function (its ``__name__``, else its type's name for callable objects)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


# --------------------------------------------------------------------------------------------------- math reward


def _import_math_verify() -> ModuleType:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the 'math' reward needs the math-verify package: pip install math-verify "
            "(or pip install grpo-fast[train])"
        ) from e
    return math_verify


def _signal_timeout(seconds: int) -> int | None:
    """The timeout to hand math_verify from the calling thread.

    math_verify bounds ``parse`` and ``verify`` with ``signal.alarm``, which only works in the main thread: from any
    other thread a timeout makes both raise ``ValueError`` whatever ``raise_on_error`` says. There we pass ``None``,
    which runs them unbounded (math_verify then logs a one-off warning saying so).
    """
    return seconds if threading.current_thread() is threading.main_thread() else None


def _parse(mv: ModuleType, text: str, timeout: int | None) -> list:
    """math_verify's parse, looking for LaTeX and for plain expressions; [] when nothing parses (or on timeout)."""
    return mv.parse(text, extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                    parsing_timeout=timeout)


def _parse_answer(mv: ModuleType, text: str, timeout: int | None) -> list:
    """Parse text that *is* an answer (a gold answer, an ``<answer>`` block), not prose around one.

    Bare LaTeX such as ``\\sqrt{2}`` or ``3\\pi`` is only recognised between math delimiters, so text without any is
    first parsed as ``$text$``, then as is if that finds nothing.
    """
    text = text.strip()
    if not any(d in text for d in _MATH_DELIMITERS):
        parsed = _parse(mv, f"${text}$", timeout)
        if parsed:
            return parsed
    return _parse(mv, text, timeout)


def _parse_prediction(mv: ModuleType, completion: str, timeout: int | None) -> list:
    """The final answer of a completion: the last ``<answer>`` block if any, else the last answer-like match
    (``\\boxed{...}``, "the answer is ...", a trailing number) that math_verify finds in the whole text."""
    blocks = _ANSWER_TAG.findall(completion)
    if blocks:
        return _parse_answer(mv, blocks[-1], timeout)
    return _parse(mv, completion, timeout)


def math_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 when a completion's final answer is mathematically equal to the gold ``answer``, else 0.0.

    Gold answers may be numbers (``42``, ``"0.5"``) or LaTeX (``"\\frac{1}{2}"``, with or without ``$...$``);
    completions may end in ``\\boxed{...}``, "The answer is 7", a bare ``7`` or an ``<answer>...</answer>`` block.
    Equality is math_verify's (``0.5`` equals ``\\frac{1}{2}``). ``None`` for a sample whose answer is ``None`` or
    cannot be parsed.

    Safe to call from any thread, but only the main thread gets a time limit (:data:`MATH_TIMEOUT_S` per parse and
    per comparison, see :func:`_signal_timeout`): elsewhere a pathological completion (a tower of powers, say) can
    keep sympy busy indefinitely.
    """
    mv = _import_math_verify()
    timeout = _signal_timeout(MATH_TIMEOUT_S)
    golds: dict[str, list] = {}  # each prompt's answer is shared by its whole group: parse it once
    scores: list[float | None] = []
    for completion, gold_answer in zip(completions, answer, strict=True):
        if gold_answer is None:
            scores.append(None)
            continue
        key = str(gold_answer)
        if key not in golds:
            golds[key] = _parse_answer(mv, key, timeout)
        gold = golds[key]
        if not gold:
            scores.append(None)
            continue
        prediction = _parse_prediction(mv, completion_text(completion), timeout)
        scores.append(1.0 if prediction and mv.verify(gold, prediction, timeout_seconds=timeout) else 0.0)
    return scores


def exact_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the stripped completion is exactly the stripped gold ``answer``, else 0.0 (None without an answer).

    For answers with one spelling (labels, single tokens) where :func:`math_reward`'s parsing is not wanted, or
    where math-verify is not installed.
    """
    return [None if gold is None else float(completion_text(c).strip() == str(gold).strip())
            for c, gold in zip(completions, answer, strict=True)]


_INTEGER = re.compile(r"-?\d+")


def last_number_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the last integer of the completion equals the gold ``answer`` (an integer), else 0.0 (None without an
    answer). A multi-turn completion (a message list) counts every message, tool results included: an answer the
    model read from its tool is its answer (the ``calc`` task's reward)."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        text = completion if isinstance(completion, str) else " ".join(
            str(message.get("content") or "") for message in completion)
        numbers = _INTEGER.findall(text)
        scores.append(float(bool(numbers) and int(numbers[-1]) == int(str(gold).strip())))
    return scores


# ------------------------------------------------------------------------------------------------- format reward


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"invalid format-reward pattern {pattern!r}: {e}") from e


def _fullmatch_scores(regexes: Sequence[re.Pattern], completions: list) -> list[float]:
    return [1.0 if r.fullmatch(completion_text(c).strip()) else 0.0 for r, c in zip(regexes, completions, strict=True)]


_THINK_ANSWER = _compile(THINK_ANSWER_PATTERN)


def format_reward(
    prompts: list, completions: list, pattern: str | list[str | None] | None = None, **kwargs: Any
) -> list[float]:
    """1.0 when the whole (stripped) completion matches ``pattern`` (``re.DOTALL``), else 0.0.

    ``pattern`` defaults to :data:`THINK_ANSWER_PATTERN` (``<think>...</think>`` then ``<answer>...</answer>``); a
    dataset column named ``pattern`` gives each sample its own (``None`` entries use the default).
    """
    if isinstance(pattern, list):
        regexes = [_THINK_ANSWER if p is None else _compile(p) for p in pattern]
    else:
        regexes = [_THINK_ANSWER if pattern is None else _compile(pattern)] * len(completions)
    return _fullmatch_scores(regexes, completions)


def make_format_reward(pattern: str, name: str | None = None) -> RewardFn:
    """A reward giving 1.0 when ``re.fullmatch(pattern, completion.strip(), re.DOTALL)`` matches, else 0.0.

    The function is named ``name``, or ``format_reward[<pattern>]``, which is what logs and errors show.
    """
    regex = _compile(pattern)

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return _fullmatch_scores([regex] * len(completions), completions)

    reward.__name__ = reward.__qualname__ = name or f"format_reward[{pattern}]"
    reward.__doc__ = f"1.0 when the whole completion matches {pattern!r} (re.DOTALL), else 0.0."
    return reward


# ------------------------------------------------------------------------------------------------- load_reward


def _spec_error(spec: str, problem: str, what: str = "reward", builtins: dict[str, str] | None = None) -> str:
    names = ", ".join(sorted(BUILTIN_REWARDS if builtins is None else builtins))
    name = "Class" if what == "environment" else "function"
    return (
        f"cannot load {what} {spec!r}: {problem}. Expected " + (f"a built-in {what} ({names}), " if names else "")
        + f"'module:{name}' (module importable from sys.path) or 'path/to/file.py:{name}'."
    )


def _is_file_spec(module: str) -> bool:
    return module.endswith(".py") or "/" in module or "\\" in module


def _import_file(spec: str, location: str, error=_spec_error) -> ModuleType:
    """Import a Python file as a module named after its resolved path (so that loading it twice reuses it)."""
    path = Path(location).expanduser().resolve()
    if not path.is_file():
        raise ImportError(error(spec, f"file {str(path)!r} not found"))
    name = f"{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # registered first, as a regular import does (dataclasses, pickling look it up)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ImportError(error(spec, f"executing {str(path)!r} raised {type(e).__name__}: {e}")) from e
    return module


def _import_module(spec: str, name: str, error=_spec_error) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            problem = f"module {name!r} not found (is its directory on sys.path or PYTHONPATH?)"
        else:  # the module exists but one of its own imports is missing
            problem = f"importing module {name!r} failed: {e}"
        raise ImportError(error(spec, problem)) from e
    except Exception as e:
        raise ImportError(error(spec, f"importing module {name!r} raised {type(e).__name__}: {e}")) from e


def load_reward(spec: str) -> RewardFn:
    """Resolve a reward function from a built-in name (``"math"``, ``"format"``, ``"code"``), ``"module:function"``
    (e.g. ``"my_rewards:length_penalty"``) or ``"path/to/file.py:function"``.

    Raises ``ValueError`` for a spec of neither form, ``ImportError`` when the module or file cannot be imported,
    ``AttributeError`` when it has no such attribute and ``TypeError`` when the attribute is not callable; each
    message names the spec, the accepted forms and what went wrong.
    """
    return load_object(spec, "reward", BUILTIN_REWARDS)


def load_object(spec: str, what: str, builtins: dict[str, str]) -> Callable:
    """The callable a spec names: a key of ``builtins`` (whose value is a ``module:NAME`` spec), ``module:NAME`` or
    ``path/to/file.py:NAME``; errors as :func:`load_reward`'s, naming ``what`` (``"reward"``, ``"tool"``,
    ``"environment"``)."""
    def error(spec_: str, problem: str) -> str:
        return _spec_error(spec_, problem, what, builtins)

    target = builtins.get(spec.strip(), spec.strip())
    location, sep, attribute = target.rpartition(":")
    if not sep or not location or not attribute:
        raise ValueError(error(spec, "not a built-in name and not of the form 'module:"
                               + ("Class'" if what == "environment" else "function'")))
    if _is_file_spec(location):
        module = _import_file(spec, location, error)
    else:
        module = _import_module(spec, location, error)
    if not hasattr(module, attribute):
        kind = inspect.isclass if what == "environment" else inspect.isfunction
        defined = sorted(n for n, v in vars(module).items() if kind(v) and v.__module__ == module.__name__)
        problem = (f"{location!r} has no attribute {attribute!r} ({'classes' if what == 'environment' else 'functions'}"
                   f" it defines: {', '.join(defined) or 'none'})")
        raise AttributeError(error(spec, problem))
    fn = getattr(module, attribute)
    if not callable(fn):
        raise TypeError(error(spec, f"{location}:{attribute} is a {type(fn).__name__}, not a function"))
    return fn


def reward_metrics(funcs: Sequence[RewardFn]) -> dict[str, float]:
    """What reward functions report about themselves, for the trainer's metrics log: for each function with a
    ``metrics()`` attribute (the code reward's :func:`~grpo_fast.sandbox.sandbox_metrics`, say), its values
    as ``rewards/<name>/<key>``."""
    return {f"rewards/{reward_name(fn)}/{key}": float(value)
            for fn in funcs if callable(getattr(fn, "metrics", None)) for key, value in fn.metrics().items()}


# ---------------------------------------------------------------------------------------------- compute_rewards


def _as_scores(fn: RewardFn, values: Any, n: int) -> list[float]:
    """Check one reward function's output (a list of N numbers or None) and convert it to floats, None -> NaN."""
    name = reward_name(fn)
    if hasattr(values, "tolist"):  # numpy arrays and tensors
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"reward function {name!r} must return a list of {n} floats (or None), got {type(values).__name__}"
        )
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} scores for {n} completions")
    scores = []
    for i, v in enumerate(values):
        if v is None:
            scores.append(math.nan)
            continue
        if not isinstance(v, numbers.Real):  # bools are Integral, hence Real
            raise TypeError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) at index {i}: "
                "scores must be numbers, or None to leave a sample unscored"
            )
        if not math.isfinite(v):
            raise ValueError(
                f"reward function {name!r} returned the non-finite score {v!r} at index {i}: "
                "return None to leave a sample unscored"
            )
        if abs(v) > _FLOAT32_MAX:
            raise ValueError(f"reward function {name!r} returned {v!r} at index {i}, beyond the float32 range")
        scores.append(float(v))
    return scores


class RewardError(ValueError):
    """A reward function raised. One line: the function, where (the line of its own file the exception came
    through, else where it is defined) and the exception, ``reward_func my_reward (rewards.py:12) raised KeyError:
    'answer'``; the exception itself, with its traceback, is ``error`` (and ``__cause__``). The trainer sets
    ``when`` (``"at step 3"``), which ends the message, and ``checkpoint``, the one it saved or found to resume
    from (None: none)."""

    def __init__(self, fn: RewardFn, error: BaseException):
        self.function, self.location, self.error = reward_name(fn), _location(fn, error), error
        self.when: str | None = None
        self.checkpoint: Path | None = None
        lines = str(error).strip().splitlines()
        told = f": {lines[0]}{' ...' if len(lines) > 1 else ''}" if lines else ""
        super().__init__(f"reward_func {self.function} ({self.location}) raised {type(error).__name__}{told}")

    def __str__(self) -> str:
        return super().__str__() + (f" {self.when}" if self.when else "")


class RewardOutputError(RewardError, TypeError):
    """A reward function returned what is no list of one score (or None) per completion: the function failed, as if
    it had raised (the trainer saves the last finished step and stops with one line). A ``TypeError`` and a
    ``ValueError`` both, as the check that found it raised before. ``error``: that check's exception."""

    def __init__(self, fn: RewardFn, error: BaseException):
        super().__init__(fn, error)
        ValueError.__init__(self, f"reward_func {self.function} ({self.location}) returned a bad value: {error}")


def _location(fn: RewardFn, error: BaseException) -> str:
    """``file:line`` of ``fn`` for a message: the last line of its own file in ``error``'s traceback (where it
    raised, or called what raised), else the line that defines it; the file relative to the working directory
    when it is below it."""
    while hasattr(fn, "func") and not hasattr(fn, "__code__"):  # functools.partial
        fn = fn.func
    code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(getattr(type(fn), "__call__", None),
                                                                     "__code__", None)
    if code is None:
        return "unknown file"
    line = code.co_firstlineno
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == code.co_filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    path = Path(code.co_filename)
    try:
        path = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:  # not below the working directory: the full path
        pass
    return f"{path}:{line}"


def compute_rewards(
    funcs: Sequence[RewardFn], prompts: list, completions: list, columns: dict[str, list]
) -> torch.Tensor:
    """Score every completion with every reward function: a float32 ``[N, K]`` tensor, NaN where a function
    returned ``None``.

    Each function is called as ``fn(prompts=prompts, completions=completions, **columns)``; ``columns`` holds the
    other dataset columns, one value per completion. An exception from a function is re-raised as
    :class:`RewardError`, which names it.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions (repeat each prompt once per completion)")
    for column, values in columns.items():
        if column in ("prompts", "completions"):
            raise ValueError(f"dataset column {column!r} clashes with the reward-function argument of that name")
        if len(values) != n:
            raise ValueError(f"column {column!r} has {len(values)} values for {n} completions")
    rewards = torch.empty(n, len(funcs), dtype=torch.float32)
    for k, fn in enumerate(funcs):
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except KeyboardInterrupt:  # Ctrl-C: the trainer's own handling (finish the step, save)
            raise
        except BaseException as e:  # SystemExit (sys.exit in a reward) too: the function failed, the run did not
            raise RewardError(fn, e) from e
        try:
            scores = _as_scores(fn, values, n)
        except (TypeError, ValueError) as e:
            raise RewardOutputError(fn, e) from None
        rewards[:, k] = torch.tensor(scores, dtype=torch.float32)
    return rewards


# ------------------------------------------------------------------------------------------------ a run's rewards


def score(run, records: list[dict], completions: list, group_size: int, environments: list | None = None
          ) -> torch.Tensor:
    """``[N, K]`` rewards (NaN: not scored) for the ``N = len(records) * group_size`` completions, by ``run``'s reward
    functions (``run``: the trainer's ``Run``).

    As in TRL, a completion of a conversational prompt (a list of messages) reaches the reward functions as
    ``[{"role": "assistant", "content": text}]``, a plain-text prompt's as the text; a multi-turn completion comes as
    its message list already (the assistant's turns and the tool messages), and the rows' environments, when the run
    has one, as the ``environments`` column (TRL's).
    """
    rows = [r for r in records for _ in range(group_size)]
    prompt_column = run.config.prompt_column
    names = dict.fromkeys(k for r in records for k in r if k != prompt_column)  # rows may differ in columns
    columns = {k: [r.get(k) for r in rows] for k in names}
    if environments is not None and any(env is not None for env in environments):
        columns["environments"] = list(environments)
    prompts = [r[prompt_column] for r in rows]
    completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) and isinstance(c, str) else c
                   for p, c in zip(prompts, completions)]
    return compute_rewards(run.reward_funcs, prompts, completions, columns)


def weighted_reward(run, rewards: torch.Tensor) -> torch.Tensor:
    """``[N]``: each completion's weighted sum over the reward functions (unscored ones count 0)."""
    return torch.nansum(rewards * run.reward_weights, dim=1)
