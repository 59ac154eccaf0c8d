"""The code reward's tests as the trusted parent reads and judges them (grpo_fast.sandbox.asserts), and the plain data
that is all the sandbox may send back (grpo_fast.sandbox.plain_data). No sandbox runs here: tests/test_sandbox.py runs
completions, hostile ones included, against these rules."""

from __future__ import annotations

import json
import math
import time

import pytest

from grpo_fast.sandbox import plain_data
from grpo_fast.sandbox.asserts import judge, parse_test
from grpo_fast.train.data import load_records


def _judge(test: str, *values) -> str | None:
    """judge() with each value given as the hole's plain value, or as ("raised" / "not plain", why)."""
    outcomes = [v if isinstance(v, tuple) and v[:1] in (("raised",), ("not plain",)) else ("value", v) for v in values]
    return judge(parse_test(test), outcomes)


# ------------------------------------------------------------------------------------------------- the split


@pytest.mark.parametrize(("test", "steps"), [
    ("assert f(2) == 4", [("eval", "f(2)")]),
    ("assert 1 + 1 == 2", []),  # names nothing of the completion's: the parent alone decides
    ("assert sorted(f([3, 1])) == [1, 3]", [("eval", "f([3, 1])")]),
    ("import math\nassert abs(f(1) - math.pi) < 1e-9, 'message never evaluated: g(0)'",
     [("exec", "import math"), ("eval", "f(1)")]),
    ("assert not is_prime(9)", [("eval", "is_prime(9)")]),  # the sandbox never sees the `not`
    ("assert Stack([1]).pop() == 1", [("eval", "Stack([1]).pop()")]),  # calls on the completion's values: the hole
    # a method of the plain types on the completion's value: the sandbox sends the value, the parent calls the method
    ("assert f(x)[0] == 1 and f(x).count(3) == 2", [("eval", "f(x)[0]"), ("eval", "f(x)")]),
    ("assert f('abc').startswith('a')", [("eval", "f('abc')")]),
    ("assert f(x).split(',')[0] == 'a'", [("eval", "f(x)")]),
    ("assert sorted(f(x)).count(3) == 2", [("eval", "f(x)")]),  # a method of a value the parent made: the parent's
    ("assert all(isinstance(v, int) for v in f(3))", [("eval", "f(3)")]),
    ("assert sorted(f(x), key=lambda t: t[1]) == [(1, 1)]", [("eval", "f(x)")]),
    ("from math import isclose\nassert isclose(f(1), 2.0)", [("exec", "from math import isclose"), ("eval", "f(1)")]),
    ("assert {g(1): f(2)} == {1: 2}", [("eval", "g(1)"), ("eval", "f(2)")]),  # Python's order: key, then value
    ("assert f(1) == 2\nimport heapq\nassert f(heapq.nsmallest(1, [3])) == 4",
     [("eval", "f(1)"), ("exec", "import heapq"), ("eval", "f(heapq.nsmallest(1, [3]))")]),
])
def test_holes_are_the_parts_that_use_the_code_under_test(test, steps):
    plan = parse_test(test)
    assert list(plan.steps) == steps
    assert list(plan.holes) == [source for kind, source in steps if kind == "eval"]


