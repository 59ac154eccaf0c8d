"""The code reward's judge against values built to hurt it or to fool it: bounded in the parent's time and memory
whatever the child hands back, NaN earning nothing where a test pins a number, and methods chained on the
completion's value judged by the parent.

The end-to-end cases run a real sandbox (Linux); the judge-level ones feed values straight to
:func:`grpo_fast.sandbox.asserts.judge`, as a child that was taken over could send them.
"""

from __future__ import annotations

import json
import math
import sys
import time
import tracemalloc

import pytest

from grpo_fast.sandbox import plain_data
from grpo_fast.sandbox.asserts import judge, parse_test
from grpo_fast.sandbox import SandboxLimits, run_tests

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")

LIMITS = SandboxLimits(timeout_s=5.0)
MARGIN_S = 3.0  # interpreter start-up and the kill, on a loaded 2-core CI machine
PARENT_BYTES = 256 << 20  # the most the parent may allocate (Python objects) to judge one run (2**20 short strings: 64 MiB)


def _judged(code: str, tests: list[str] | str):
    """run_tests, checked to return within its limit and to allocate little in the parent.

    Timed on its own, then run again under tracemalloc for the parent's peak: tracing every allocation slows the
    parent's loops tenfold or more (``max(range(2**20))``: 0.1 s, 3 s traced), which would time the tracer, not the
    judge."""
    start = time.monotonic()
    result = run_tests(code, tests, LIMITS)
    assert time.monotonic() - start < LIMITS.timeout_s + MARGIN_S, result
    tracemalloc.start()
    try:
        traced = run_tests(code, tests, SandboxLimits(timeout_s=60.0))  # the whole judgement, however slow traced
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PARENT_BYTES, f"the parent allocated {peak / 2**20:.0f} MiB judging {tests!r}"
    assert (traced.passed, traced.status) == (result.passed, result.status), (result, traced)
    return result


def _judge(test: str, *values) -> str | None:
    return judge(parse_test(test), [("value", v) for v in values])


# ------------------------------------------------------------------------------- bounded whatever comes back


HUGE_RANGES = [
    ("def f(x): return range(10**18)", "assert max(f(3)) == 2"),
    ("def f(x): return range(10**18)", "assert sum(f(3)) == 3"),
    ("def f(x): return range(10**8)", "assert list(f(3)) == [0, 1, 2]"),
    ("def f(x): return range(10**8)", "assert sorted(f(3)) == [0, 1, 2]"),
    ("def f(x): return range(10**8)", "assert len(set(f(3))) == 3"),
    ("def f(x): return range(10**18)", "assert 2.5 not in f(3)"),  # a float is looked for item by item
    ("def f(x): return range(0, 10**18, 7)", "assert any(v == -1 for v in f(3)) == False"),
    ("def f(x): return [range(10**9)]", "assert max(f(3)[0]) == 2"),
    ("def f(x): return {'r': range(10**9)}", "assert tuple(f(3)['r']) == (0, 1, 2)"),
    ("def f(x): return iter([range(10**9)])", "assert [max(r) for r in f(3)] == [2]"),
]


@linux_only
@pytest.mark.parametrize(("code", "test"), HUGE_RANGES)
def test_a_huge_range_from_the_child_is_not_plain_data(code, test):
    result = _judged(code, [test])
    assert result.passed == 0 and result.status == "failed", result
    assert "not plain" in result.detail and "range of" in result.detail, result.detail


@linux_only
def test_ranges_up_to_the_bound_still_travel():
    result = _judged("def f(x): return range(x)", ["assert max(f(2**20)) == 2**20 - 1", "assert f(3) == range(3)"])
    assert result.passed == 2, result


@linux_only
@pytest.mark.parametrize(("code", "test"), [
    ("def f(x): return 10**12", "assert bytes(f(3)) == b''"),
    ("def f(x): return 'x' * 500_000", "assert f(3).join(['a'] * 1000) == ''"),
    ("def f(x): return 'x' * 500_000", "assert ','.join([f(3)] * 3) != ''"),  # bounded by the value's budget: passes
    ("def f(x): return 'x' * 500_000", "assert f(3).join(map(str, range(2**20))) == ''"),
    ("def f(x): return 'x' * 500_000", "assert ('a' * 2**20).replace('a', f(3)) == ''"),
    ("def f(x): return 'x' * 500_000", "assert 'ab'.replace('', f(3)) != ''"),  # 3 copies: small enough, passes
    ("def f(x): return list(range(400_000))", "assert len([a for a in f(3) for b in range(10**5)]) == 1"),
    ("def f(x): return 2**1_000_000", "assert f(3) ** 9 == 1"),
    ("def f(x): return 2**1_000_000", "assert f(3) == 1"),  # the message names the int's size, not its digits
    ("def f(x): return [2**100_000, 1.5]", "assert f(3) == [1]"),
])
def test_what_the_parent_computes_over_a_value_is_bounded(code, test):
    result = _judged(code, [test])
    passes = "!= ''" in test
    assert result.passed == int(passes), result


