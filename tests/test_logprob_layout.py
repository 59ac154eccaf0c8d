"""The log-prob launchers' memory plan (kernels/logprob_layout.py): pure functions of sizes, checked for their
invariants over random shapes and budgets, at the shapes the docs quote, and through the launchers: the plans they
record (every Step's bytes, FLOPs and shape) are pinned, so a change of the planner or of a kernel's traffic
declaration that moves a byte shows here."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from grpo_fast.kernels import linear_logprobs as ll
from grpo_fast.kernels import logprob_layout as lay
from grpo_fast.kernels.launch import Target, capture
from grpo_fast.kernels.logprob_layout import AccHome
from grpo_fast.kernels.plan import Plan
from grpo_fast.logprob_contract import BackwardInputs, LogprobParams, SavedStats

MIB = 2**20


def _random_case(seed):
    rnd = random.Random(seed)
    n = rnd.choice([1, 7, 61, 1000, 16384])
    a = rnd.randint(1, n)
    h, v = rnd.choice([16, 48, 97, 4096]), rnd.choice([300, 1151, 32000, 151936])
    elem = rnd.choice([2, 4])
    budget = rnd.choice([4096, 65536, 2**20, 64 * MIB])
    return rnd, n, a, h, v, elem, budget


# ------------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("seed", range(20))
def test_forward_layout_invariants(seed):
    """The chunks tile the vocabulary in order, each within the buffer; the buffer and the statistics fit the
    budget unless the chunk is the narrowest; each split is whole column tiles and the splits cover the chunk."""
    rnd, n, _, _, v, elem, budget = _random_case(seed)
    splits, block_c = rnd.choice([1, 3, 16]), rnd.choice([128, 256])
    fwd = lay.forward_layout(n, v, elem, budget, splits=splits, block_c=block_c, return_entropy=rnd.random() < 0.5)
    assert fwd.chunks[0][0] == 0 and fwd.chunks[-1][1] == v
    assert all(x[1] == y[0] for x, y in zip(fwd.chunks, fwd.chunks[1:]))
    for c0, c1, split in fwd.chunks:
        assert 0 < c1 - c0 <= fwd.buffer_chunk and split % block_c == 0 and split * splits >= c1 - c0
    if fwd.buffer_chunk > lay.CHUNK_ALIGN:
        assert n * fwd.buffer_chunk * elem + fwd.stats_bytes <= budget


# ------------------------------------------------------------------------------------------------ vocabulary walk
@pytest.mark.parametrize("seed", range(40))
def test_vocab_walk_invariants(seed):
    """Random shapes and budgets: the chunks tile the vocabulary once; a dz buffer in grad_weight lies below every
    row already written and below the tail; the accumulator's pieces tile its rows, those in the gradients' storage
    fit grad_hidden's free bytes and the tail; the recomputed chunks tile the tail."""
    rnd, n, a, h, v, elem, budget = _random_case(seed)
    need_h, need_w = rnd.choice([(True, True), (True, False), (False, True)])
    gathered = a < n
    walk = lay.vocab_walk(n, a, h, v, elem, budget, gathered=gathered, need_hidden=need_h, need_weight=need_w)
    cols = sorted((c0, c1) for c0, c1, _ in walk.chunks)
    assert cols[0][0] == 0 and cols[-1][1] == v and all(x[1] == y[0] for x, y in zip(cols, cols[1:]))
    written = v  # grad_weight rows [written, V) hold finished d weight (the tail: the accumulator)
    for c0, c1, in_weight in walk.chunks:
        assert c1 <= written or c0 >= v - walk.tail, (c0, c1, walk)  # from the end down, the tail first
        if in_weight:
            buffer_rows = -(-a * (c1 - c0) // h)
            assert need_w and buffer_rows <= min(c0, v - walk.tail, written), (c0, c1, walk)
        if c1 <= v - walk.tail:
            written = c0
    assert sum(p.rows for p in walk.acc) == (a if need_h else 0)
    assert all(p.rows > 0 and p.row0 == sum(q.rows for q in walk.acc[:i]) for i, p in enumerate(walk.acc))
    homes = {p.home for p in walk.acc}
    if homes & {AccHome.GRAD_HIDDEN, AccHome.GRAD_WEIGHT}:  # in the gradients' own storage
        assert need_h and 0 <= walk.tail < v and (need_w or walk.tail == 0) and len(homes) == len(walk.acc)
    for p in walk.acc:
        if p.home is AccHome.GRAD_HIDDEN:
            assert p.offset >= (a * h * elem if gathered else 0) and p.offset + p.rows * h * 4 <= n * h * elem
            assert p.cast_piece == max(1, budget // (4 * h))
        elif p.home is AccHome.GRAD_WEIGHT:
            assert p.rows * 4 <= walk.tail * elem and (v - walk.tail) * h * elem % 16 == 0 and p.offset == 0
        else:
            assert p.cast_piece == 0 and len(walk.acc) == 1
            assert p.home is not AccHome.GRADIENT or (elem == 4 and not gathered)
    if walk.tail:
        assert AccHome.GRAD_WEIGHT in homes
        assert walk.recompute[0][0] == v - walk.tail and walk.recompute[-1][1] == v
        assert all(x[1] == y[0] for x, y in zip(walk.recompute, walk.recompute[1:]))
    else:
        assert not walk.recompute and walk.recompute_chunk == 0
    if walk.buffer_chunk > lay.CHUNK_ALIGN:
        assert a * walk.buffer_chunk * elem <= budget
    assert walk.move_piece == 0 if not (gathered and need_h) else walk.move_piece >= 1


def test_where_grad_weight_cannot_hold_the_rest_the_accumulator_is_a_temporary():
    """More tokens than vocabulary rows (bf16, every row active): grad_hidden's bytes hold half the fp32
    accumulator and grad_weight's tail cannot hold the other half, so it is a temporary over the budget (the
    documented exception to the 64 MiB bound)."""
    walk = lay.vocab_walk(16384, 16384, 4096, 8192, 2, 64 * MIB, gathered=False, need_hidden=True, need_weight=True)
    assert [p.home for p in walk.acc] == [AccHome.TEMPORARY] and walk.tail == 0
    walk = lay.vocab_walk(16384, 16384, 4096, 32768, 2, 64 * MIB, gathered=False, need_hidden=True, need_weight=True)
    assert [p.home for p in walk.acc] == [AccHome.GRAD_HIDDEN, AccHome.GRAD_WEIGHT]


def test_the_accumulator_is_a_temporary_up_to_half_the_budget():
    """The one rule: a temporary accumulator takes at most half the budget, the other half is the chunk buffer's."""
    h, budget = 4096, 64 * MIB
    rows = lay.temporary_acc_rows(h, budget)
    assert 4 * rows * h <= budget // 2 < 4 * (rows + 1) * h
    for a, home in ((rows, AccHome.TEMPORARY), (rows + 1, AccHome.GRAD_HIDDEN)):
        walk = lay.vocab_walk(16384, a, h, 151936, 2, budget, gathered=True, need_hidden=True, need_weight=True)
        assert walk.acc[0].home is home


def test_the_target_shape_layout():
    """N = 16384, H = 4096, V = 151936, bf16, 64 MiB (the module docstring's example): half the accumulator in
    grad_hidden, half in grad_weight's last 16384 rows, recomputed in 8 chunks; 14 chunks in grad_weight's rows."""
    walk = lay.backward_layout(16384, 16384, 4096, 151936, 2, 64 * MIB, gathered=False, need_hidden=True,
                               need_weight=True).walk
    assert [(p.row0, p.rows, p.home) for p in walk.acc] == [(0, 8192, AccHome.GRAD_HIDDEN),
                                                           (8192, 8192, AccHome.GRAD_WEIGHT)]
    assert walk.tail == 16384 and len(walk.recompute) == 8 and walk.buffer_chunk == 2048
    assert sum(c.in_grad_weight for c in walk.chunks) == 14 and len(walk.chunks) == 19


# ------------------------------------------------------------------------------------------------ row stripes
@pytest.mark.parametrize("seed", range(40))
def test_stripe_walk_invariants(seed):
    """Random shapes and budgets: the stripes tile the rows in order; an accumulator in grad_hidden lies past every
    row still in use (the finished stripes', or every gathered row) and within grad_hidden's bytes, and holds more
    rows than a temporary would; a temporary one lies at the end of the buffer, past the stripe's chunk; every chunk
    fits the buffer, and the buffer fits the budget unless the chunk is the narrowest."""
    _, n, a, h, v, elem, budget = _random_case(seed)
    gathered = a < n
    walk = lay.stripe_walk(n, a, h, v, elem, budget, gathered=gathered)
    cap, buffer_bytes = lay.temporary_acc_rows(h, budget), walk.buffer_elems * elem
    row = 0
    for s in walk.stripes:
        p = s.acc
        assert p.row0 == row and p.rows >= 1
        row += p.rows
        assert min(v, lay.CHUNK_ALIGN) <= s.chunk <= v and p.rows * s.chunk * elem <= buffer_bytes
        acc_bytes = 0
        if p.home is AccHome.GRADIENT:
            assert elem == 4 and not gathered and len(walk.stripes) == 1 and p.cast_piece == 0
        elif p.home is AccHome.GRAD_HIDDEN:
            assert p.offset >= (a if gathered else p.row0) * h * elem and p.offset % 16 == 0
            assert p.offset + 4 * p.rows * h <= n * h * elem and p.rows > cap
            assert p.cast_piece == (0 if gathered else max(1, walk.buffer_elems // h))
        else:
            acc_bytes = lay.align16(4 * p.rows * h)
            assert p.home is AccHome.TEMPORARY and p.rows <= max(1, cap) and p.cast_piece == 0
            assert p.offset >= p.rows * s.chunk * elem and p.offset + acc_bytes <= buffer_bytes
        if s.chunk > lay.CHUNK_ALIGN:
            assert p.rows * s.chunk * elem + acc_bytes <= budget
    assert row == a
    assert walk.move_piece == (max(1, budget // (4 * h)) if gathered else 0)


def test_frozen_head_stripes_at_the_target_shape():
    """bf16, every row active, 64 MiB: stripes of N/2 and N/4 rows in grad_hidden's free bytes, then two whose
    accumulators (32 MiB, half the budget) are temporaries at the end of the one 64 MiB buffer."""
    walk = lay.backward_layout(16384, 16384, 4096, 151936, 2, 64 * MIB, gathered=False, need_hidden=True,
                               need_weight=False).walk
    assert isinstance(walk, lay.StripeWalk) and walk.buffer_elems * 2 == 64 * MIB
    assert [(s.acc.rows, s.acc.home, s.chunk) for s in walk.stripes] == [
        (8192, AccHome.GRAD_HIDDEN, 4096), (4096, AccHome.GRAD_HIDDEN, 8192), (2048, AccHome.TEMPORARY, 8192),
        (2048, AccHome.TEMPORARY, 8192)]
    assert [s.acc.offset for s in walk.stripes[:2]] == [0, 8192 * 4096 * 2]


def test_fp32_stripes_accumulate_in_grad_hidden_itself():
    walk = lay.stripe_walk(1000, 1000, 4096, 32000, 4, 64 * MIB, gathered=False)
    assert [(s.acc.rows, s.acc.home) for s in walk.stripes] == [(1000, AccHome.GRADIENT)]


# ------------------------------------------------------------------------------------------------ the whole backward
def test_backward_layout_gathers_within_the_budget():
    """Gathered rows take their vectors' bytes (and, without d hidden, a temporary for their hidden rows) from the
    walk's budget; when that temporary would take over half the budget, every row is walked instead."""
    n, h, v, budget = 16384, 4096, 151936, 64 * MIB
    kept = lay.backward_layout(n, 1000, h, v, 2, budget, gathered=True, need_hidden=False, need_weight=True,
                               vector_bytes=28)
    assert kept.gathered and kept.rows == 1000 and kept.walk_budget == budget - 1000 * (28 + h * 2)
    dropped = lay.backward_layout(n, 12288, h, v, 2, budget, gathered=True, need_hidden=False, need_weight=True,
                                  vector_bytes=28)
    assert not dropped.gathered and dropped.rows == n and dropped.walk_budget == budget
    with_hidden = lay.backward_layout(n, 12288, h, v, 2, budget, gathered=True, need_hidden=True, need_weight=True,
                                      vector_bytes=28)
    assert with_hidden.gathered and with_hidden.walk_budget == budget - 12288 * 28
    assert isinstance(with_hidden.walk, lay.VocabWalk) and with_hidden.walk.move_piece >= 1
    frozen = lay.backward_layout(n, 12288, h, v, 2, budget, gathered=True, need_hidden=True, need_weight=False,
                                 vector_bytes=28)
    assert isinstance(frozen.walk, lay.StripeWalk)


@pytest.mark.parametrize("argv", [[], ["--frozen-head"]])
def test_the_docstring_example_is_the_planners_output(capsys, argv):
    """The module docstring's maps are what ``grpo-fast layout 16384 4096 151936`` prints (with ``--frozen-head``
    for the second)."""
    from grpo_fast import cli

    assert cli.main(["layout", "16384", "4096", "151936", *argv]) == 0
    text = capsys.readouterr().out
    assert "\n".join("    " + line for line in text.splitlines()) in lay.__doc__


def test_grpo_fast_layout_prints_the_plan_and_checks_its_arguments(capsys):
    """A gathered walk moving its rows in one step says so; bad sizes are refused naming the argument."""
    from grpo_fast import cli

    assert cli.main(["layout", "1000", "64", "5000", "--active", "300"]) == 0
    small = capsys.readouterr().out
    assert "300 gathered hidden rows" in small and "moves to its row, all at once" in small
    for argv, message in ((["0", "64", "5000"], "argument n: expected a positive integer, got '0'"),
                          (["10", "64", "5000", "--active", "11"], "--active: expected 0 to N=10 rows, got 11"),
                          (["10", "64", "5000", "--budget-mib", "nan"], "expected a positive number, got 'nan'"),
                          (["10", "64", "5000", "--elem", "3"], "argument --elem: invalid choice: 3")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["layout", *argv])
        assert stop.value.code == 2 and message in capsys.readouterr().err, argv


# ------------------------------------------------------------------------------------------------ the plans, pinned
def _plans(n, h, v, dtype, budget, *, entropy, need, bias=False, softcap=False, rows=None, sms=132):
    """The forward's and the backward's plans on meta tensors (a captured sm_90 with ``sms`` SMs). ``need``: "g"
    and/or "e" (upstream gradients of logp and entropy), "h", "w", "b" (the gradients wanted); ``rows``: how many
    rows are active (gathered), None for all."""
    meta = lambda *s, dt=dtype: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    f32 = torch.float32
    hidden, weight, y = meta(n, h), meta(v, h), meta(n, dt=torch.int64)
    b = meta(v) if bias else None
    g = meta(n, dt=f32) if "g" in need else None
    ge = meta(n, dt=f32) if entropy and "e" in need else None
    fwd, bwd = Plan(), Plan()
    with capture(Target("cuda", 90, 32), sms=sms):
        params = LogprobParams(0.7, 30.0 if softcap else None, entropy, budget=budget)
        _, ent, m, log_s = ll.forward(hidden, weight, y, b, params, plan=fwd)
        grads = BackwardInputs(SavedStats(m, log_s, ent), g, ge, "h" in need, "w" in need, bias and "b" in need)
        ll.backward(hidden, weight, y, b, params, grads, rows=None if rows is None else meta(rows, dt=torch.int64),
                    every_row=rows is None, plan=bwd)
    return fwd, bwd


def _summary(plan):
    steps = [[s.kind, s.name, list(s.shape), s.flops, s.bytes_read, s.bytes_written] for s in plan.steps]
    digest = hashlib.sha256(json.dumps(steps).encode()).hexdigest()[:16]
    return plan.launches, plan.flops, plan.hbm_bytes, plan.peak_bytes, digest


BF16, FP32 = torch.bfloat16, torch.float32
CASES = {
    "target bf16": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False, need="ghw"),
    "target bf16 entropy": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=True, need="gehw"),
    "target fp32": dict(n=16384, h=4096, v=151936, dtype=FP32, budget=64 * MIB, entropy=False, need="ghw"),
    "target bf16 4 MiB": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=4 * MIB, entropy=False, need="ghw"),
    "target frozen head": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False, need="gh"),
    "target d weight only": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False, need="gw"),
    "target gathered": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False, need="ghw",
                           rows=12288),
    "target gathered frozen head": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False,
                                       need="gh", rows=3276),
    "target gathered d weight only": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False,
                                         need="gw", rows=12288),
    "target no active row": dict(n=16384, h=4096, v=151936, dtype=BF16, budget=64 * MIB, entropy=False, need="ghw",
                                rows=0),
    "more rows than vocabulary": dict(n=16384, h=4096, v=8192, dtype=BF16, budget=64 * MIB, entropy=False, need="ghw"),
    "61x48x1151 bf16 12 KiB gathered": dict(n=61, h=48, v=1151, dtype=BF16, budget=12288, entropy=True, need="gehwb",
                                            bias=True, softcap=True, rows=41, sms=4),
    "61x48x1151 fp32 4 KiB frozen head gathered": dict(n=61, h=48, v=1151, dtype=FP32, budget=4096, entropy=False,
                                                       need="ghb", bias=True, softcap=True, rows=8),
    "1000x48x300 bf16 4 KiB frozen head": dict(n=1000, h=48, v=300, dtype=BF16, budget=4096, entropy=False,
                                               need="ghb", bias=True, softcap=True),
    "300x97x1151 fp32 64 KiB entropy gradient only": dict(n=300, h=97, v=1151, dtype=FP32, budget=65536,
                                                          entropy=True, need="ehwb", bias=True, softcap=True,
                                                          rows=200, sms=4),
    "7x16x300 bf16 4 KiB d weight only": dict(n=7, h=16, v=300, dtype=BF16, budget=4096, entropy=False, need="gw",
                                              rows=1, sms=4),
}
# (case, (forward: launches, FLOPs, bytes, peak temporaries, digest of every Step), (backward: the same)): the plans
# of the launchers as they were when the traffic moved next to the kernels and the layouts into logprob_layout
PINNED = [
    ("target bf16",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (125, 63376537419776, 49744904192, 67108864, "4193dae825a18fcb")),
    ("target bf16 entropy",
     (161, 20392504721408, 22007840768, 63307776, "3d6617164fa98aaa"),
     (125, 63376537419776, 49748443136, 67108864, "b972ebe685f15ea2")),
    ("target fp32",
     (341, 20392504721408, 68138434560, 58982400, "96bad71577cf68dc"),
     (89, 61177514164224, 81152311296, 67108864, "04f7f46d098aa600")),
    ("target bf16 4 MiB",
     (2375, 20392504721408, 171218763776, 4456448, "0a556301a7ee2fcf"),
     (615, 63376537419776, 93275357184, 4194304, "44771eb3e1ae1268")),
    ("target frozen head",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (295, 40785009442816, 49879613440, 67108864, "86f6ee8a857ec22b")),
    ("target d weight only",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (57, 40785009442816, 27510374400, 67108864, "02581a3e72718317")),
    ("target gathered",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (136, 49319109459968, 40333639680, 66306048, "72c8bc9dd5fb3de5")),
    ("target gathered frozen head",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (59, 8155010433024, 9156300496, 66319344, "d81f3f093c5e0838")),
    ("target gathered d weight only",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (57, 40785009442816, 27510374400, 67108864, "02581a3e72718317")),
    ("target no active row",
     (161, 20392504721408, 21986803712, 63176704, "721a223b9c3e2dc5"),
     (2, 0, 1378877440, 0, "701135aa27913cd8")),
    ("more rows than vocabulary",
     (11, 1099511627776, 1278279680, 63176704, "718045561681bf2a"),
     (78, 3298534883328, 17521639424, 272629760, "9fe63000b268e638")),
    ("61x48x1151 bf16 12 KiB gathered",
     (19, 6740256, 498074, 18300, "178b382146fbc41d"),
     (54, 14073120, 1261056, 11644, "c2b901e71d39f38f")),
    ("61x48x1151 fp32 4 KiB frozen head gathered",
     (19, 6740256, 966136, 35136, "fba9a9ffd6ca1f83"),
     (47, 1767936, 714578, 5792, "6f2ff749eb8bb897")),
    ("1000x48x300 bf16 4 KiB frozen head",
     (7, 28800000, 1713400, 284000, "5eab23c259ee83ca"),
     (118, 57600000, 5652528, 128000, "4d485e1261885bb7")),
    ("300x97x1151 fp32 64 KiB entropy gradient only",
     (19, 66988200, 4407592, 160800, "731d42daa6f79f08"),
     (67, 141969200, 11387736, 128400, "f0ab3b58688e8768")),
    ("7x16x300 bf16 4 KiB d weight only",
     (5, 67200, 19400, 3780, "83d612ae7298206d"),
     (8, 19200, 21992, 652, "a6d72f8bb998b783")),
]


