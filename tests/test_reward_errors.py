"""A reward function that raises: ``compute_rewards`` re-raises it as one ``RewardError`` line naming the function,
the line of its own file the exception came through and the exception; the exception and its traceback stay
attached. (The trainer's and the CLI's handling: tests/test_cli_errors.py.)"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from grpo_fast.train.rewards import RewardError, compute_rewards

SOURCE = '''import json


def missing_column(prompts, completions, **kwargs):
    return [float(kwargs["answer"]) for _ in completions]


def deep(prompts, completions, **kwargs):
    return [json.loads("{not json") for _ in completions]


class Scorer:
    def __call__(self, prompts, completions, **kwargs):
        assert not completions, "first line\\nsecond line"


def interrupted(prompts, completions, **kwargs):
    raise KeyboardInterrupt


def leaves(prompts, completions, **kwargs):
    raise SystemExit(3)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("my_rewards", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)  # files below the working directory are named relative to it
    return mod


def _error(fn) -> RewardError:
    with pytest.raises(RewardError) as info:
        compute_rewards([fn], ["p", "p"], ["a", "b"], {})
    return info.value


def test_the_message_names_the_function_the_raising_line_and_the_exception(module):
    e = _error(module.missing_column)
    assert str(e) == "reward_func missing_column (my_rewards.py:5) raised KeyError: 'answer'"
    assert isinstance(e, ValueError) and isinstance(e.error, KeyError) and e.__cause__ is e.error
    assert e.error.__traceback__ is not None  # what --debug prints
    e.when = "at step 3"
    assert str(e).endswith("raised KeyError: 'answer' at step 3")


def test_an_exception_from_a_library_names_the_line_of_the_function_that_called_it(module):
    e = _error(module.deep)  # raised inside json: the user's own line is the one that called it
    assert str(e).startswith("reward_func deep (my_rewards.py:9) raised JSONDecodeError: Expecting property name")


def test_callable_objects_partials_and_multi_line_messages(module, tmp_path, monkeypatch):
    e = _error(module.Scorer())
    assert str(e) == "reward_func Scorer (my_rewards.py:14) raised AssertionError: first line ..."
    e = _error(functools.partial(module.missing_column))
    assert "(my_rewards.py:5) raised KeyError: 'answer'" in str(e)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not below the working directory: the full path
    assert f"({tmp_path / 'my_rewards.py'}:5)" in str(_error(module.missing_column))


def test_keyboard_interrupt_is_not_a_reward_failure(module):
    with pytest.raises(KeyboardInterrupt):
        compute_rewards([module.interrupted], ["p"], ["a"], {})


def test_system_exit_is_a_reward_failure(module):
    """sys.exit in a reward function (any BaseException but KeyboardInterrupt) fails the function, not the run."""
    e = _error(module.leaves)
    assert str(e) == "reward_func leaves (my_rewards.py:22) raised SystemExit: 3"
    assert isinstance(e.error, SystemExit) and e.__cause__ is e.error