def test_from_tree_refuses_a_huge_range_a_child_could_write_by_hand():
    with pytest.raises(ValueError, match="range of"):
        plain_data.from_tree(json.loads('{"range": [0, 1000000000000000000, 1]}'))
    with pytest.raises(ValueError, match="range"):
        plain_data.from_tree(json.loads('{"range": [0, 10, 0]}'))
    assert plain_data.from_tree({"range": [0, plain_data.MAX_RANGE_ITEMS, 1]}) == range(plain_data.MAX_RANGE_ITEMS)
    assert plain_data.from_tree({"range": [10**18, 0, -10**17]}) == range(10**18, 0, -10**17)


def test_to_tree_refuses_a_huge_range():
    with pytest.raises(plain_data.NotPlain, match="range of"):
        plain_data.to_tree(range(plain_data.MAX_RANGE_ITEMS + 1), plain_data.Budget(plain_data.MAX_VALUE_CHARS))


def test_a_join_stops_drawing_pieces_once_its_result_is_too_long():
    drawn = []

    def pieces():
        for i in range(2**20):
            drawn.append(i)
            yield str(i)

    why = _judge("assert f(1).join(f(2)) == ''", "x" * 500_000, pieces())
    assert why is not None and "a join of more than" in why
    assert len(drawn) < 40  # 2**24 characters / 500,000 per separator: the parent stopped after 34 pieces
    assert _judge("assert ''.join(f(1)) == '0123'", (str(i) for i in range(4))) is None


def test_judging_stops_at_its_deadline():
    plan = parse_test("assert len([a for a in f(1) for b in range(1000)]) == 0")  # 10**6 steps: seconds in the parent
    values = [("value", list(range(1000)))] * len(plan.holes)
    start = time.monotonic()
    why = judge(plan, values, deadline=time.monotonic() + 0.05)
    assert time.monotonic() - start < 1.0
    assert why is not None and "time limit" in why
    # a run whose judging time is spent fails the checks that remain, however small
    assert "time limit" in judge(parse_test("assert f(1) == 2"), [("value", 2)], deadline=time.monotonic() - 1)
    assert judge(parse_test("assert f(1) == 2"), [("value", 2)], deadline=time.monotonic() + 1) is None


@linux_only
def test_one_runs_judging_time_is_shared_by_its_tests():
    slow = "assert len([a for a in f(1) for b in range(3000)]) == 0"
    start = time.monotonic()
    result = run_tests("def f(x): return list(range(3000))", [slow] * 20, SandboxLimits(timeout_s=1.0))
    assert time.monotonic() - start < 1.0 + MARGIN_S
    assert result.passed == 0


# --------------------------------------------------------------------------------------------- the NaN rule


NAN = math.nan


@pytest.mark.parametrize(("test", "value"), [
    ("assert not abs(f(2) - 4) > 1e-9", NAN),
    ("assert not f(3) < 0", NAN),
    ("assert f(3) != 4", NAN),
    ("assert max(0, f(3)) == 0", NAN),  # max(0, nan) is 0
    ("assert not math.isclose(f(3), 0)", NAN),
    ("import math\nassert not math.isclose(f(3), 0)", NAN),
    ("assert f(3) not in [1, 2]", NAN),
    ("assert f(3) == [1, 2] or True", [1, NAN]),  # a check that uses a NaN-holding value fails whatever it computes
    ("assert not f(3) == (1, 2)", (1, NAN)),
    ("assert f(3) != {'a': 1}", {"a": NAN}),
    ("assert f(3) != 1", complex(0, NAN)),
    ("assert sorted(f(3)) != [1]", {NAN}),
    ("assert list(f(3)) != [1]", iter([1, NAN])),
    ("assert not math.isfinite(f(3)) and f(3) != 1", NAN),  # the second hole is not asked about NaN
])
def test_a_nan_fails_every_check_that_does_not_ask_for_it(test, value):
    plan = parse_test(test.replace("assert not math", "import math\nassert not math", 1)
                      if "import" not in test and "math." in test else test)
    why = judge(plan, [("value", value)] * len(plan.holes))
    assert why is not None and "NaN" in why, why


@pytest.mark.parametrize(("test", "value", "passes"), [
    ("import math\nassert math.isnan(f(3))", NAN, True),
    ("import math\nassert not math.isnan(f(3))", NAN, False),
    ("import math\nassert not math.isnan(f(3))", 2.0, True),
    ("import math\nassert math.isnan(f(3)[1])", NAN, True),  # the hole is f(3)[1]
    ("from math import isnan\nassert isnan(f(3))", NAN, True),
    ("import math\nassert math.isinf(f(3)) or math.isnan(f(4))", NAN, True),
    ("import math\nassert not math.isfinite(f(3))", NAN, True),
    ("assert f(3) == 4", 4.0, True),  # no NaN: judged as before
    ("assert f(3) != [1]", [math.inf], True),
])
def test_a_nan_is_judged_where_the_test_asks_about_it(test, value, passes):
    plan = parse_test(test)
    why = judge(plan, [("value", value)] * len(plan.holes))
    assert (why is None) == passes, why


