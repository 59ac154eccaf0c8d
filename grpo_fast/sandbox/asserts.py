"""The code reward's tests, split between the sandbox and the trusted parent: the sandbox computes values, the
parent decides what passes.

A test is a string of ``assert`` statements, with ``import`` statements among them if it needs any::

    assert add(2, 3) == 5
    assert sorted(primes_below(10)) == [2, 3, 5, 7]
    assert not is_prime(9), "9 = 3 * 3"

:func:`parse_test` reads it in the parent (``ast``) and cuts each assert's expression in two. The *holes* are the
parts that use the code under test: each maximal chain of names, calls, attributes and subscripts that starts at a
name of the completion (``add(2, 3)``, ``primes_below(10)``, ``Stack([1]).pop()``, ``result[0]``). The sandbox
evaluates only those, in the completion's namespace and in the order Python would, and sends back their values as
plain data (:mod:`grpo_fast.sandbox.plain_data`). Everything else (the literals, the operators, the comparisons, ``not``,
``and``, ``or``, and the builtins and ``math`` functions in :data:`PARENT_BUILTINS` and :data:`PARENT_MODULES`,
lambdas and comprehensions over them, the methods in ``_METHODS`` called on values the parent computed) never
enters the sandbox: :func:`judge` evaluates it in the parent, over those plain values. The expected values therefore
never reach the code under test, and what the child says about passing counts for nothing: it has no way to say it.

The rules, each one so that no test passes without the code under test producing the values the test asks for:

* An assert passes when its expression is exactly ``True``. Wherever the test takes a truth value (the assert itself,
  ``not``, ``and``, ``or``, a conditional expression, a comprehension's ``if``) the value must be ``True`` or
  ``False``: a truthy list or a ``1`` fails the check. A hole that raises, or whose value is not plain data, fails
  the check that uses it. The parent evaluates every hole a check names, even one Python would skip (``x or
  f(1)``), and an assert's message is never evaluated.
* A method of the plain types (``_METHODS``: ``startswith``, ``count``, ``split``, ``get``...) called on the
  completion's value is the parent's call: ``f('abc').startswith('a')`` sends ``f('abc')`` to the sandbox and calls
  ``str.startswith`` here, so an object whose methods all answer True is not plain data and fails. A class of the
  completion's own with a method of one of these names cannot be tested through it; other methods
  (``Stack([1]).pop()``) run in the sandbox, on whatever the code made. Dunder attributes in a hole
  (``f(2).__eq__(4)``) are refused when the test is read: compare the value itself.
* A hole whose value is or holds a NaN (a float, or a part of a complex number, anywhere in it) fails every check
  that uses it, unless it is the argument of ``math.isnan``, ``math.isinf`` or ``math.isfinite``. NaN compares False
  with everything, so ``assert not f(3) < 0`` would otherwise pass for a NaN; a test that expects one says so with
  ``math.isnan(f(3))``.
* The parent's work is bounded whatever the values: every value arrives bounded (:mod:`~grpo_fast.sandbox.plain_data`:
  1 MiB encoded per test, ranges of at most 2**20 items), repetitions, ``range``, ``bytes(n)`` stop at 2**20 items,
  ``join`` and ``replace`` at 2**24 characters, ``**`` and ``<<`` at 2**22 bits, a check at 10**6 steps, and
  judging all of one run's tests at the run's wall-clock limit (:func:`judge`'s ``deadline``).
* Refused when the test is read (``ValueError``, naming the test): a statement other than ``assert`` and ``import``
  (an assignment, a loop, a function, a ``try``: they would run in the sandbox, where the code under test can
  change what they compute; an ``assert`` inside them would be judged there); no assert at all; a hole that does
  not start at a name of the completion (a Python builtin outside :data:`PARENT_BUILTINS`, such as ``callable`` or
  ``getattr``, a name the test imports, a ``math`` function outside :data:`PARENT_MODULES`): library code run in
  the sandbox answers to the code under test, which can replace it; a comparison with holes on both sides
  (``f(1) == f(2)``, ``f(x) == Fraction(1, 2)``): one side must be a value the parent computes alone; ``is`` and
  ``is not`` but against ``None``, ``True``, ``False`` or a type the parent knows; the completion's code inside a
  lambda or a comprehension (``all(f(v) == 2 * v for v in range(5))``: write one assert per case); assignment
  expressions, f-strings, ``await`` and ``yield``.

What this does not decide: a check whose passing value can be guessed without the expected value. ``assert
is_prime(7)`` passes for an ``is_prime`` that always returns True, and ``assert f(x) != 3`` for one that returns
anything else; a dataset should pair such checks with their opposites (``assert not is_prime(9)``: the sandbox sees
``is_prime(9)``, not the ``not``). The sandbox sees every hole with its arguments: an input of one check that is
another's expected value (``assert f(2) == 4 and g(4) == 1``) can be read there. A name of :data:`PARENT_BUILTINS`
always means that builtin: a test of a completion's own ``max`` is judged against the builtin, whatever the
completion defines.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import reprlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from grpo_fast.sandbox.plain_data import MAX_RANGE_ITEMS, check_hashes

__all__ = ["PARENT_BUILTINS", "PARENT_MODULES", "Check", "TestPlan", "judge", "parse_test", "parse_tests"]

_TYPES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range)
# The builtins the parent evaluates itself (on plain values): pure functions and the plain types.
PARENT_BUILTINS: dict[str, Any] = {fn.__name__: fn for fn in (
    abs, all, any, chr, divmod, enumerate, filter, isinstance, len, map, max, min, ord, repr, reversed, round,
    sorted, sum, type, zip, *_TYPES)}
# The modules whose listed attributes the parent evaluates itself, under the module's name or imported from it.
PARENT_MODULES: dict[str, dict[str, Any]] = {"math": {name: getattr(math, name) for name in (
    "pi", "e", "tau", "inf", "nan", "isclose", "isnan", "isinf", "isfinite", "fabs", "floor", "ceil", "trunc",
    "sqrt", "isqrt", "exp", "log", "log2", "log10", "pow", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
    "hypot", "degrees", "radians", "gcd", "copysign", "fsum", "fmod", "remainder")}}
# Methods the parent calls on the values it has (never on a hole: there the call is part of the hole).
_METHODS: dict[type, frozenset[str]] = {
    str: frozenset({
        "capitalize", "casefold", "count", "encode", "endswith", "find", "index", "isalnum", "isalpha", "isascii",
        "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle",
        "isupper", "join", "lower", "lstrip", "partition", "removeprefix", "removesuffix", "replace", "rfind",
        "rindex", "rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase",
        "title", "upper"}),
    bytes: frozenset({"capitalize", "count", "decode", "endswith", "find", "hex", "index", "isalnum", "isalpha",
                      "isascii", "isdigit", "islower", "isspace", "istitle", "isupper", "join", "lower", "lstrip",
                      "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rpartition",
                      "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title",
                      "upper"}),
    range: frozenset({"count", "index"}),
    list: frozenset({"count", "index", "copy"}),
    tuple: frozenset({"count", "index"}),
    dict: frozenset({"get", "keys", "values", "items", "copy"}),
    set: frozenset({"copy", "difference", "intersection", "isdisjoint", "issubset", "issuperset",
                    "symmetric_difference", "union"}),
    int: frozenset({"bit_length", "bit_count", "conjugate", "as_integer_ratio"}),
    float: frozenset({"is_integer", "conjugate", "hex", "as_integer_ratio"}),
    complex: frozenset({"conjugate"}),
}
_METHODS[frozenset] = _METHODS[set]
_METHOD_NAMES = frozenset().union(*_METHODS.values())
_HASHING_METHODS = frozenset({"difference", "intersection", "isdisjoint", "issubset", "issuperset",
                              "symmetric_difference", "union"})  # those that build a set of their arguments
_SINGLETONS = (None, True, False, ...)
_NAN_QUESTIONS = (math.isnan, math.isinf, math.isfinite)  # the calls whose argument may be NaN

# Bounds on what the parent computes (the holes' values come from the code under test)
_MAX_ITEMS = MAX_RANGE_ITEMS  # longest sequence a repetition or a range may make (ranges from the sandbox likewise)
_MAX_CHARS = 1 << 24  # longest string or bytes str.join and str.replace may make
_MAX_BITS = 1 << 22  # largest int ** and << may make
_MAX_STEPS = 1_000_000  # most expression nodes (lambda calls and comprehension items included) one check evaluates
_CLOCK_STEPS = 4096  # how often (in steps) a check looks at the clock

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitXor: operator.xor, ast.BitAnd: operator.and_}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_BUILTIN_NAMES = frozenset(dir(builtins))
_LIBRARY = object()  # what a name the test imports from outside PARENT_MODULES stands for


class _Hole(ast.expr):
    """Where a check's template takes the value the sandbox computed for its ``index``-th hole."""

    _fields = ("index",)