@pytest.mark.parametrize(("test", "why"), [
    ("for x in range(3):\n    assert f(x) == 2 * x", "the For statement on line 1 would run in the sandbox"),
    ("expected = 6\nassert f(3) == expected", "the Assign statement on line 1 would run in the sandbox"),
    ("def check(candidate):\n    assert candidate(1) == 2\ncheck(f)", "the FunctionDef statement on line 1"),
    ("f(1)", "the Expr statement on line 1"),
    ("import math", "it holds no assert"),
    ("assert f(1) == f(2)", "both sides of 'f(1) == f(2)' come from the sandbox"),
    ("from fractions import Fraction\nassert f(1) == Fraction(1, 2)", "both sides of 'f(1) == Fraction(1, 2)'"),
    ("from fractions import Fraction\nassert Fraction(1, 2) + 0 == 0.5",
     "'Fraction(1, 2)' would run 'Fraction' in the sandbox, where the code under test can replace it (the test "
     "imports it)"),
    ("assert callable(f)", "'callable(f)' would run 'callable' in the sandbox"),
    ("assert math.factorial(f(3)) == 6", "would run 'math' in the sandbox"),
    ("assert all(f(v) == 2 * v for v in range(5))",
     "'f(v)' uses the code under test inside a lambda or a comprehension"),
    ("assert sorted([2, 1], key=lambda v: f(v)) == [1, 2]", "uses the code under test inside a lambda"),
    ("assert f(1) is g", "both sides of 'f(1) is g'"),
    ("assert f(1) is 3", "the parent compares identity only with None, True, False, ... or a type"),
    ("assert (y := f(1)) == 2", "the parent does not evaluate NamedExpr expressions"),
    ("assert f'{f(1)}' == '2'", "the parent does not evaluate JoinedStr expressions"),
    ("assert 'abc'.center(9) == 'abc'", "the parent does not call \"'abc'.center\""),
    ("from os import *\nassert f(1) == 2", "'from os import *' binds names the parent cannot know"),
    ("assert f(1) == 2\nassert", "must be Python code (assert statements): invalid syntax on line 2"),
])
def test_a_test_the_parent_cannot_judge_is_refused_with_the_reason(test, why):
    with pytest.raises(ValueError) as error:
        parse_test(test, "tests[3]")
    message = str(error.value)
    assert message.startswith("tests[3] must be ")
    assert why in message
    assert message.endswith(f"got {test!r:.200}")


def test_a_dataset_with_a_test_the_parent_cannot_judge_is_refused_when_it_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "p", "tests": ["assert f(1) == 2"]},
            {"prompt": "q", "tests": ["assert f(1) == 2", "x = f(1)\nassert x == 2"]}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl, line 2: column 'tests'\[1\] must be assert statements the "
                                         r"parent can judge \(and imports\): the Assign statement on line 1"):
        load_records(path, required=("tests",))
    assert load_records(path, required=("tests",), limit=1)[0]["tests"] == ["assert f(1) == 2"]


# --------------------------------------------------------------------------------------------------- judging


