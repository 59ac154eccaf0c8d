"""The fused log-prob launchers' memory plan as data: which temporaries they take, where the fp32 d-hidden
accumulator lives and how they walk the vocabulary, planned from sizes alone.

Everything here is pure: ints in, frozen dataclasses out, no tensors and no torch ops. The launchers in
``grpo_fast.kernels.linear_logprobs`` only walk what these functions return (every size they use is a field here),
and the torch path (``grpo_fast.logprobs_torch``) takes its tiles from ``torch_chunks``: both keep to one temporaries
budget, ``scratch_bytes()`` (``GRPO_FAST_SCRATCH_MIB``, 64 MiB by default).

Forward (``forward_layout``). One ``[N, C]`` logits buffer in the input dtype takes the budget, less room for the
per-row statistics; the vocabulary goes in chunks of that width, each chunk's columns split over ``splits`` programs
per row block.

Backward (``backward_layout``). With a weight gradient, vocabulary chunks outer (``VocabWalk``, ``vocab_walk``): the
walk goes from the end of the vocabulary down and keeps each chunk's ``dz`` buffer in grad_weight's rows not yet
written where they are enough, else in one budget-sized buffer. The fp32 accumulator of d hidden (``4 rows H``
bytes) is a temporary when it takes at most half the budget (``temporary_acc_rows``: the other half is the
buffer's); else it lives in grad_hidden's free bytes and then in the last rows of grad_weight (the tail), whose d
weight is recomputed over every row once the accumulator is cast. Without a weight gradient (a frozen lm_head), row
stripes (``StripeWalk``, ``stripe_walk``), each walking the whole vocabulary with its own accumulator: in
grad_hidden's bytes that no finished stripe holds while they are enough (stripes of N/2, N/4, ... rows), else a
temporary at the end of the stripes' buffer. ``AccHome`` names where each piece of an accumulator lives.

Worked example: N = 16384, H = 4096, V = 151936, bf16, every row active, the default 64 MiB. With d weight
(``grpo-fast layout 16384 4096 151936`` prints it; ``grpo-fast layout --help`` for other cases)::

    forward: 80 chunks of <= 1920 columns through one [16384, 1920] buffer (60.0 MiB), 1 column split(s)
    backward: vocabulary walk over 16384 rows within 64.0 MiB
      19 chunks from the end down: 14 with their dz in grad_weight (2304-16384 columns),
        5 through a [16384, 2048] buffer (64.0 MiB)
      grad_hidden, 128.0 MiB:
        bytes [0, 128.0 MiB): fp32 accumulator rows [0, 8192); cast in place, 4096 rows a step
      grad_weight, 1187.0 MiB:
        rows [0, 135552): d weight, written from the end down
          (before that, rows [0, 65536) at most hold the dz of a chunk kept there)
        rows [135552, 151936): fp32 accumulator rows [8192, 16384); then their d weight, recomputed over every row
          in 8 chunks of <= 2048 columns ([16384, 2048] buffer, 64.0 MiB)

A frozen lm_head, d hidden only (the same command with ``--frozen-head``)::

    forward: 80 chunks of <= 1920 columns through one [16384, 1920] buffer (60.0 MiB), 1 column split(s)
    backward: row stripes over 16384 rows within 64.0 MiB, one 64.0 MiB buffer
      stripe [0, 8192): 38 chunks of 4096 columns, its accumulator (128.0 MiB) in grad_hidden
      stripe [8192, 12288): 19 chunks of 8192 columns, its accumulator (64.0 MiB) in grad_hidden
      stripe [12288, 14336): 19 chunks of 8192 columns, its accumulator (32.0 MiB) in the buffer's end
      stripe [14336, 16384): 19 chunks of 8192 columns, its accumulator (32.0 MiB) in the buffer's end
      grad_hidden, 128.0 MiB:
        bytes [0, 128.0 MiB): stripe [0, 8192)'s accumulator; cast in place, 8192 rows a step
        bytes [64.0 MiB, 128.0 MiB): stripe [8192, 12288)'s accumulator; cast in place, 8192 rows a step
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_SCRATCH_MIB = 64
DEFAULT_SCRATCH_BYTES = DEFAULT_SCRATCH_MIB * 2**20
CHUNK_ALIGN = 128  # vocabulary chunks are multiples of this many columns (GEMM-friendly, whole column tiles)
MAX_WEIGHT_CHUNK = 16384  # a chunk whose dz buffer lives in grad_weight's free rows is at most this wide
ACC_ELEM = 4  # the d-hidden accumulator is fp32 (docs/design.md §5)


def scratch_bytes() -> int:
    """The temporaries budget of the log-prob launchers and the torch path's tiles: ``GRPO_FAST_SCRATCH_MIB`` MiB
    (default 64)."""
    raw = os.environ.get("GRPO_FAST_SCRATCH_MIB", str(DEFAULT_SCRATCH_MIB))
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise ValueError(f"GRPO_FAST_SCRATCH_MIB must be a positive number of MiB, got {raw!r}")
    return int(mib * 2**20)


def align16(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 16 (cuBLAS and vector loads want 16-byte aligned rows)."""
    return -(-nbytes // 16) * 16


def widest_chunk(rows: int, elem: int, v: int, budget: int) -> int:
    """The widest vocabulary chunk whose ``[rows, C]`` buffer of ``elem``-byte elements fits ``budget`` (a multiple
    of 128 columns, at least 128, at most V)."""
    c = budget // max(rows * elem, 1) // CHUNK_ALIGN * CHUNK_ALIGN
    return min(v, max(CHUNK_ALIGN, c))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def temporary_acc_rows(h: int, budget: int) -> int:
    """The most rows whose fp32 ``[rows, H]`` accumulator may be a temporary: at most half the budget, the other
    half being the chunk buffer's. The one place this rule is written."""
    return budget // 2 // (ACC_ELEM * h)


# ------------------------------------------------------------------------------------------------ forward
@dataclass(frozen=True)
class ForwardLayout:
    """chunks: ``(c0, c1, split)`` in order, ``split`` the columns of the chunk each of the ``splits`` programs of a
    row block takes (a multiple of ``block_c``). buffer_chunk: the width of the ``[N, C]`` logits buffer.
    stats_bytes: what the budget keeps for the per-row statistics (target logit; m, s and t per split)."""

    chunks: tuple[tuple[int, int, int], ...]
    buffer_chunk: int
    splits: int
    stats_bytes: int


def forward_layout(n: int, v: int, elem: int, budget: int, *, splits: int, block_c: int,
                   return_entropy: bool) -> ForwardLayout:
    """The forward's vocabulary chunks for ``n`` rows of ``elem``-byte inputs within ``budget`` bytes."""
    stats_bytes = n * (4 + (2 + return_entropy) * splits * 8)  # zy, and m, s (t) per split (m counted as 8: slack)
    c_max = widest_chunk(n, elem, v, max(budget - stats_bytes, 0))
    chunks = []
    for c0 in range(0, v, c_max):
        c = min(c_max, v - c0)
        split = _cdiv(_cdiv(c, splits), block_c) * block_c
        chunks.append((c0, c0 + c, split))
    return ForwardLayout(tuple(chunks), c_max, splits, stats_bytes)


# ------------------------------------------------------------------------------------------------ backward
class AccHome(enum.Enum):
    """Where a piece of the fp32 d-hidden accumulator lives."""

    GRADIENT = "gradient"  # grad_hidden itself: fp32 inputs, every row in its place (no cast)
    TEMPORARY = "temporary"  # a temporary: within half the budget (else the documented exception)
    GRAD_HIDDEN = "grad_hidden"  # grad_hidden's bytes that no gathered row or finished stripe holds
    GRAD_WEIGHT = "grad_weight"  # grad_weight's last rows (the tail), whose d weight is recomputed afterwards


@dataclass(frozen=True)
class AccPiece:
    """Rows ``[row0, row0 + rows)`` of the accumulator, in ``home`` from byte ``offset`` (GRAD_HIDDEN: of
    grad_hidden; GRAD_WEIGHT: of grad_weight's row ``V - tail``; TEMPORARY in the row-stripe walk: of the stripes'
    buffer; else 0). cast_piece: 0 to cast it into grad_hidden with one copy; else it lies in grad_hidden's own bytes
    at or above its destination, and goes in ascending pieces of this many rows through a temporary, each written
    below every byte still unread."""

    row0: int
    rows: int
    home: AccHome
    offset: int = 0
    cast_piece: int = 0


class Chunk(NamedTuple):
    """Columns ``[c0, c1)`` of the vocabulary; in_grad_weight: the chunk's ``dz`` buffer lives in rows
    ``[0, ceil(rows C / H))`` of grad_weight, below every row written so far and below the tail (else in the
    budget buffer)."""

    c0: int
    c1: int
    in_grad_weight: bool


@dataclass(frozen=True)
class VocabWalk:
    """The backward with a weight gradient (or without d hidden): vocabulary chunks outer.

    chunks: in order, the tail's first. acc: the accumulator's pieces (none without d hidden), tiling its rows.
    tail: rows ``[V - tail, V)`` of grad_weight hold the GRAD_WEIGHT piece during the walk; their d weight is
    recomputed afterwards over every row (``recompute``: chunks of at most ``recompute_chunk`` columns, through a
    ``[N, recompute_chunk]`` buffer). buffer_chunk: the width of the ``[rows, C]`` budget buffer (0: none).
    move_piece: rows per step moving gathered rows' d hidden to their places (0: not gathered or no d hidden)."""

    chunks: tuple[Chunk, ...]
    acc: tuple[AccPiece, ...]
    tail: int = 0
    buffer_chunk: int = 0
    recompute: tuple[tuple[int, int], ...] = ()
    recompute_chunk: int = 0
    move_piece: int = 0


def vocab_walk(n: int, rows: int, h: int, v: int, elem: int, budget: int, *, gathered: bool, need_hidden: bool,
               need_weight: bool) -> VocabWalk:
    """The vocabulary walk over ``rows`` active rows (of ``n``; ``gathered``: compacted into grad_hidden's first
    rows) of ``elem``-byte inputs within ``budget`` bytes of temporaries (see ``VocabWalk``). The accumulator goes to
    the temporaries when ``temporary_acc_rows`` allows, else into the gradients' own storage: grad_hidden's bytes
    past the gathered rows, then the tail of grad_weight (``2 n H tail`` more FLOPs); when it would need the tail and
    there is no grad_weight, or the tail would be all of it, it stays a temporary (over the budget)."""
    # where the accumulator goes: one home, or (in_storage) rows [0, in_grad_hidden) in grad_hidden's bytes from
    # byte acc_offset and the rest in grad_weight's last `tail` rows
    home = None if not need_hidden else AccHome.GRADIENT if elem == 4 and not gathered else AccHome.TEMPORARY
    in_storage, in_grad_hidden, acc_offset, tail = False, 0, 0, 0
    if home is AccHome.TEMPORARY and rows > temporary_acc_rows(h, budget):
        acc_offset = align16(rows * h * elem) if gathered else 0  # the gathered rows come first
        in_grad_hidden = max(0, min(rows, (n * h * elem - acc_offset) // (ACC_ELEM * h)))
        if in_grad_hidden < rows:
            tail = -(-(rows - in_grad_hidden) * ACC_ELEM // elem)
            while (v - tail) * h * elem % 16:  # the accumulator's rows start 16-byte aligned
                tail += 1
        in_storage = tail == 0 or (need_weight and tail < v)  # else the exception: a temporary over the budget
        if not in_storage:
            tail = 0
    if home is AccHome.TEMPORARY and not in_storage:
        budget = max(budget - ACC_ELEM * rows * h, 0)
    buffer_cap = widest_chunk(rows, elem, v, budget)

    chunks: list[Chunk] = []

    def sweep(lo: int, end: int) -> None:
        while end > lo:
            if need_weight:  # widest C with ceil(rows C / H) <= min(c0, V - tail): the buffer avoids written rows
                c = min(MAX_WEIGHT_CHUNK, end * h // (h + rows), (v - tail) * h // rows)
                c = min(c // CHUNK_ALIGN * CHUNK_ALIGN, end - lo)
                if c > buffer_cap and -(-rows * c // h) <= min(end - c, v - tail):
                    chunks.append(Chunk(end - c, end, True))
                    end -= c
                    continue
            c = min(buffer_cap, end - lo)
            chunks.append(Chunk(end - c, end, False))
            end -= c

    sweep(v - tail, v)  # the tail first: d hidden (and d bias) only
    sweep(0, v - tail)
    recompute_chunk = widest_chunk(n, elem, tail, budget) if tail else 0
    recompute = tuple((c0, min(c0 + recompute_chunk, v)) for c0 in range(v - tail, v, recompute_chunk or 1))
    buffer_chunk = max((c1 - c0 for c0, c1, in_weight in chunks if not in_weight), default=0)

    if in_storage:
        acc = tuple(p for p in (AccPiece(0, in_grad_hidden, AccHome.GRAD_HIDDEN, acc_offset, _cast_piece(h, budget)),
                                AccPiece(in_grad_hidden, rows - in_grad_hidden, AccHome.GRAD_WEIGHT)) if p.rows)
    else:
        acc = () if home is None else (AccPiece(0, rows, home),)
    move_piece = _cast_piece(h, budget) if gathered and need_hidden else 0  # budget: less a TEMPORARY accumulator
    return VocabWalk(tuple(chunks), acc, tail, buffer_chunk, recompute, recompute_chunk, move_piece)


def _cast_piece(h: int, free: int) -> int:
    """Rows of fp32 d hidden per step through a temporary of ``free`` bytes (at least one)."""
    return max(1, free // (ACC_ELEM * h))


@dataclass(frozen=True)
class Stripe:
    """A row stripe: its accumulator (``acc.row0``, ``acc.rows``: the stripe's rows) and the width of its
    vocabulary chunks."""

    acc: AccPiece
    chunk: int


@dataclass(frozen=True)
class StripeWalk:
    """The backward without a weight gradient: row stripes, each over the whole vocabulary. buffer_elems: the one
    temporary (in the input dtype) that holds each stripe's ``[rows, C]`` chunk and, at its end, a TEMPORARY
    accumulator. move_piece: as ``VocabWalk``'s."""

    stripes: tuple[Stripe, ...]
    buffer_elems: int
    move_piece: int = 0


def stripe_walk(n: int, rows: int, h: int, v: int, elem: int, budget: int, *, gathered: bool) -> StripeWalk:
    """Row stripes over ``rows`` active rows (of ``n``; ``gathered``: compacted into grad_hidden's first rows) of
    ``elem``-byte inputs within ``budget`` bytes (see ``StripeWalk``). fp32 inputs with every row in place
    accumulate into grad_hidden itself; else a stripe's accumulator is a temporary when the remaining rows' fits
    ``temporary_acc_rows``, and before that lives in grad_hidden's bytes that no finished stripe (nor a gathered
    row) holds, so stripes halve and the chunk buffer gets the whole budget. Launches: 3 per (stripe, chunk), about
    ``3 N V elem / budget`` in all."""
    temporary_max = temporary_acc_rows(h, budget)
    temporary_rows = min(rows, max(1, temporary_max))  # the rows of a stripe whose accumulator is a temporary
    bounds: list[tuple[int, int, AccHome, int]] = []  # (r0, r1, home, byte offset in grad_hidden)
    r0 = 0
    while r0 < rows:
        if elem == 4 and not gathered:
            bounds.append((0, rows, AccHome.GRADIENT, 0))
            break
        if rows - r0 <= temporary_max:
            bounds.append((r0, rows, AccHome.TEMPORARY, 0))
            break
        offset = align16((rows if gathered else r0) * h * elem)  # past the rows in use
        take = min(rows - r0, max(0, (n * h * elem - offset) // (ACC_ELEM * h)))
        if take <= temporary_max:  # no room worth a stripe: a temporary's worth of rows
            take = min(rows - r0, temporary_rows)
            bounds.append((r0, r0 + take, AccHome.TEMPORARY, 0))
        else:
            bounds.append((r0, r0 + take, AccHome.GRAD_HIDDEN, offset))
        r0 += take

    def acc_bytes(r: int, home: AccHome) -> int:  # a TEMPORARY accumulator takes the end of the buffer
        return align16(ACC_ELEM * r * h) if home is AccHome.TEMPORARY else 0

    chunk = {(r1 - r0, home): widest_chunk(r1 - r0, elem, v, max(budget - acc_bytes(r1 - r0, home), 0))
             for r0, r1, home, _ in bounds}
    space = max(r * c * elem + acc_bytes(r, home) for (r, home), c in chunk.items())
    buffer_elems = align16(space) // elem
    stripes = []
    for r0, r1, home, offset in bounds:
        cast = 0
        if home is AccHome.TEMPORARY:
            offset = buffer_elems * elem - acc_bytes(r1 - r0, home)
        elif home is AccHome.GRAD_HIDDEN and not gathered:  # over the stripe's own rows: in place, through the buffer
            cast = max(1, buffer_elems // h)
        stripes.append(Stripe(AccPiece(r0, r1 - r0, home, offset, cast), chunk[(r1 - r0, home)]))
    return StripeWalk(tuple(stripes), buffer_elems, _cast_piece(h, budget) if gathered else 0)


@dataclass(frozen=True)
class BackwardLayout:
    """A backward's plan: ``rows`` the rows it walks (the active rows when ``gathered``, else all N), the budget
    left to the walk once the gathered rows' temporaries are taken (``walk_budget``), and the walk."""

    rows: int
    gathered: bool
    walk_budget: int
    walk: VocabWalk | StripeWalk


def backward_layout(n: int, active: int, h: int, v: int, elem: int, budget: int, *, gathered: bool,
                    need_hidden: bool, need_weight: bool, vector_bytes: int = 0) -> BackwardLayout:
    """The backward over ``active`` rows of ``n`` (``gathered``: the caller gives their indices; every row when
    not) within ``budget`` bytes. Gathering copies the active rows' per-row vectors (``vector_bytes`` bytes a row)
    into temporaries and their hidden rows into grad_hidden's first rows, or into a temporary without d hidden; when
    that temporary would be over half the budget, every row is walked instead. Then d hidden alone walks row
    stripes, anything with d weight the vocabulary."""
    if gathered and not need_hidden and 2 * active * h * elem > budget:
        gathered, active = False, n  # no room for the gathered rows without grad_hidden's storage
    rows = active if gathered else n
    live = (rows * vector_bytes + (0 if need_hidden else rows * h * elem)) if gathered else 0
    free = max(budget - live, 0)
    if need_hidden and not need_weight:
        walk: VocabWalk | StripeWalk = stripe_walk(n, rows, h, v, elem, free, gathered=gathered)
    else:
        walk = vocab_walk(n, rows, h, v, elem, free, gathered=gathered, need_hidden=need_hidden,
                          need_weight=need_weight)
    return BackwardLayout(rows, gathered, free, walk)


# ------------------------------------------------------------------------------------------------ the torch path
class TorchChunks(NamedTuple):
    """The torch path's tiles: ``[token_chunk, vocab_chunk]`` logits."""

    token_chunk: int
    vocab_chunk: int


MAX_TORCH_VOCAB_CHUNK = 4096
MIN_TORCH_CHUNK = 128


def torch_chunks(n: int, v: int, h: int, budget: int, vocab_chunk: int | None = None,
                 token_chunk: int | None = None) -> TorchChunks:
    """The torch path's tile for ``n`` rows, ``v`` columns and hidden size ``h``: explicit sizes as given, else from
    ``budget``: one fp32 logits tile at most an eighth of it (``budget // 32`` elements), the fp32 ``[vocab_chunk,
    H]`` d-weight accumulator and ``[token_chunk, H]`` row buffers at most a quarter each. The default 64 MiB gives
    8 MiB tiles and 16 MiB row buffers."""
    tile_elems, row_bytes = budget // 32, budget // 4
    c = vocab_chunk
    if c is None:
        c = min(v, MAX_TORCH_VOCAB_CHUNK, max(MIN_TORCH_CHUNK, row_bytes // (4 * max(h, 1))))
    t = token_chunk
    if t is None:
        t = min(max(n, 1), max(1, tile_elems // c), max(MIN_TORCH_CHUNK, row_bytes // (4 * max(h, 1))))
    assert c >= 1 and t >= 1, "chunk sizes must be positive"
    return TorchChunks(t, c)


# ------------------------------------------------------------------------------------------------ the map
def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes else "0"


def describe(n: int, h: int, v: int, elem: int, budget: int, *, active: int | None = None, need_hidden: bool = True,
             need_weight: bool = True, splits: int = 1, block_c: int = 256, return_entropy: bool = False) -> str:
    """The forward's and the backward's layouts as text: the chunks, and a map of grad_hidden's and grad_weight's
    bytes during the backward (``active``: rows with an upstream gradient, gathered; default all; the gathered
    vectors taken as targets, m, log s, g: 20 bytes a row)."""
    fwd = forward_layout(n, v, elem, budget, splits=splits, block_c=block_c, return_entropy=return_entropy)
    lines = [f"forward: {len(fwd.chunks)} chunks of <= {fwd.buffer_chunk} columns through one [{n}, "
             f"{fwd.buffer_chunk}] buffer ({_mib(n * fwd.buffer_chunk * elem)}), {fwd.splits} column split(s)"]
    active = n if active is None else active
    lay = backward_layout(n, active, h, v, elem, budget, gathered=active < n, need_hidden=need_hidden,
                          need_weight=need_weight, vector_bytes=20)
    a, walk = lay.rows, lay.walk
    acc_bytes = ACC_ELEM * a * h
    gh_map = [f"  grad_hidden, {_mib(n * h * elem)}:"] if need_hidden else []
    if lay.gathered and need_hidden:
        gh_map.append(f"    bytes [0, {_mib(a * h * elem)}): the {a} gathered hidden rows, then their d hidden")
    if isinstance(walk, StripeWalk):
        lines.append(f"backward: row stripes over {a} rows within {_mib(lay.walk_budget)}, one "
                     f"{_mib(walk.buffer_elems * elem)} buffer")
        for s in walk.stripes:
            p = s.acc
            lines.append(f"  stripe [{p.row0}, {p.row0 + p.rows}): {-(-v // s.chunk)} chunks of {s.chunk} "
                         f"columns, its accumulator ({_mib(ACC_ELEM * p.rows * h)}) in "
                         + {AccHome.GRADIENT: "grad_hidden itself", AccHome.GRAD_HIDDEN: "grad_hidden",
                            AccHome.TEMPORARY: "the buffer's end"}[p.home])
            if p.home is AccHome.GRAD_HIDDEN:
                cast = f"cast in place, {p.cast_piece} rows a step" if p.cast_piece else "cast with one copy"
                gh_map.append(f"    bytes [{_mib(p.offset)}, {_mib(p.offset + ACC_ELEM * p.rows * h)}): stripe "
                              f"[{p.row0}, {p.row0 + p.rows})'s accumulator; {cast}")
        return "\n".join(lines + gh_map)
    kept = [c for c in walk.chunks if c.in_grad_weight]
    lines.append(f"backward: vocabulary walk over {a} rows within {_mib(lay.walk_budget)}")
    widths = f" ({min(c.c1 - c.c0 for c in kept)}-{max(c.c1 - c.c0 for c in kept)} columns)" if kept else ""
    lines.append(f"  {len(walk.chunks)} chunks from the end down: {len(kept)} with their dz in grad_weight{widths},")
    lines.append(f"    {len(walk.chunks) - len(kept)} through a [{a}, {walk.buffer_chunk}] buffer "
                 f"({_mib(a * walk.buffer_chunk * elem)})")
    gw_map = [f"  grad_weight, {_mib(v * h * elem)}:"] if need_weight else []
    if need_weight:
        gw_map.append(f"    rows [0, {v - walk.tail}): d weight, written from the end down")
    if kept:
        gw_map.append(f"      (before that, rows [0, {max(-(-a * (c.c1 - c.c0) // h) for c in kept)}) at most hold "
                      "the dz of a chunk kept there)")
    for p in walk.acc:
        rows = f"rows [{p.row0}, {p.row0 + p.rows})"
        if p.home is AccHome.GRADIENT:
            gh_map.append(f"    all: the fp32 accumulator itself ({_mib(acc_bytes)})")
        elif p.home is AccHome.TEMPORARY:
            over = ", over the budget" if acc_bytes > lay.walk_budget // 2 else ""
            gh_map.append(f"    the fp32 accumulator ({_mib(acc_bytes)}) is a temporary{over}; cast with one copy")
        elif p.home is AccHome.GRAD_HIDDEN:
            gh_map.append(f"    bytes [{_mib(p.offset)}, {_mib(p.offset + ACC_ELEM * p.rows * h)}): fp32 accumulator "
                          f"{rows}; cast in place, {p.cast_piece} rows a step")
        else:
            gw_map.append(f"    rows [{v - walk.tail}, {v}): fp32 accumulator {rows}; then their d weight, recomputed "
                          f"over every row")
            gw_map.append(f"      in {len(walk.recompute)} chunks of <= {walk.recompute_chunk} columns ([{n}, "
                          f"{walk.recompute_chunk}] buffer, {_mib(n * walk.recompute_chunk * elem)})")
    if walk.move_piece:
        step = min(walk.move_piece, a)
        gh_map.append(f"    then each gathered row's d hidden moves to its row, "
                      f"{'all at once' if step == a else f'{step} rows a step'}")
    return "\n".join(lines + gh_map + gw_map)


DESCRIPTION = "Print the log-prob launchers' memory plan for a shape: where each temporary and accumulator lives."


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {'integer' if kind is int else 'number'}, "
                                             f"got {text!r}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``grpo-fast layout`` (``grpo_fast.cli``)."""
    p.add_argument("n", type=_positive(int), help="tokens (rows of hidden)")
    p.add_argument("h", type=_positive(int), help="hidden size")
    p.add_argument("v", type=_positive(int), help="vocabulary size")
    p.add_argument("--elem", type=int, default=2, choices=(2, 4),
                   help="bytes per input element: 2 for bf16/fp16 (default), 4 for fp32")
    p.add_argument("--budget-mib", type=_positive(float), default=DEFAULT_SCRATCH_MIB,
                   help=f"the temporaries budget (default {DEFAULT_SCRATCH_MIB}, what GRPO_FAST_SCRATCH_MIB sets)")
    p.add_argument("--active", type=int, default=None,
                   help="rows with an upstream gradient, 0 to N (default: all); fewer than N are gathered")
    p.add_argument("--frozen-head", action="store_true", help="no d weight (row stripes)")
    p.add_argument("--splits", type=_positive(int), default=1,
                   help="the forward's column splits (the launcher's choice; default 1)")


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``grpo-fast layout``: the plan of ``ns`` (from ``add_arguments``' options) printed; ``parser`` reports what
    the options' types cannot check alone."""
    if ns.active is not None and not 0 <= ns.active <= ns.n:
        parser.error(f"argument --active: expected 0 to N={ns.n} rows, got {ns.active}")
    print(describe(ns.n, ns.h, ns.v, ns.elem, int(ns.budget_mib * 2**20), active=ns.active,
                   need_weight=not ns.frozen_head, splits=ns.splits))
    return 0


if __name__ == "__main__":  # the package imports this module first, so runpy would warn: the command is the CLI's
    print("the memory plan is printed by `grpo-fast layout N H V` (see `grpo-fast layout --help`)", file=sys.stderr)
    raise SystemExit(2)