@dataclass(frozen=True)
class Check:
    """One assert: its expression as written, and the template the parent evaluates (holes replaced by
    ``_Hole`` nodes, which index the test's values)."""

    source: str
    template: ast.expr


@dataclass(frozen=True)
class TestPlan:
    """One test, split: ``steps`` is what the sandbox runs, in order (``("exec", import statement)`` or
    ``("eval", hole expression)``; the ``eval`` steps' values come back, one per hole), ``checks`` what the parent
    evaluates over them; ``holes`` holds the hole expressions (for messages), ``names`` what the templates' free
    names mean to the parent (its builtins and modules, and what the test imports from those), ``nan_asked`` the
    holes the test asks about NaN (the argument of ``math.isnan``, ``math.isinf`` or ``math.isfinite``): the only
    ones whose value may hold a NaN."""

    source: str
    steps: tuple[tuple[str, str], ...]
    checks: tuple[Check, ...]
    holes: tuple[str, ...]
    names: dict[str, Any]
    nan_asked: frozenset[int] = frozenset()


class _Refused(Exception):
    """A test the parent cannot judge; the message says why."""


def parse_tests(tests: list[str], where: str) -> list[TestPlan]:
    """:func:`parse_test` of each test; ``where`` names the list in errors (``"tests"`` -> ``"tests[2]"``)."""
    return [parse_test(test, f"{where}[{i}]") for i, test in enumerate(tests)]