@pytest.mark.parametrize(("test", "values", "why"), [
    ("assert f(2) == 4", [4], None),
    ("assert f(2) == 4", [4.0], None),  # == as Python: 4.0 == 4
    ("assert f(2) == 4", [5], "assert f(2) == 4: it is False (with f(2) = 5)"),
    ("assert f(1) == 1", [True], None),  # True == 1, as in Python
    ("assert f(2) == 4", [("raised", "ZeroDivisionError: division by zero")],
     "assert f(2) == 4: f(2) raised: ZeroDivisionError: division by zero"),
    ("assert f(2) == 4", [("not plain", "a Liar is not plain data")],
     "assert f(2) == 4: f(2) not plain: a Liar is not plain data"),
    # a truth value must be True or False
    ("assert is_prime(7)", [True], None),
    ("assert is_prime(7)", [1], "assert is_prime(7): its value is 1 (int), not True (with is_prime(7) = 1)"),
    ("assert not is_prime(9)", [False], None),
    ("assert not is_prime(9)", [[]],
     "assert not is_prime(9): a truth value must be True or False, got [] (list) (with is_prime(9) = [])"),
    ("assert f(1) and f(2)", [True, "yes"],
     "assert f(1) and f(2): a truth value must be True or False, got 'yes' (str) (with f(1) = True, f(2) = 'yes')"),
    ("assert (f(1), 'message')", [True],
     "assert (f(1), 'message'): its value is (True, 'message') (tuple), not True (with f(1) = True)"),
    ("assert f(1) or f(2)", [True, ("raised", "boom")], None),  # the parent stops where Python would
    ("assert f(1) or f(2)", [False, ("raised", "boom")], "assert f(1) or f(2): f(2) raised: boom (with f(1) = False)"),
    ("assert (f(1) if f(2) else 0) == 3", [True, 3], None),  # holes in Python's order: the condition first
    # the parent's own builtins, over the plain values
    ("assert sorted(f(0)) == [1, 2, 3]", [[3, 1, 2]], None),
    ("assert math.isclose(f(0.5), 0.25, rel_tol=1e-9)", [0.25 + 1e-12], None),
    ("assert isinstance(f(1), int) and type(f(2)) is not bool", [3, 3], None),
    ("assert isinstance(f(1), int)", ["3"], "assert isinstance(f(1), int): it is False (with f(1) = '3')"),
    ("assert sorted(f(x), key=lambda t: t[1]) == [(2, 1), (1, 2)]", [[(1, 2), (2, 1)]], None),
    ("assert all(isinstance(v, int) for v in f(3))", [[1, "a"]],
     "assert all((isinstance(v, int) for v in f(3))): it is False (with f(3) = [1, 'a'])"),
    ("assert list(gen(3)) == [0, 1, 2] and gen(4) != [0, 1, 2, 3]", [iter([0, 1, 2]), iter([0, 1, 2, 3])], None),
    ("assert set(f(x)) == {1, 2} and dict(f(y)).keys() == {'a'}", [[2, 1, 2], {"a": 1}], None),
    ("assert str(f(3)).startswith('ab') and '-'.join(f(4)) == 'a-b'", ["abc", ["a", "b"]], None),
    ("assert 0 < f(3) < 10 < f(4)", [5, 11], None),
    ("assert 0 < f(3) < 10 < f(4)", [5, 9], "assert 0 < f(3) < 10 < f(4): it is False (with f(3) = 5, f(4) = 9)"),
    ("assert f(1) < 'a'", [1], "assert f(1) < 'a': TypeError: '<' not supported between instances of 'int' and "
                               "'str' (with f(1) = 1)"),
    ("assert f(1) + f(2) == 5 and -f(3) == -3 and f(4)[1:] == [2]", [2, 3, 3, [2]], None),  # f(4)[1:]: a hole
])
def test_judge_evaluates_each_assert_over_the_plain_values(test, values, why):
    assert _judge(test, *values) == why


@pytest.mark.parametrize(("test", "value", "why"), [
    ("assert 'x' * f(1) == ''", 10 ** 9, "a repetition of more than 1048576 items"),
    ("assert [0] * f(1) == []", 10 ** 9, "a repetition of more than 1048576 items"),
    ("assert f(1) ** 10 ** 7 == 1", 3, "a power of more than 4194304 bits"),
    ("assert 1 << f(1) == 1", 10 ** 9, "a shift to more than 4194304 bits"),
    ("assert len(list(range(f(1)))) == 5", 10 ** 12, "range of 1000000000000 items, more than the parent makes"),
    ("assert sum(f(1), []) == []", [[1]] * 10, "the parent sums numbers only"),
    ("assert '%s' % f(1) == '1'", 1, "the parent does not %-format strings"),
    ("assert round(1.5, f(1)) == 2", 10 ** 9, "round to more than 10000 digits"),
    ("assert sorted(range(f(1)), key=lambda v: [w for w in range(1000)]) == []", 5000, "more than 1000000 steps"),
])
def test_what_the_parent_computes_is_bounded(test, value, why):
    start = time.monotonic()
    assert why in _judge(test, value)
    assert time.monotonic() - start < 5.0


COLLIDING = [k * (2 ** 61 - 1) + 7 for k in range(1, 50_001)]  # distinct ints that share one hash


