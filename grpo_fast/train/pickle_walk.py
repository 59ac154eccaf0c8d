"""The pickle inside a checkpoint, read opcode by opcode and never unpickled: which globals it can reach, and the
same pickle in the opcodes torch's weights-only unpickler takes.

A pickle can name a global in several ways: ``GLOBAL`` and ``INST`` (module and name in the opcode), ``STACK_GLOBAL``
(module and name pushed as strings, or fetched from the memo: ``BINGET``, ``LONG_BINGET``, ``DUP``), and the
``EXT1/2/4`` codes of copyreg's extension registry; ``OBJ``, ``REDUCE`` and ``NEWOBJ`` only call what one of those
pushed. :func:`walk_pickle` tracks them all, linear in the pickle's length; a ``STACK_GLOBAL`` whose strings are not
literals of the pickle is reported as a global computed at load time (refused by the caller). A pickle of protocol 3
to 5 is rewritten into protocol-2 opcodes (torch's weights-only unpickler refuses protocol 4 and later), which that
unpickler then checks again, global by global. Used by :mod:`grpo_fast.train.checkpoint`.
"""

from __future__ import annotations

import copyreg
import pickle
import pickletools
from dataclasses import dataclass, field

__all__ = ["walk_pickle"]


# the opcodes torch's weights-only unpickler takes (protocol 2's, as Python writes plain values and tensors)
_TORCH_OPS = frozenset({
    "PROTO", "STOP", "MARK", "GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "BINPERSID", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "EMPTY_TUPLE", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "EMPTY_SET",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                         "STRING"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_EXT_OPS = frozenset({"EXT1", "EXT2", "EXT4"})
# what the rewrite turns into _TORCH_OPS: protocol 4's frames, short strings, memo and STACK_GLOBAL, and EXT codes
_REWRITTEN_OPS = frozenset({"PROTO", "FRAME", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STACK_GLOBAL",
                            *_GET_OPS, *_PUT_OPS, *_EXT_OPS})
_OPCODES = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}
_LENGTH_BYTES = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                 pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
_COMPUTED_GLOBAL = "<computed while unpickling: STACK_GLOBAL of values that are not strings of the pickle>"


class _Malformed(Exception):
    pass


@dataclass
class _Walk:
    """What :func:`walk_pickle` found: every global the pickle can reach (``module.name``), the first structural
    error (None: none), the opcodes torch's weights-only unpickler does not take even rewritten, the positions of
    the string pushes that only feed a STACK_GLOBAL (the rewrite drops them), whether the pickle needs the rewrite,
    and the rewritten pickle (when asked for)."""

    globals: set[str] = field(default_factory=set)
    error: str | None = None
    unsupported: set[str] = field(default_factory=set)
    elided: set[int] = field(default_factory=set)
    rewrite: bool = False
    rewritten: bytes | None = None


def walk_pickle(data: bytes, elided: set[int] | None = None) -> _Walk:
    """One pass over the opcodes of the pickle ``data``, unpickling nothing, in time and memory linear in its
    length. The stack is followed symbolically (a string, or an opaque value) so that the module and name a
    STACK_GLOBAL takes are known: a global is reached by ``GLOBAL`` and ``INST`` (named in the opcode),
    ``STACK_GLOBAL`` (the two strings below it on the stack, pushed or fetched from the memo; anything else is
    :data:`_COMPUTED_GLOBAL`) and ``EXT1/2/4`` (copyreg's extension registry, as pickle reads it); every call
    (``REDUCE``, ``NEWOBJ``, ``OBJ``, ``BUILD``) takes what one of those pushed.

    With ``elided`` (the first pass's :attr:`_Walk.elided`) it also writes :attr:`_Walk.rewritten`: the same
    pickle in the protocol-2 opcodes torch's weights-only unpickler takes: no frames, ``STACK_GLOBAL`` and ``EXT``
    codes as ``GLOBAL`` (the string pushes that fed a STACK_GLOBAL dropped), short and 8-byte strings as
    ``BINUNICODE``, the memo renumbered with ``BINPUT``."""
    walk, view, n = _Walk(), memoryview(data), len(data)
    rewriting = elided is not None
    out: list[bytes] = []
    stack: list[tuple[str | None, int]] = []  # (the string, or None for another value; where it was pushed)
    marks: list[int] = []
    memo: dict[int, str | None] = {}
    memo_out: dict[int, str | int] = {}  # the rewrite's memo: a dropped string (pushed again), or its new index
    unsupported: dict[int, str] = {}
    protocol, pos, start, puts = 0, 0, 0, 0
    try:
        while True:
            if pos >= n:
                raise _Malformed("it ends before its STOP opcode")
            op = _OPCODES.get(data[pos])
            if op is None:
                raise _Malformed(f"unknown opcode {data[pos]:#04x} at byte {pos}")
            name, start = op.name, pos
            arg_at, pos = _argument(op, data, start)
            arg = view[arg_at:pos]
            if name not in _TORCH_OPS:
                walk.rewrite = True
                if name not in _REWRITTEN_OPS:
                    unsupported[start] = name
            keep = rewriting and start not in elided
            piece = None  # what the rewrite writes for this opcode (None: the opcode as it is)
            if name == "MARK":
                marks.append(len(stack))
            elif name in _STRING_OPS:
                value = _string(name, arg)
                stack.append((value, start))
                if name in ("BINUNICODE8", "UNICODE") and value is not None and len(_utf8(value)) >= 2**32:
                    unsupported[start] = name
                if name not in _TORCH_OPS and value is not None:
                    piece = _binunicode(value)
            elif name in _GET_OPS:
                key = _memo_key(name, arg)
                if key not in memo:
                    raise _Malformed(f"{name} at byte {start} fetches nothing from the memo")
                stack.append((memo[key], start))
                if keep:
                    got = memo_out[key]
                    piece = _binunicode(got) if isinstance(got, str) else _memo_op(got, put=False)
            elif name in _PUT_OPS:
                if len(stack) <= (marks[-1] if marks else 0):
                    raise _Malformed(f"{name} at byte {start} memoizes from an empty stack")
                key = len(memo) if name == "MEMOIZE" else _memo_key(name, arg)
                value, pushed_at = stack[-1]
                memo[key] = value
                if rewriting and pushed_at in elided:  # a dropped string: fetching it pushes it again
                    memo_out[key], piece = value, b""
                elif rewriting:
                    memo_out[key] = index = puts
                    puts += 1
                    piece = _memo_op(index, put=True)
            elif name == "DUP":
                [(value, _)] = _pop(stack, marks, 1, name, start)
                stack.extend(((value, start), (value, start)))
            elif name == "STACK_GLOBAL":
                (module, module_at), (attr, attr_at) = _pop(stack, marks, 2, name, start)
                walk.globals.add(_COMPUTED_GLOBAL if module is None or attr is None else f"{module}.{attr}")
                pushers = {_OPCODES[data[module_at]].name, _OPCODES[data[attr_at]].name}
                if module is None or attr is None or "\n" in module + attr or not pushers <= _STRING_OPS | _GET_OPS:
                    unsupported[start] = "STACK_GLOBAL (of strings it did not push)"
                else:
                    walk.elided.update((module_at, attr_at))
                    piece = _global_op(module, attr)
                stack.append((None, start))
            else:
                if name in ("GLOBAL", "INST"):
                    module, attr = (part.decode("utf-8") for part in bytes(arg).split(b"\n")[:2])
                    walk.globals.add(f"{module}.{attr}")
                elif name in _EXT_OPS:
                    code = int.from_bytes(arg, "little", signed=name == "EXT4")
                    key = copyreg._inverted_registry.get(code)  # what pickle's unpickler looks the code up in
                    if key is None:
                        raise _Malformed(f"{name} at byte {start} names the extension code {code}, which is not "
                                         "registered")
                    walk.globals.add(f"{key[0]}.{key[1]}")
                    piece = _global_op(*key)
                elif name == "PROTO":
                    protocol = arg[0]
                    if protocol > pickle.HIGHEST_PROTOCOL:
                        raise _Malformed(f"protocol {protocol}, which no Python writes")
                    piece = b"\x80\x02"
                elif name == "FRAME":
                    piece = b""
                _apply(op, stack, marks, start)
            if keep:
                out.append(data[start:pos] if piece is None else piece)
            if name == "STOP":
                break
    except _Malformed as e:
        walk.error = str(e)
    except (ValueError, IndexError) as e:  # a number or string that does not parse (UnicodeDecodeError included)
        walk.error = f"{type(e).__name__} at byte {start}: {_reason(e)}"
    walk.rewrite = walk.rewrite or protocol != 2
    walk.unsupported = {op for at, op in unsupported.items() if at not in walk.elided}
    if rewriting:
        walk.rewritten = b"".join(out)
    return walk


def _argument(op, data: bytes, start: int) -> tuple[int, int]:
    """(where the argument of the opcode ``op`` at ``start`` begins, where the opcode ends)."""
    width, arg_at = (op.arg.n if op.arg is not None else 0), start + 1
    if width >= 0:
        end = arg_at + width
    elif width == pickletools.UP_TO_NEWLINE:  # GLOBAL and INST take two lines, the others one
        end = arg_at
        for _ in range(2 if op.name in ("GLOBAL", "INST") else 1):
            end = data.find(b"\n", end) + 1
            if end == 0:
                raise _Malformed(f"it ends inside the {op.name} opcode at byte {start}")
    else:
        size = _LENGTH_BYTES[width]
        if arg_at + size > len(data):
            raise _Malformed(f"it ends inside the {op.name} opcode at byte {start}")
        length = int.from_bytes(data[arg_at:arg_at + size], "little", signed=width == pickletools.TAKEN_FROM_ARGUMENT4)
        if length < 0:
            raise _Malformed(f"a negative length in the {op.name} opcode at byte {start}")
        arg_at += size
        end = arg_at + length
    if end > len(data):
        raise _Malformed(f"it ends inside the {op.name} opcode at byte {start}")
    return arg_at, end


def _pop(stack: list, marks: list[int], count: int, name: str, start: int) -> list:
    """The top ``count`` values of the symbolic stack, taken off it (never below the innermost MARK)."""
    held = len(stack) - (marks[-1] if marks else 0)
    if held < count:
        raise _Malformed(f"{name} at byte {start} takes {count} values from a stack that holds {held}")
    if not count:
        return []
    popped = stack[-count:]
    del stack[-count:]
    return popped


def _apply(op, stack: list, marks: list[int], start: int) -> None:
    """The stack effect of ``op`` as pickletools describes it: what it takes (down to a MARK for those that take
    one), then an opaque value for each it pushes."""
    before, after = op.stack_before, op.stack_after
    if pickletools.markobject in before:
        if not marks:
            raise _Malformed(f"{op.name} at byte {start} has no MARK before it")
        del stack[marks.pop():]
        _pop(stack, marks, before.index(pickletools.markobject), op.name, start)
    else:
        _pop(stack, marks, len(before), op.name, start)
    stack.extend((None, start) for _ in after)


def _string(name: str, arg: memoryview) -> str | None:
    """The str a string opcode pushes, as torch's and pickle's unpicklers decode it; None for a protocol-0 quoted
    STRING and for a byte string that is no UTF-8 (values a STACK_GLOBAL cannot be sure to see as this walk does)."""
    if name == "UNICODE":
        return str(arg[:-1], "raw-unicode-escape")
    if name == "STRING":
        return None
    if name in ("SHORT_BINSTRING", "BINSTRING"):
        try:
            return str(arg, "utf-8")
        except UnicodeDecodeError:
            return None
    return str(arg, "utf-8", "surrogatepass")


def _memo_key(name: str, arg: memoryview) -> int:
    key = int(bytes(arg[:-1])) if name in ("GET", "PUT") else int.from_bytes(arg, "little")
    if key < 0:
        raise _Malformed(f"a negative memo key in a {name} opcode")
    return key


def _utf8(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _binunicode(value: str) -> bytes:
    encoded = _utf8(value)
    return b"X" + len(encoded).to_bytes(4, "little") + encoded


def _memo_op(index: int, put: bool) -> bytes:
    if index < 256:
        return (b"q" if put else b"h") + bytes((index,))
    return (b"r" if put else b"j") + index.to_bytes(4, "little")


def _global_op(module: str, attr: str) -> bytes:
    return b"c" + _utf8(module) + b"\n" + _utf8(attr) + b"\n"