def parse_test(source: str, where: str = "test") -> TestPlan:
    """Split one test between the sandbox and the parent (module docstring); raises ``ValueError`` naming
    ``where`` for a test the parent cannot judge."""
    try:
        body = ast.parse(source, mode="exec").body
    except SyntaxError as e:
        raise ValueError(f"{where} must be Python code (assert statements): {e.msg} on line {e.lineno}; got "
                         f"{source!r:.200}") from None
    except ValueError as e:  # a null byte
        raise ValueError(f"{where} must be Python code (assert statements): {e}; got {source!r:.200}") from None
    except (MemoryError, RecursionError):
        raise ValueError(f"{where} is nested too deeply to parse, got {source!r:.200}") from None
    try:
        return _Splitter(body).plan(source)
    except _Refused as e:
        raise ValueError(f"{where} must be assert statements the parent can judge (and imports): {e}; got "
                         f"{source!r:.200}") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply to judge, got {source!r:.200}") from None


class _Splitter:
    """Cuts a test's asserts into holes (evaluated in the sandbox) and templates (evaluated in the parent)."""

    def __init__(self, body: list[ast.stmt]) -> None:
        self._body = body
        self._imports: dict[str, Any] = {}  # names the test's imports bind -> what the parent takes them for
        self._steps: list[tuple[str, str]] = []
        self._holes: list[str] = []
        self._nan_asked: set[int] = set()
        for statement in body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                self._bind_imports(statement)

    def plan(self, source: str) -> TestPlan:
        checks = []
        for statement in self._body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                self._steps.append(("exec", ast.unparse(statement)))
            elif isinstance(statement, ast.Assert):
                checks.append(Check(ast.unparse(statement.test), self._split(statement.test, frozenset())))
            else:
                raise _Refused(f"the {type(statement).__name__} statement on line {statement.lineno} would run in the "
                               "sandbox, where the code under test can change what it computes")
        if not checks:
            raise _Refused("it holds no assert")
        names = {**PARENT_BUILTINS, **PARENT_MODULES}
        for name, meaning in self._imports.items():
            if meaning is _LIBRARY:
                names.pop(name, None)
            else:
                names[name] = meaning
        return TestPlan(source, tuple(self._steps), tuple(checks), tuple(self._holes), names,
                        frozenset(self._nan_asked))

    def _bind_imports(self, statement: ast.Import | ast.ImportFrom) -> None:
        for alias in statement.names:
            if alias.name == "*":
                raise _Refused(f"'from {statement.module} import *' binds names the parent cannot know")
            if isinstance(statement, ast.Import):
                name = alias.asname or alias.name.partition(".")[0]
                module = alias.name if alias.asname or "." not in alias.name else None
                self._imports[name] = PARENT_MODULES.get(module, _LIBRARY) if module else _LIBRARY
            else:
                module = PARENT_MODULES.get(statement.module) if not statement.level else None
                self._imports[alias.asname or alias.name] = (module or {}).get(alias.name, _LIBRARY)

    def _parent_name(self, name: str) -> Any:
        """What the parent takes a free name for (a builtin, a module function, a module's table), or None: a name
        of the completion, or of a library the test imports."""
        if name in self._imports:
            meaning = self._imports[name]
            return None if meaning is _LIBRARY else meaning
        return PARENT_BUILTINS.get(name, PARENT_MODULES.get(name))

    # -- which nodes are holes

    def _is_hole(self, node: ast.expr, scope: frozenset[str]) -> bool:
        """Whether the parent leaves ``node`` as a whole to the sandbox: a chain of names, calls, attributes and
        subscripts that the parent does not evaluate itself."""
        if isinstance(node, ast.Name):
            return node.id not in scope and self._parent_name(node.id) is None
        if isinstance(node, ast.Attribute):
            if self._module_of(node.value, scope) is not None:
                return node.attr not in self._module_of(node.value, scope)
            return self._is_hole(node.value, scope)
        if isinstance(node, ast.Subscript):
            return self._is_hole(node.value, scope)
        if isinstance(node, ast.Call):
            return not self._parent_callable(node.func, scope) and self._is_hole(node.func, scope)
        return False

    def _module_of(self, node: ast.expr, scope: frozenset[str]) -> dict[str, Any] | None:
        if isinstance(node, ast.Name) and node.id not in scope:
            table = self._parent_name(node.id)
            return table if isinstance(table, dict) else None
        return None

    def _parent_callable(self, func: ast.expr, scope: frozenset[str]) -> bool:
        """Whether the parent makes a call to ``func`` itself: a builtin or module function of its own, a lambda,
        a lambda or comprehension variable, or a method of ``_METHODS`` on a value that is not a hole."""
        if isinstance(func, ast.Name):
            return func.id in scope or callable(self._parent_name(func.id))
        if isinstance(func, ast.Attribute):
            module = self._module_of(func.value, scope)
            if module is not None:
                return func.attr in module
            return func.attr in _METHOD_NAMES  # also on a hole: the sandbox sends the value, the parent calls
        return isinstance(func, ast.Lambda)

    def _nan_question(self, func: ast.expr, scope: frozenset[str]) -> bool:
        """Whether ``func`` is one of the parent's functions that ask whether a value is NaN."""
        if isinstance(func, ast.Name) and func.id not in scope:
            meaning = self._parent_name(func.id)
        elif isinstance(func, ast.Attribute) and self._module_of(func.value, scope) is not None:
            meaning = self._module_of(func.value, scope).get(func.attr)
        else:
            return False
        return any(meaning is fn for fn in _NAN_QUESTIONS)

    def _hole(self, node: ast.expr, scope: frozenset[str]) -> _Hole:
        """Make ``node`` a hole, unless it would run anything but the completion's code in the sandbox."""
        source = ast.unparse(node)
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if scope:
            raise _Refused(f"{source!r} uses the code under test inside a lambda or a comprehension, which would be "
                           "evaluated in the sandbox (write one assert per case)")
        for part in ast.walk(node):
            if isinstance(part, ast.Attribute) and part.attr.startswith("__") and part.attr.endswith("__"):
                raise _Refused(f"{source!r} calls {part.attr} in the sandbox, where the code under test answers it "
                               "(compare the value itself: f(2) == 4, 3 in f(2))")
        why = ("the test imports it" if self._imports.get(root.id) is _LIBRARY else
               "the parent evaluates only the math functions of grpo_fast.sandbox.asserts.PARENT_MODULES"
               if isinstance(self._parent_name(root.id), dict) else
               "the parent evaluates only the builtins of grpo_fast.sandbox.asserts.PARENT_BUILTINS"
               if root.id in _BUILTIN_NAMES else None)
        if why is not None:
            raise _Refused(f"{source!r} would run {root.id!r} in the sandbox, where the code under test can replace "
                           f"it ({why})")
        self._steps.append(("eval", source))
        self._holes.append(source)
        return ast.copy_location(_Hole(index=len(self._holes) - 1), node)

    # -- the template

    def _split(self, node: ast.expr, scope: frozenset[str]) -> ast.expr:
        """``node`` with each hole replaced by a ``_Hole``; refuses what the parent cannot evaluate."""
        if self._is_hole(node, scope):
            return self._hole(node, scope)
        split = lambda child: self._split(child, scope)  # noqa: E731
        match node:
            case ast.Constant() | ast.Name():
                return node
            case ast.Attribute(value=value) if self._module_of(value, scope) is not None:
                return node
            case ast.Call(func=func, args=args, keywords=keywords):
                if not self._parent_callable(func, scope):
                    raise _Refused(f"the parent does not call {ast.unparse(func)!r}, and it is not the code under "
                                   "test")
                if isinstance(func, ast.Attribute) and self._module_of(func.value, scope) is None:
                    func = ast.Attribute(split(func.value), func.attr, ast.Load())
                elif isinstance(func, ast.Lambda):
                    func = split(func)
                call = ast.Call(func, [split(a) for a in args], [ast.keyword(k.arg, split(k.value)) for k in keywords])
                if self._nan_question(func, scope) and len(call.args) == 1 and isinstance(call.args[0], _Hole):
                    self._nan_asked.add(call.args[0].index)
                return call
            case ast.Subscript(value=value, slice=index):
                return ast.Subscript(split(value), split(index), ast.Load())
            case ast.Slice(lower=lower, upper=upper, step=step):
                return ast.Slice(*(None if part is None else split(part) for part in (lower, upper, step)))
            case ast.BinOp(left=left, op=op, right=right):
                return ast.BinOp(split(left), op, split(right))
            case ast.UnaryOp(op=op, operand=operand):
                return ast.UnaryOp(op, split(operand))
            case ast.BoolOp(op=op, values=values):
                return ast.BoolOp(op, [split(v) for v in values])
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return ast.IfExp(split(test), split(body), split(orelse))
            case ast.Compare():
                return self._compare(node, scope)
            case ast.List(elts=elts) | ast.Tuple(elts=elts) | ast.Set(elts=elts):
                return type(node)([split(e) for e in elts], *([ast.Load()] if not isinstance(node, ast.Set) else []))
            case ast.Starred(value=value):
                return ast.Starred(split(value), ast.Load())
            case ast.Dict(keys=keys, values=values):
                pairs = [(None if k is None else split(k), split(v)) for k, v in zip(keys, values)]  # Python's order
                return ast.Dict([k for k, _ in pairs], [v for _, v in pairs])
            case ast.Lambda(args=args, body=body):
                if args.vararg or args.kwarg or args.kwonlyargs or args.defaults:
                    raise _Refused(f"the lambda {ast.unparse(node)!r} takes more than plain positional arguments")
                names = frozenset(a.arg for a in (*args.posonlyargs, *args.args))
                return ast.Lambda(args, self._split(body, scope | names))
            case ast.ListComp() | ast.SetComp() | ast.GeneratorExp() | ast.DictComp():
                return self._comprehension(node, scope)
        raise _Refused(f"the parent does not evaluate {type(node).__name__} expressions ({ast.unparse(node)!r})")

    def _compare(self, node: ast.Compare, scope: frozenset[str]) -> ast.Compare:
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if self._has_hole(left, scope) and self._has_hole(right, scope):
                raise _Refused(f"both sides of {ast.unparse(ast.Compare(left, [op], [right]))!r} come from the "
                               "sandbox; compare the code under test's value with one the test states")
            if isinstance(op, (ast.Is, ast.IsNot)) and not any(self._is_singleton(o, scope) for o in (left, right)):
                raise _Refused(f"{ast.unparse(ast.Compare(left, [op], [right]))!r}: the parent compares identity "
                               "only with None, True, False, ... or a type")
        split = [self._split(o, scope) for o in operands]
        return ast.Compare(split[0], node.ops, split[1:])

    def _is_singleton(self, node: ast.expr, scope: frozenset[str]) -> bool:
        if isinstance(node, ast.Constant):
            return any(node.value is s for s in _SINGLETONS)
        return isinstance(node, ast.Name) and node.id not in scope and self._parent_name(node.id) in _TYPES

    def _has_hole(self, node: ast.expr, scope: frozenset[str]) -> bool:
        """Whether ``node`` holds a hole (without making one)."""
        if isinstance(node, ast.expr) and self._is_hole(node, scope):
            return True
        return any(self._has_hole(child, scope) for child in ast.iter_child_nodes(node))

    def _comprehension(self, node: ast.expr, scope: frozenset[str]) -> ast.expr:
        generators = []
        inner = scope
        for i, gen in enumerate(node.generators):
            if gen.is_async:
                raise _Refused(f"an async comprehension ({ast.unparse(node)!r})")
            targets = [gen.target] if isinstance(gen.target, ast.Name) else getattr(gen.target, "elts", None)
            if not targets or not all(isinstance(t, ast.Name) for t in targets):
                raise _Refused(f"a comprehension target other than names ({ast.unparse(gen.target)!r})")
            # the first iterable is evaluated where the comprehension stands, the rest inside it
            iterable = self._split(gen.iter, scope if i == 0 else inner)
            inner = inner | {t.id for t in targets}
            generators.append(ast.comprehension(gen.target, iterable, [self._split(c, inner) for c in gen.ifs], 0))
        if isinstance(node, ast.DictComp):
            return ast.DictComp(self._split(node.key, inner), self._split(node.value, inner), generators)
        return type(node)(self._split(node.elt, inner), generators)


