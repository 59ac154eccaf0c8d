"""Plain data: the only values that travel from the code sandbox's child to the trusted parent.

The child turns each value it computed for a test into a JSON tree with :func:`to_tree`; the parent rebuilds it with
:func:`from_tree`, which builds nothing but these types, exactly (no subclasses): ``None``, ``bool``, ``int``,
``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``range``, and an
iterator over a list, which is what a generator or any other iterator arrives as (the child drains it). Anything
else (an instance of a class the code under test defined, a subclass of ``int`` or ``str``, a function) is not plain
data, so an object whose ``__eq__``, ``__hash__`` or ``__bool__`` lies never reaches the comparison. The parent
parses JSON and walks the result, executing nothing the child sent.

The tree: ``None``, ``bool``, ``str``, ``float`` and ``int`` below 2**63 in magnitude are JSON's own; a list is a JSON
array; every other value is a one-key object: ``{"int": hex}``, ``{"complex": [real, imag]}``, ``{"bytes": hex}``,
``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[key, value], ...]}``,
``{"range": [start, stop, step]}``, ``{"iter": [...]}``.

Every value is bounded whatever the child sends: a test's values take at most :data:`MAX_VALUE_CHARS` characters
encoded (so a list holds fewer than a million items), containers nest at most :data:`MAX_DEPTH` deep, a range holds
at most :data:`MAX_RANGE_ITEMS` items (its JSON is short whatever its length) and sets and dicts at most
:data:`MAX_SHARED_HASH` members sharing a hash. What the parent computes over them is bounded in turn
(:mod:`grpo_fast.sandbox.asserts`).

The sandbox's child (``python -I -S``, where grpo_fast is not importable) imports this file as a top-level module, so
it uses the standard library only, and at import time defines constants and functions and nothing else.
"""

import json

MAX_DEPTH = 64  # the deepest nesting of containers either side accepts
# The most characters the values of one test may take once encoded. The parent accepts a test's report line of at
# most this much plus LINE_OVERHEAD per value (for its framing and an error message): past that, the report is broken.
MAX_VALUE_CHARS = 1 << 20
LINE_OVERHEAD = 1024
# The most distinct members of one set (or keys of one dict) that may share a hash. Hashes of ints, floats and tuples
# are not randomised, so values chosen to collide would make building the set take quadratic time in the parent.
MAX_SHARED_HASH = 8
# The most items a range may hold. The JSON of a range is three ints whatever its length, so without this bound a
# range(10**18) would reach the parent whole, and max() or list() over it would stall or fill the parent; 2**20 is
# also the longest range the parent makes itself (grpo_fast.sandbox.asserts).
MAX_RANGE_ITEMS = 1 << 20

_SMALL_INT = 1 << 63
_TAGS = ("int", "complex", "bytes", "tuple", "set", "frozenset", "dict", "range", "iter")


class NotPlain(ValueError):
    """A value that is not plain data, or one larger or deeper than the budget allows."""