@pytest.mark.parametrize("test", [
    "assert set(f(1)) == {1}", "assert len({*f(1)}) == 1", "assert {1}.union(f(1)) == {1}",
    "assert {v for v in f(1)} == {1}", "assert dict(zip(f(1), f(1))) == {}", "assert {v: 1 for v in f(1)} == {}",
    "assert frozenset(f(1)) == frozenset()",
])
def test_no_set_or_dict_of_colliding_hashes_is_built(test):
    # built, such a set takes quadratic time: 50,000 of them about a minute of the parent's
    start = time.monotonic()
    plan = parse_test(test)
    why = judge(plan, [("value", COLLIDING)] * len(plan.holes))
    assert why.startswith(f"assert {plan.checks[0].source}: ValueError: more than 8 distinct members share a hash")
    assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------------------------------------- plain data

PLAIN = [None, True, False, 0, -3, 2 ** 63, -(2 ** 100), 0.5, -0.0, math.inf, 1 + 2j, "", "é\n\"\\\ud800", b"\x00\xff",
         [], [1, [2, [3]]], (), (1, "a"), {"a": (1, 2), 3: None, (1, 2): [3]}, set(), {1, "x", (2, 3)},
         frozenset({frozenset({1})}), range(1, 9, 2), range(0), -(2 ** 63), 2 ** 63 - 1, -1.7976931348623157e308,
         complex(-1.7976931348623157e308, -math.inf), {-i: (-i, -0.1) for i in range(50)}]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_travel_exactly(value):
    budget = plain_data.Budget(plain_data.MAX_VALUE_CHARS)
    text = json.dumps(plain_data.to_tree(value, budget), separators=(",", ":"))  # as the sandbox's child writes it
    back = plain_data.from_tree(json.loads(text))
    assert back == value and type(back) is type(value)
    if isinstance(value, (list, tuple)):
        assert [type(v) for v in back] == [type(v) for v in value]
    assert len(text) <= plain_data.MAX_VALUE_CHARS - budget.left  # what it charged covers what it wrote


def test_nan_and_iterators_travel():
    budget = plain_data.Budget(1000)
    assert math.isnan(plain_data.from_tree(json.loads(json.dumps(plain_data.to_tree(math.nan, budget)))))
    back = plain_data.from_tree(json.loads(json.dumps(plain_data.to_tree((x for x in "ab"), budget))))
    assert type(back) is type(iter([])) and list(back) == ["a", "b"]


class _Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class _Liar:
    def __eq__(self, other):
        return True


@pytest.mark.parametrize(("value", "why"), [
    (_Int(3), "a _Int is not plain data"),
    (type("S", (str,), {})("x"), "a S is not plain data"),
    ([1, _Liar()], "a _Liar is not plain data"),
    ({"k": print}, "a builtin_function_or_method is not plain data"),
    ({1: lambda: 0}, "a function is not plain data"),
    ("x" * (1 << 20), "take more than 1048576 characters once encoded"),
    (list(range(1 << 20)), "take more than 1048576 characters once encoded"),
    (iter(int, 1), "take more than 1048576 characters once encoded"),  # endless: stopped by the budget
    (json.loads("[" * 70 + "]" * 70), "containers nested more than 64 deep"),
    (range(2 ** 64), "a range with ends beyond 2\\*\\*63"),
])
def test_anything_else_is_not_plain(value, why):
    with pytest.raises(plain_data.NotPlain, match=why):
        plain_data.to_tree(value, plain_data.Budget(plain_data.MAX_VALUE_CHARS))


@pytest.mark.parametrize("tree", [
    {"tuple": [1], "set": [2]}, {"object": []}, {"int": 5}, {"int": "zz"}, {"bytes": "0"}, {"complex": [True, 1]},
    {"complex": [1]}, {"range": [0, 1, 0]}, {"range": [0, True, 1]}, {"set": [[1]]}, {"dict": [[[1], 2]]},
    {"dict": [[1, 2, 3]]}, {"tuple": "ab"}, {"set": COLLIDING[:9]},
    json.loads("[" * 70 + "]" * 70),
])
def test_only_what_to_tree_writes_is_read(tree):
    with pytest.raises(ValueError):
        plain_data.from_tree(tree)
    assert plain_data.from_tree({"set": COLLIDING[:8]}) == set(COLLIDING[:8])  # up to 8 may share a hash