# ------------------------------------------------------------------------------------------------------ judging


class _Failed(Exception):
    """A check that fails; the message says why."""


def judge(plan: TestPlan, values: list[tuple[str, Any]], deadline: float | None = None) -> str | None:
    """Evaluate a test's checks over the values the sandbox computed for its holes; None when every check passes,
    else why the first failing one failed.

    ``values[k]`` is the ``k``-th hole's outcome: ``("value", plain value)``, ``("raised", description)`` or
    ``("not plain", description)``. A value that is or holds a NaN (a float, or a complex part, anywhere in it) fails
    every check that uses it, unless the hole is the argument of ``math.isnan``, ``math.isinf`` or ``math.isfinite``:
    NaN compares False with everything, so ``assert not f(3) < 0`` or ``assert not abs(f(2) - 4) > 1e-9`` would pass
    for a NaN, and a policy that learns to return one must not gain reward where a test pins a number. Past
    ``deadline`` (``time.monotonic()``), a check fails instead of going on.
    """
    values = [_settle(outcome) for outcome in values]
    for check in plan.checks:
        evaluator = _Evaluator(plan, values, deadline)
        try:
            result = evaluator.evaluate(check.template, {})
            if result is not True:
                raise _Failed(f"it is {_short(result)}" if result is False else
                              f"its value is {_short(result)} ({type(result).__name__}), not True")
        except _Failed as e:
            return f"assert {check.source}: {e}{evaluator.seen()}"
        except Exception as e:  # TypeError, ZeroDivisionError, MemoryError, RecursionError... from plain values
            return f"assert {check.source}: {type(e).__name__}: {e}{evaluator.seen()}"
    return None