class Budget:
    """How many encoded characters the values of one test may still take."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def spend(self, chars: int) -> None:
        if chars > self.left:
            raise NotPlain(f"the values of one test take more than {MAX_VALUE_CHARS} characters once encoded")
        self.left -= chars


def to_tree(value, budget: Budget, depth: int = 0):
    """The JSON tree of a plain value (module docstring); raises :class:`NotPlain` for anything else, or when the
    encoded value would pass ``budget`` (charged at least its length as ``json.dumps(tree, separators=(",", ":"))``
    writes it) or :data:`MAX_DEPTH`."""
    kind = type(value)
    if value is None or kind is bool:
        budget.spend(5)
        return value
    if kind is int:
        if -_SMALL_INT < value < _SMALL_INT:
            budget.spend(20)
            return value
        budget.spend(value.bit_length() // 4 + 16)
        return {"int": hex(value)}
    if kind is float:
        budget.spend(24)
        return value
    if kind is complex:
        budget.spend(64)
        return {"complex": [value.real, value.imag]}
    if kind is str:
        budget.spend(len(value) + 2)  # before encoding: a huge string is refused without being copied
        text = json.dumps(value)
        budget.spend(len(text) - len(value) - 2)
        return value
    if kind is bytes:
        budget.spend(2 * len(value) + 14)
        return {"bytes": value.hex()}
    if kind is range:
        ends = (value.start, value.stop, value.step)
        if not all(-_SMALL_INT < end < _SMALL_INT for end in ends):
            raise NotPlain("a range with ends beyond 2**63")
        if len(value) > MAX_RANGE_ITEMS:
            raise NotPlain(f"a range of {len(value)} items, more than {MAX_RANGE_ITEMS}")
        budget.spend(80)
        return {"range": list(ends)}
    if depth >= MAX_DEPTH:
        raise NotPlain(f"containers nested more than {MAX_DEPTH} deep")
    if kind is list:
        budget.spend(2)
        return [_item(item, budget, depth) for item in value]
    if kind in (tuple, set, frozenset):
        budget.spend(16)
        return {kind.__name__: [_item(item, budget, depth) for item in value]}
    if kind is dict:
        budget.spend(12)
        return {"dict": [[_item(key, budget, depth), _item(item, budget, depth)] for key, item in value.items()]}
    if hasattr(kind, "__next__") and hasattr(kind, "__iter__"):  # a generator or another iterator: drained
        budget.spend(12)
        return {"iter": [_item(item, budget, depth) for item in value]}
    raise NotPlain(f"a {_type_name(kind)} is not plain data")


def _item(value, budget: Budget, depth: int):
    budget.spend(2)  # a separator, or the pair's brackets
    return to_tree(value, budget, depth + 1)


def _type_name(kind: type) -> str:
    try:
        return str(kind.__qualname__)[:80]
    except Exception:
        return "object"


def check_hashes(items) -> list:
    """``items`` as a list, after checking that at most :data:`MAX_SHARED_HASH` distinct ones share any hash (raises
    ``ValueError`` otherwise); unhashable items are left for the set or dict to refuse."""
    items = list(items)
    buckets: dict = {}  # hash -> the distinct items with it (hashes are ints below 2**61: they do not collide here)
    for item in items:
        try:
            bucket = buckets.setdefault(hash(item), [])
        except TypeError:
            continue
        if item not in bucket:
            bucket.append(item)
            if len(bucket) > MAX_SHARED_HASH:
                raise ValueError(f"more than {MAX_SHARED_HASH} distinct members share a hash (a set or dict built of "
                                 "them would take quadratic time)")
    return items


def from_tree(tree, depth: int = 0):
    """The plain value a JSON tree (as ``json.loads`` returns it) describes; raises ``ValueError`` for a tree that
    :func:`to_tree` would not have written."""
    kind = type(tree)
    if tree is None or kind in (bool, int, float, str):
        return tree
    if depth >= MAX_DEPTH + 1:
        raise ValueError(f"containers nested more than {MAX_DEPTH} deep")
    if kind is list:
        return [from_tree(item, depth + 1) for item in tree]
    if kind is not dict or len(tree) != 1:
        raise ValueError(f"expected a JSON value or a one-key object, got {tree!r:.100}")
    ((tag, body),) = tree.items()
    if tag not in _TAGS:
        raise ValueError(f"unknown tag {tag!r:.40}")
    if tag in ("int", "bytes"):
        if type(body) is not str:
            raise ValueError(f"{tag} takes a hex string, got {body!r:.100}")
        return int(body, 16) if tag == "int" else bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} takes a list, got {body!r:.100}")
    if tag == "complex":
        if len(body) != 2 or any(type(part) is not float and (type(part) is not int or abs(part) >= _SMALL_INT)
                                 for part in body):
            raise ValueError(f"complex takes [real, imag], got {body!r:.100}")
        return complex(*body)
    if tag == "range":
        if (len(body) != 3 or any(type(part) is not int or not -_SMALL_INT < part < _SMALL_INT for part in body)
                or body[2] == 0):
            raise ValueError(f"range takes [start, stop, step] below 2**63, got {body!r:.100}")
        made = range(*body)
        if len(made) > MAX_RANGE_ITEMS:
            raise ValueError(f"a range of {len(made)} items, more than {MAX_RANGE_ITEMS}")
        return made
    items = [from_tree(item, depth + 1) for item in body]
    try:
        if tag == "dict":
            if any(type(pair) is not list or len(pair) != 2 for pair in items):
                raise ValueError("dict takes [[key, value], ...]")
            check_hashes(key for key, _ in items)
            return {key: item for key, item in items}
        if tag in ("set", "frozenset"):
            check_hashes(items)
        return {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}[tag](items)
    except TypeError as e:  # an unhashable key or member
        raise ValueError(f"{tag}: {e}") from None