@linux_only
def test_a_policy_returning_nan_scores_nothing_in_the_sandbox():
    tests = ["assert not abs(f(2) - 4) > 1e-9", "assert not f(3) < 0", "assert f(1) != 7",
             "import math\nassert not math.isclose(f(2), 3.0)"]
    assert _judged("def f(x): return float('nan')", tests).passed == 0
    assert _judged("def f(x): return x * x", tests).passed == 4
    assert _judged("def f(x): return float('nan')", ["import math\nassert math.isnan(f(0))"]).passed == 1


# ------------------------------------------------------------------------- methods chained on the value


FAKE = """
class Yes:
    def __getattr__(self, name):
        return lambda *args, **kwargs: True
    def __eq__(self, other):
        return True
    def __contains__(self, item):
        return True
def f(x):
    return Yes()
"""


@linux_only
@pytest.mark.parametrize("test", [
    "assert f('abc').startswith('a')",
    "assert f('abc').endswith('c') and f('abc').isalpha()",
    "assert f([1, 2]).count(2) == 1",
    "assert f({'a': 1}).get('a') == 1",
    "assert f('a,b').split(',')[0] == 'a'",
    "assert f({1, 2}).issubset({1, 2, 3})",
])
def test_a_fake_object_gains_nothing_from_a_chained_method(test):
    result = _judged(FAKE, [test])
    assert result.passed == 0, result
    real = _judged("def f(x): return x", [test])
    assert real.passed == 1, real


@pytest.mark.parametrize("test", [
    "assert f(2).__eq__(4)",
    "assert f(2).__contains__(3)",
    "assert f(2).__class__ is int",
    "assert f(2).__len__() == 1",
    "assert g.__call__(2) == 4",
])
def test_dunder_calls_in_the_sandbox_are_refused_when_the_test_is_read(test):
    with pytest.raises(ValueError, match="__"):
        parse_test(test)


def test_a_method_of_a_value_the_parent_has_not_got_fails_with_the_reason():
    why = _judge("assert f(2).startswith('a')", 2)
    assert why is not None and "int.startswith" in why


# ------------------------------------------------------------------------------------- review's variants


@pytest.mark.parametrize(("test", "value"), [
    ("assert f(3).isupper()", b"ABC"),
    ("assert f(3).index(2) == 2", range(5)),
    ("assert f(3).count(4) == 1", range(5)),
    ("assert f(3).hex() == '0x1.8000000000000p+0'", 1.5),
    ("assert f(3).as_integer_ratio() == (3, 2)", 1.5),
    ("assert f(3).replace(b'a', b'b') == b'bb'", b"aa"),
])
def test_methods_of_every_plain_type_are_the_parents(test, value):
    assert _judge(test, value) is None


def test_a_nan_made_in_the_parent_fails_the_comparison():
    inf = math.inf
    plan = parse_test("assert not abs(f(2) - 4) / max(1, abs(f(2))) > 1e-9")
    why = judge(plan, [("value", inf)] * len(plan.holes))
    assert why is not None and "NaN" in why
    assert _judge("assert f(2) == 4", 4.0) is None


def test_a_repr_is_bounded_by_characters_not_items():
    start = time.monotonic()
    why = _judge("assert len(repr((f(3),) * 2000)) == 0", "x" * 500_000)
    assert time.monotonic() - start < 1.0 and why is not None and "repr of more than" in why
    assert _judge("assert repr(f(3)) == \"'ab'\"", "ab") is None


@pytest.mark.parametrize("tree", [{"range": [0, 10**30, 1]}, {"range": [-(10**30), 0, 1]}, {"complex": [10**400, 0]},
                                  {"range": [0, 10, 10**20]}])
def test_from_tree_refuses_forged_huge_numbers_with_a_value_error(tree):
    with pytest.raises(ValueError):
        plain_data.from_tree(tree)


@linux_only
def test_a_completion_forging_a_huge_range_on_the_channel_scores_nothing_and_raises_nothing():
    code = (
        "import os, json\n"
        "for fd in range(3, 30):\n"
        "    try:\n"
        "        os.write(fd, (json.dumps({'code': 'ok'}) + '\\n' + json.dumps({'i': 0, 'r': [['v', "
        "{'range': [0, 10**30, 1]}]]}) + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "def f(x): return 0\n"
    )
    result = _judged(code, ["assert max(f(3)) == 2"])
    assert result.passed == 0, result