class _ShortRepr(reprlib.Repr):
    """Short reprs for messages; an int too long for ``repr`` (Python refuses past 4300 digits) says its size."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 1000:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_REPR = _ShortRepr()  # Python 3.11's Repr takes no keyword arguments
_REPR.maxstring = _REPR.maxother = 60


def _short(value: Any) -> str:
    try:
        return _REPR.repr(value)
    except Exception:  # a message must never fail the judging
        return f"<a {type(value).__name__}>"


_LIST_ITERATOR = type(iter([]))


def _settle(outcome: tuple[str, Any]) -> tuple[str, Any]:
    """A hole's outcome with a value holding a NaN marked ``"nan"``; an iterator is drained and handed on afresh."""
    kind, value = outcome
    if kind != "value":
        return outcome
    if type(value) is _LIST_ITERATOR:
        items = list(value)
        return ("nan" if _holds_nan(items) else "value"), iter(items)
    return ("nan" if _holds_nan(value) else "value"), value


def _holds_nan(value: Any) -> bool:
    """Whether a plain value is or holds a NaN (iteratively: the value's nesting is bounded, its size is not small)."""
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is float:
            if item != item:
                return True
        elif kind is complex:
            if item != item:
                return True
        elif kind is dict:
            pending.extend(item.keys())
            pending.extend(item.values())
        elif kind in (list, tuple, set, frozenset):
            pending.extend(item)
    return False