@pytest.mark.parametrize("case, forward, backward", PINNED, ids=[c for c, _, _ in PINNED])
def test_the_plans_are_pinned(case, forward, backward):
    """Every Step of these plans (kind, name, shape, FLOPs, bytes read and written) and the peak temporaries are
    what they were: the target shape (bf16 and fp32, entropy, the frozen head, gathered rows, the over-budget
    exception) and small shapes at tight budgets that reach every layout."""
    fwd, bwd = _plans(**CASES[case])
    assert (_summary(fwd), _summary(bwd)) == (forward, backward)




def test_a_kernel_without_a_traffic_declaration_is_refused():
    """``Plan.kernel`` takes a launch's bytes from the kernel's own declaration, never from the call site."""
    with pytest.raises(LookupError, match="declares no traffic"):
        Plan().kernel("undeclared", object(), (1,), num_warps=1)


# ------------------------------------------------------------------------------------------------ the torch path
def _torch_chunks_before(n, v, h):
    """The torch path's automatic tile as it was before the budget governed it: an fp32 tile of at most 2 Mi
    elements (8 MiB), a d-weight accumulator and row buffers of at most 16 MiB."""
    c = min(v, 4096, max(128, 16 * MIB // (4 * max(h, 1))))
    return min(max(n, 1), max(1, 2 * 1024 * 1024 // c), max(128, 16 * MIB // (4 * max(h, 1)))), c


@pytest.mark.parametrize("n", [0, 1, 7, 300, 4096, 16384, 100000])
@pytest.mark.parametrize("v, h", [(300, 16), (1151, 48), (32000, 512), (151936, 4096), (128256, 8192), (53, 100000)])
def test_torch_chunks_at_the_default_budget_are_the_old_ones(n, v, h):
    """The budget that governs the GPU path governs the torch path's tiles too, mapped so that the default 64 MiB
    gives the tiles it always had (same chunking: same numerics, same speed)."""
    assert tuple(lay.torch_chunks(n, v, h, lay.DEFAULT_SCRATCH_BYTES)) == _torch_chunks_before(n, v, h)
    assert lay.torch_chunks(n, v, h, lay.DEFAULT_SCRATCH_BYTES, vocab_chunk=37, token_chunk=5) == (5, 37)


def test_the_torch_path_reads_the_budget_setting(monkeypatch):
    from grpo_fast.logprob_contract import LogprobParams

    monkeypatch.delenv("GRPO_FAST_SCRATCH_MIB", raising=False)
    assert LogprobParams().budget_bytes() == lay.DEFAULT_SCRATCH_BYTES
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", "8")
    assert LogprobParams().budget_bytes() == 8 * MIB and LogprobParams(budget=4096).budget_bytes() == 4096
    assert lay.torch_chunks(16384, 151936, 4096, 8 * MIB) == (128, 128)  # row buffers <= 2 MiB: the 128 floors
    assert lay.torch_chunks(4096, 32000, 512, 8 * MIB) == (256, 1024)
