"""Reward functions: math equality, format matching, loading by spec and the checked reward matrix."""

from __future__ import annotations

import importlib.util
import math
import sys
import threading

import pytest
import torch

from grpo_fast.train.rewards import (
    BUILTIN_REWARDS,
    compute_rewards,
    format_reward,
    load_reward,
    make_format_reward,
    math_reward,
    reward_name,
)

needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify")

# (gold answer, completion, expected score)
MATH_CASES = [
    ("0.5", "So the result is \\frac{1}{2}.", 1.0),
    ("\\frac{1}{2}", "The answer is 0.5", 1.0),
    ("$\\frac{1}{2}$", "\\boxed{\\frac12}", 1.0),
    ("7", "Adding them up gives \\boxed{7}", 1.0),
    ("7", "The answer is 7.", 1.0),
    ("7", "7", 1.0),
    ("42", "<think>6 times 7</think>\n<answer>42</answer>", 1.0),
    ("\\sqrt{2}", "<answer>\\sqrt{2}</answer>", 1.0),
    ("3\\pi", "The area is $3\\pi$.", 1.0),
    ("1,000", "\\boxed{1000}", 1.0),
    (7, "\\boxed{7}", 1.0),  # a number straight from JSON
    ("7", "The answer is 8.", 0.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("7", "no idea, sorry", 0.0),
    ("7", "", 0.0),
    ("7", "}}\\boxed{{\\frac{", 0.0),
]


def _math_scores():
    golds = [gold for gold, _, _ in MATH_CASES]
    completions = [completion for _, completion, _ in MATH_CASES]
    return math_reward(["q"] * len(MATH_CASES), completions, answer=golds, unused_column=[0] * len(MATH_CASES))


@needs_math_verify
def test_math_reward_cases():
    expected = [score for _, _, score in MATH_CASES]
    assert _math_scores() == expected


@needs_math_verify
def test_math_reward_none_answer_and_chat_completions():
    completions = [[{"role": "assistant", "content": "\\boxed{7}"}], "\\boxed{7}", "7"]
    assert math_reward(["q"] * 3, completions, answer=["7", None, ""]) == [1.0, None, None]


@needs_math_verify
def test_math_reward_from_a_worker_thread():
    """math_verify's signal-based timeouts raise outside the main thread: the reward must turn them off there."""
    result = {}

    def work():
        try:
            result["scores"] = _math_scores()
        except BaseException as e:  # noqa: BLE001 - reported on the main thread below
            result["error"] = e

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert result["scores"] == [score for _, _, score in MATH_CASES]


def test_format_reward_default_pattern():
    completions = [
        "<think>reasoning</think><answer>7</answer>",
        "  <think>multi\nline</think>\n\n<answer>\n7\n</answer>\n",
        [{"role": "assistant", "content": "<think>x</think> <answer>y</answer>"}],
        "<answer>7</answer>",
        "<think>x</think><answer>7</answer> trailing text",
        "The answer is 7",
    ]
    assert format_reward(["q"] * 6, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_reward_pattern_argument_and_column():
    assert format_reward(["q", "q"], ["ANSWER: 3", "3"], pattern=r"ANSWER: \d+") == [1.0, 0.0]
    per_sample = [r"ANSWER: \d+", None]  # a dataset column named "pattern"; None keeps the default
    completions = ["ANSWER: 3", "<think></think><answer></answer>"]
    assert format_reward(["q", "q"], completions, pattern=per_sample) == [1.0, 1.0]


def test_make_format_reward():
    fn = make_format_reward(r"Final: \d+", name="final_number")
    assert fn.__name__ == "final_number"
    assert fn(["q"] * 3, ["Final: 12", "Final:12", "Final: 1\nmore"], answer=[1, 2, 3]) == [1.0, 0.0, 0.0]
    assert make_format_reward(r"\d+").__name__ == "format_reward[\\d+]"
    with pytest.raises(ValueError, match=r"invalid format-reward pattern '\(unclosed'"):
        make_format_reward("(unclosed")


# ---------------------------------------------------------------------------------------------------- load_reward


def test_load_builtin_rewards():
    assert load_reward("math") is math_reward
    assert load_reward(" format ") is format_reward
    assert set(BUILTIN_REWARDS) == {"math", "exact", "format", "code", "last_number"}


def test_load_builtin_code_reward():
    sandbox = pytest.importorskip("grpo_fast.sandbox")
    assert load_reward("code") is sandbox.code_reward


def _write_module(directory, name, body="def length_penalty(prompts, completions, **kwargs):\n"
                  "    return [-len(c) / 100 for c in completions]\n\nTHRESHOLD = 3\n"):
    path = directory / f"{name}.py"
    path.write_text(body)
    return path


def test_load_reward_from_file_path(tmp_path):
    path = _write_module(tmp_path, "file_rewards")
    fn = load_reward(f"{path}:length_penalty")
    assert fn(["q"], ["abcd"]) == [-0.04]
    assert load_reward(f"{path}:length_penalty") is fn  # the file is imported once


def test_load_reward_from_module_on_sys_path(tmp_path, monkeypatch):
    _write_module(tmp_path, "syspath_rewards")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fn = load_reward("syspath_rewards:length_penalty")
        assert reward_name(fn) == "length_penalty"
        assert fn(["q"], ["ab"]) == [-0.02]
    finally:
        sys.modules.pop("syspath_rewards", None)


FORMS = r"Expected a built-in reward \(code, exact, format, last_number, math\), 'module:function'"


@pytest.mark.parametrize("spec", ["mathh", "no_colon_module", ":fn", "module:"])
def test_load_reward_bad_spec(spec):
    with pytest.raises(ValueError, match=rf"cannot load reward '{spec}': not a built-in name.*{FORMS}"):
        load_reward(spec)


def test_load_reward_module_not_found():
    with pytest.raises(ImportError, match=rf"module 'surely_no_such_module_xyz' not found.*{FORMS}"):
        load_reward("surely_no_such_module_xyz:fn")


def test_load_reward_module_with_a_missing_dependency(tmp_path, monkeypatch):
    _write_module(tmp_path, "broken_dep_rewards", "import surely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="importing module 'broken_dep_rewards' failed: No module named "
                                          "'surely_missing_dependency_xyz'"):
        load_reward("broken_dep_rewards:fn")


def test_load_reward_file_errors(tmp_path):
    with pytest.raises(ImportError, match=rf"file '.*missing\.py' not found.*{FORMS}"):
        load_reward(f"{tmp_path}/missing.py:fn")
    broken = _write_module(tmp_path, "raising_rewards", "raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match=r"executing '.*raising_rewards\.py' raised RuntimeError: boom"):
        load_reward(f"{broken}:fn")


def test_load_reward_missing_attribute(tmp_path):
    path = _write_module(tmp_path, "attr_rewards")
    with pytest.raises(AttributeError, match=rf"has no attribute 'lenght_penalty' \(functions it defines: "
                                             rf"length_penalty\).*{FORMS}"):
        load_reward(f"{path}:lenght_penalty")


def test_load_reward_not_callable(tmp_path):
    path = _write_module(tmp_path, "value_rewards")
    with pytest.raises(TypeError, match=rf"value_rewards\.py:THRESHOLD is a int, not a function.*{FORMS}"):
        load_reward(f"{path}:THRESHOLD")


# ------------------------------------------------------------------------------------------------ compute_rewards


def _const(values, name="const"):
    def fn(prompts, completions, **kwargs):
        return values

    fn.__name__ = name
    return fn


def test_compute_rewards_matrix_with_nan_for_none():
    def uses_column(prompts, completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]

    out = compute_rewards(
        [uses_column, _const([None, True, 2]), _const(torch.tensor([0.5, 0.25, 0.0]))],
        prompts=["p"] * 3,
        completions=["a", "b", "c"],
        columns={"answer": ["a", "x", "c"], "other": [1, 2, 3]},
    )
    assert out.dtype == torch.float32 and out.shape == (3, 3)
    expected = torch.tensor([[1.0, math.nan, 0.5], [0.0, 1.0, 0.25], [1.0, 2.0, 0.0]])
    torch.testing.assert_close(out, expected, equal_nan=True)


@pytest.mark.parametrize(
    "values,error,message",
    [
        ([1.0, 2.0], ValueError, "reward function 'bad' returned 2 scores for 3 completions"),
        ("abc", TypeError, "reward function 'bad' must return a list of 3 floats \\(or None\\), got str"),
        ([1.0, "0.5", []], TypeError, "reward function 'bad' returned '0.5' \\(str\\) at index 1"),
        ([1.0, 0.0, math.inf], ValueError, "reward function 'bad' returned the non-finite score inf at index 2"),
        ([math.nan, 0.0, 0.0], ValueError, "non-finite score nan at index 0: return None"),
        ([1e300, 0.0, 0.0], ValueError, "beyond the float32 range"),
    ],
)
def test_compute_rewards_rejects_bad_output(values, error, message):
    with pytest.raises(error, match=message):
        compute_rewards([_const([0.0] * 3, "good"), _const(values, "bad")], ["p"] * 3, ["a", "b", "c"], {})


def test_compute_rewards_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="got 2 prompts for 3 completions"):
        compute_rewards([_const([0.0] * 3)], ["p"] * 2, ["a", "b", "c"], {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values for 3 completions"):
        compute_rewards([_const([0.0] * 3)], ["p"] * 3, ["a", "b", "c"], {"answer": ["a"]})


def test_exact_reward():
    from grpo_fast.train.rewards import exact_reward

    completions = [" 7 ", "7.0", [{"role": "assistant", "content": "7"}], "8"]
    assert exact_reward([None] * 5, completions + ["x"], ["7", "7", "7", "7", None]) == [1.0, 0.0, 1.0, 0.0, None]
    assert load_reward("exact") is exact_reward