class _Evaluator:
    """Evaluates a check's template over plain values, with the parent's own builtins."""

    def __init__(self, plan: TestPlan, values: list[tuple[str, Any]], deadline: float | None) -> None:
        self._plan = plan
        self._values = values
        self._used: list[int] = []
        self._steps = 0
        self._names = plan.names
        self._deadline = deadline

    def seen(self) -> str:
        """The values of the holes evaluated so far, for the message."""
        shown = [f"{self._plan.holes[k]} = {_short(self._values[k][1])}" for k in dict.fromkeys(self._used)
                 if self._values[k][0] in ("value", "nan") and type(self._values[k][1]) is not _LIST_ITERATOR]
        return f" (with {', '.join(shown)})" if shown else ""

    def _truth(self, value: Any) -> bool:
        if value is True or value is False:
            return value
        raise _Failed(f"a truth value must be True or False, got {_short(value)} ({type(value).__name__})")

    def _tick(self) -> None:
        self._steps += 1
        if self._steps > _MAX_STEPS:
            raise _Failed(f"the check took more than {_MAX_STEPS} steps")
        if self._steps % _CLOCK_STEPS == 1:
            self._check_clock()

    def _check_clock(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise _Failed("judging the run's tests took longer than its time limit")

    def evaluate(self, node: ast.expr, env: dict[str, Any]) -> Any:
        self._tick()
        ev = self.evaluate
        match node:
            case _Hole(index=index):
                kind, value = self._values[index]
                self._used.append(index)
                if kind == "nan" and index not in self._plan.nan_asked:
                    raise _Failed(f"{self._plan.holes[index]} is or holds a NaN, which fails every check but "
                                  "math.isnan, math.isinf and math.isfinite of it")
                if kind not in ("value", "nan"):
                    raise _Failed(f"{self._plan.holes[index]} {kind}: {value}")
                return value
            case ast.Constant(value=value):
                return value
            case ast.Name(id=name):
                return env[name] if name in env else self._names[name]
            case ast.Attribute(value=ast.Name(id=module), attr=attr):  # a module's attribute (the splitter's check)
                return self._names[module][attr]
            case ast.Call(func=func, args=args, keywords=keywords):
                if isinstance(func, ast.Attribute) and not isinstance(self._module(func.value, env), dict):
                    receiver = ev(func.value, env)
                    if func.attr not in _METHODS.get(type(receiver), ()):
                        raise _Failed(f"the parent does not call {type(receiver).__name__}.{func.attr}")
                    fn = getattr(receiver, func.attr)
                else:
                    fn = ev(func, env)
                positional = []
                for arg in args:
                    if isinstance(arg, ast.Starred):
                        positional.extend(ev(arg.value, env))
                    else:
                        positional.append(ev(arg, env))
                named = {}
                for keyword in keywords:
                    if keyword.arg is None:
                        named.update(ev(keyword.value, env))
                    else:
                        named[keyword.arg] = ev(keyword.value, env)
                return self._call(fn, positional, named)
            case ast.Subscript(value=value, slice=index):
                return ev(value, env)[ev(index, env)]
            case ast.Slice(lower=lower, upper=upper, step=step):
                return slice(*(None if part is None else ev(part, env) for part in (lower, upper, step)))
            case ast.BinOp(left=left, op=op, right=right):
                a, b = ev(left, env), ev(right, env)
                _check_size(op, a, b)
                return _BINARY[type(op)](a, b)
            case ast.UnaryOp(op=ast.Not(), operand=operand):
                return not self._truth(ev(operand, env))
            case ast.UnaryOp(op=op, operand=operand):
                return _UNARY[type(op)](ev(operand, env))
            case ast.BoolOp(op=op, values=values):
                want = isinstance(op, ast.Or)  # the value that decides: True for or, False for and
                for value in values:
                    if self._truth(ev(value, env)) is want:
                        return want
                return not want
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return ev(body, env) if self._truth(ev(test, env)) else ev(orelse, env)
            case ast.Compare(left=left, ops=ops, comparators=comparators):
                a = ev(left, env)
                for op, comparator in zip(ops, comparators):
                    b = ev(comparator, env)
                    if _is_nan(a) or _is_nan(b):  # made here from the values (inf - inf): compares False with all
                        raise _Failed("a comparison with a NaN (computed from the values: inf - inf, 0 * inf)")
                    if not _COMPARE[type(op)](a, b):
                        return False
                    a = b
                return True
            case ast.List(elts=elts) | ast.Tuple(elts=elts) | ast.Set(elts=elts):
                items = []
                for e in elts:
                    items.extend(ev(e.value, env)) if isinstance(e, ast.Starred) else items.append(ev(e, env))
                if isinstance(node, ast.Set):
                    return set(check_hashes(items))
                return tuple(items) if isinstance(node, ast.Tuple) else items
            case ast.Dict(keys=keys, values=values):
                pairs = []
                for key, value in zip(keys, values):
                    if key is None:
                        pairs.extend(dict(ev(value, env)).items())
                    else:
                        pairs.append((ev(key, env), ev(value, env)))
                check_hashes(key for key, _ in pairs)
                return dict(pairs)
            case ast.Lambda(args=args, body=body):
                return self._lambda([a.arg for a in (*args.posonlyargs, *args.args)], body, env)
            case ast.GeneratorExp(elt=elt, generators=generators):
                return (ev(elt, inner) for inner in self._loops(generators, 0, env))
            case ast.ListComp(elt=elt, generators=generators):
                return [ev(elt, inner) for inner in self._loops(generators, 0, env)]
            case ast.SetComp(elt=elt, generators=generators):
                return set(check_hashes(ev(elt, inner) for inner in self._loops(generators, 0, env)))
            case ast.DictComp(key=key, value=value, generators=generators):
                pairs = [(ev(key, inner), ev(value, inner)) for inner in self._loops(generators, 0, env)]
                check_hashes(k for k, _ in pairs)
                return dict(pairs)
        raise _Failed(f"the parent does not evaluate {type(node).__name__}")  # the splitter refuses these

    def _module(self, node: ast.expr, env: dict[str, Any]) -> Any:
        return self._names.get(node.id) if isinstance(node, ast.Name) and node.id not in env else None

    def _call(self, fn: Callable, args: list, kwargs: dict) -> Any:
        # every set and dict the parent builds is checked for colliding hashes first (plain_data.check_hashes)
        if fn in (set, frozenset) and args:
            args = [check_hashes(args[0]), *args[1:]]
        elif fn is dict and args and type(args[0]) is not dict:
            pairs = [tuple(pair) for pair in args[0]]
            check_hashes(pair[0] for pair in pairs if len(pair) == 2)
            args = [pairs, *args[1:]]
        elif type(getattr(fn, "__self__", None)) in (set, frozenset) and fn.__name__ in _HASHING_METHODS:
            args = [check_hashes(arg) for arg in args]
        if fn is range:
            made = range(*args, **kwargs)
            if len(made) > _MAX_ITEMS:
                raise _Failed(f"range of {len(made)} items, more than the parent makes ({_MAX_ITEMS})")
            return made
        if fn is sum and len(args) + len(kwargs) > 1:
            start = args[1] if len(args) > 1 else kwargs.get("start")
            if type(start) not in (int, float, complex, bool):
                raise _Failed("the parent sums numbers only (a list start would make it quadratic)")
        if fn is type and (len(args) != 1 or kwargs):
            raise _Failed("the parent calls type(x) with one argument only")
        if fn is round and len(args) > 1 and type(args[1]) is int and abs(args[1]) > 10_000:
            raise _Failed("round to more than 10000 digits")
        if fn in (repr, str) and args:
            _check_text_output(args[0])
        if fn is bytes and args and type(args[0]) in (int, bool) and args[0] > _MAX_ITEMS:
            raise _Failed(f"bytes({args[0]}) would make more than {_MAX_ITEMS} bytes")
        receiver = getattr(fn, "__self__", None)
        if type(receiver) in (str, bytes) and fn.__name__ in ("join", "replace"):
            if fn.__name__ == "join" and args:
                args = [self._join_pieces(receiver, args[0]), *args[1:]]
            else:
                _check_text_size(receiver, fn.__name__, args)
        return fn(*args, **kwargs)

    def _join_pieces(self, separator: str | bytes, pieces: Any) -> list:
        """The pieces of ``separator.join(pieces)``, drawn one by one and measured as they come: the parent stops as
        soon as the result would pass :data:`_MAX_CHARS` (``f(3).join(map(str, range(2**20)))`` with a long ``f(3)``
        stops after a few dozen pieces, not a million), and looks at the run's clock as it goes."""
        drawn, size = [], 0
        for piece in pieces:
            size += (len(separator) if drawn else 0) + (len(piece) if type(piece) is type(separator) else 0)
            if size > _MAX_CHARS:
                raise _Failed(f"a join of more than {_MAX_CHARS} characters")
            drawn.append(piece)
            if len(drawn) % _CLOCK_STEPS == 0:
                self._check_clock()
        return drawn

    def _lambda(self, params: list[str], body: ast.expr, env: dict[str, Any]) -> Callable:
        def call(*args: Any) -> Any:
            if len(args) != len(params):
                raise TypeError(f"the lambda takes {len(params)} arguments, got {len(args)}")
            return self.evaluate(body, {**env, **dict(zip(params, args))})
        return call

    def _loops(self, generators: list[ast.comprehension], i: int, env: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(generators):
            yield env
            return
        gen = generators[i]
        for item in self.evaluate(gen.iter, env):
            self._tick()
            inner = dict(env)
            if isinstance(gen.target, ast.Name):
                inner[gen.target.id] = item
            else:
                names = [t.id for t in gen.target.elts]
                items = tuple(item)
                if len(items) != len(names):
                    raise ValueError(f"cannot unpack {len(items)} values into {len(names)} names")
                inner.update(zip(names, items))
            if all(self._truth(self.evaluate(condition, inner)) for condition in gen.ifs):
                yield from self._loops(generators, i + 1, inner)


def _is_nan(value: Any) -> bool:
    return (type(value) is float or type(value) is complex) and value != value


def _check_text_output(value: Any) -> None:
    """Refuse a ``repr`` or ``str`` that would pass :data:`_MAX_CHARS` characters (``repr((f(3),) * 2000)`` of a long
    string: a repetition counts items, its repr their characters). Counted as repr writes them, shared items each
    time they appear, and the count stops as soon as it passes the bound."""
    size, pending = 0, [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        size += len(item) + 4 if kind in (str, bytes) else 8
        if kind is dict:
            pending.extend(item.keys())
            pending.extend(item.values())
        elif kind in (list, tuple, set, frozenset):
            pending.extend(item)
        if size > _MAX_CHARS:
            raise _Failed(f"a repr of more than {_MAX_CHARS} characters")


def _check_text_size(receiver: str | bytes, method: str, args: list) -> None:
    """Refuse a ``replace`` whose result would pass :data:`_MAX_CHARS` (each side may come from the code under test:
    ``s.replace(old, new)`` makes up to ``len(new)`` per match; a ``join`` is measured piece by piece,
    :meth:`_Evaluator._join_pieces`)."""
    if method == "replace" and len(args) >= 2 and all(type(a) is type(receiver) for a in args[:2]):
        old, new = args[0], args[1]
        matches = receiver.count(old) if old else len(receiver) + 1
        if len(args) > 2 and type(args[2]) is int and args[2] >= 0:
            matches = min(matches, args[2])
        size = len(receiver) + matches * (len(new) - len(old))
    else:
        return
    if size > _MAX_CHARS:
        raise _Failed(f"a {method} of more than {_MAX_CHARS} characters")


def _check_size(op: ast.operator, a: Any, b: Any) -> None:
    """Refuse the operations whose result would be huge (the operands may come from the code under test)."""
    if isinstance(op, ast.Mult):
        for seq, n in ((a, b), (b, a)):
            if type(seq) in (str, bytes, list, tuple) and type(n) in (int, bool) and len(seq) * n > _MAX_ITEMS:
                raise _Failed(f"a repetition of more than {_MAX_ITEMS} items")
    elif isinstance(op, ast.Pow) and type(a) is int and type(b) is int and b > 0 and abs(a) > 1:
        if a.bit_length() * b > _MAX_BITS:
            raise _Failed(f"a power of more than {_MAX_BITS} bits")
    elif isinstance(op, ast.LShift) and type(a) is int and type(b) is int and a.bit_length() + b > _MAX_BITS:
        raise _Failed(f"a shift to more than {_MAX_BITS} bits")
    elif isinstance(op, ast.Mod) and type(a) in (str, bytes):
        raise _Failed("the parent does not %-format strings")
