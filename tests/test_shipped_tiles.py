"""The tiles shipped for GPUs run through the Triton interpreter against the float64 reference.

On CPU ``tile_config`` answers the interpreter's own tile (few, large programs), so the configurations of the
launchers' table ``CONFIGS[(family, n_bucket)]`` -- the ones a GPU runs -- would reach the numerics only through
gpu-marked tests. Here every distinct configuration of the table (derived from the table: a new tile is picked up)
drives the log-prob forward and backward: the launchers' ``tile_config`` is replaced by one that answers the tile
under test, and ``current_sms`` by an SM count that turns the forward's column split off (row blocks >= 2 SMs) or on
(some split programs of a narrow chunk then get no columns at all). The shapes reach every tile edge: N not a
multiple of BLOCK_N (the last row block is partial, also among the gathered active rows), V a multiple of neither
BLOCK_C nor the 128-column chunk alignment, chunks wider than one tile but not a multiple of it, a scratch budget
(``GRPO_FAST_SCRATCH_MIB``) that makes several vocabulary chunks, targets on chunk, split and vocabulary edges; with
bias, softcap, temperature != 1, entropy on and off and rows with zero upstream gradient. The launches the kernels
get are recorded, so a hook that stopped taking effect fails instead of silently testing the interpreter's tile.
fp32, fp16 and bf16 (the kernels use no ``tl.dot``: bf16 is exact in the interpreter), all held to the one tolerance
rule of ``grpo_fast.testing``."""

from __future__ import annotations

import sys

import pytest
import torch
import triton

from grpo_fast import fused_logprobs
from grpo_fast.dispatch import triton_interpreting
from grpo_fast.kernels import linear_logprobs  # noqa: F401 (loads the launchers' modules, whose hooks are patched)
from grpo_fast.kernels.linear_logprobs import CONFIGS
from grpo_fast.kernels.logprob_layout import CHUNK_ALIGN
from grpo_fast.kernels.plan import Plan
from grpo_fast.testing import assert_close_rule, head_inputs, upstream_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1")
H = 39  # odd: no row of hidden, weight or their gradients is a whole number of 16-byte vectors
TEMPERATURE, SOFTCAP = 0.7, 3.3


def _tiles():
    """``(config, table entries)`` for every distinct tile of the table, in a fixed order. Entries that differ only in
    ``num_warps`` are one tile here: the interpreter drops launch options (one numpy program per tile), so a second
    run would compute the same numbers; the first such configuration is the one launched."""
    entries = {}
    for key, cfg in sorted(CONFIGS.items(), key=lambda item: (item[1].num_warps, item[0])):
        entries.setdefault((cfg.block_n, cfg.block_c), []).append((key, cfg))
    return [(found[0][1], [f"{family}/{bucket}/w{cfg.num_warps}" for (family, bucket), cfg in found])
            for _, found in sorted(entries.items())]


TILES = _tiles()
TILE_IDS = [f"{cfg.block_n}x{cfg.block_c}" for cfg, _ in TILES]


def _shape(cfg):
    """``(N, V, chunk)`` for a tile: three row blocks, the last partial (so one SM per two row blocks turns the split
    off); a forward chunk of one tile and 128 columns more (not a multiple of BLOCK_C when BLOCK_C > 128); two such
    chunks and a ragged third narrower than one tile, V odd (a multiple of neither BLOCK_C nor the chunk
    alignment)."""
    n = 2 * cfg.block_n + 5
    chunk = cfg.block_c + CHUNK_ALIGN
    return n, 2 * chunk + 77, chunk


def _scratch_mib(n, chunk, elem, splits):
    """A budget whose forward buffer is ``[n, chunk]``: the buffer's bytes plus room for the per-row statistics
    (target logit, and m, s, t for each column split) but not for another 128 columns."""
    return (n * elem * chunk + n * (4 + 3 * 8 * splits)) / 2**20


def _hook(monkeypatch, name, fn):
    """Replace ``name`` in every loaded module of ``grpo_fast.kernels`` that has it (where it is defined and where a
    launcher imported it); at least one must have it."""
    modules = [m for key, m in list(sys.modules.items())
               if key.startswith("grpo_fast.kernels") and callable(getattr(m, name, None))]
    assert modules, f"no grpo_fast.kernels module has {name}"
    for module in modules:
        monkeypatch.setattr(module, name, fn)


def _record_launches(monkeypatch):
    """Every Triton launch a launcher issues through its plan: ``(name, grid, constexprs)``."""
    launches = []
    real = Plan.kernel

    def kernel(self, name, fn, grid, *args, **kwargs):
        launches.append((name, tuple(grid), {k: v for k, v in kwargs.items() if k.isupper()}))
        return real(self, name, fn, grid, *args, **kwargs)

    monkeypatch.setattr(Plan, "kernel", kernel)
    return launches


def _case(n, v, chunk, cfg, seed):
    """Inputs in float64: targets on the edges (column 0, V - 1, either side of a chunk and of a tile boundary, in
    the last partial row block), rows without any upstream gradient (gathered away) and rows with only one of the two;
    the first row, the last row and the target-edge rows stay active."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, bias, targets = head_inputs((n,), H, v, gen, draw_dtype=torch.float64, bias_scale=0.3)
    edges = [0, v - 1, chunk - 1, chunk, cfg.block_c - 1, cfg.block_c, 2 * chunk, v - 2]
    targets[: len(edges)] = torch.tensor(edges)
    targets[n - 1] = v - 1
    g, ge = upstream_grads(n, gen, dead=[8, 9, n // 2, n - 3], no_logp_grad=[10, n - 2], no_entropy_grad=[11, 12])
    return hidden, weight, bias, targets, g, ge


def _run(impl, dtype, case, return_entropy, frozen_head=False):
    """logps, entropy (or None) and the gradients of ``sum(g logp + ge entropy)`` w.r.t. hidden, weight (None for a
    frozen head) and bias."""
    hidden, weight, bias, targets, g, ge = case
    h, w, b = (x.to(dtype).to(DEVICE).requires_grad_(not (frozen_head and x is weight)) for x in (hidden, weight, bias))
    out = fused_logprobs(h, w, targets.to(DEVICE), bias=b, temperature=TEMPERATURE, softcap=SOFTCAP,
                         return_entropy=return_entropy, impl=impl)
    logps, ent = out if return_entropy else (out, None)
    loss = (logps * g.to(DEVICE, logps.dtype)).sum()
    if return_entropy:
        loss = loss + (ent * ge.to(DEVICE, ent.dtype)).sum()
    loss.backward()
    return [logps, ent, h.grad, w.grad, b.grad]


def _check_tile(monkeypatch, tile, split, return_entropy, dtype, frozen_head=False):
    """Run the Triton path on ``tile`` (column split forced on or off) and hold every output to the reference rule;
    then check on the recorded launches that the kernels ran on that tile, split as asked, over several chunks."""
    n, v, chunk = _shape(tile)
    row_blocks, max_splits = triton.cdiv(n, tile.block_n), triton.cdiv(v, tile.block_c)
    assert n % tile.block_n and v % tile.block_c and v % CHUNK_ALIGN and chunk < v  # the edges this case is for
    sms = 64 * row_blocks if split else 1  # 2 SMs > row blocks: split (as far as the columns allow); else none
    _hook(monkeypatch, "tile_config", lambda device, rows: tile)
    _hook(monkeypatch, "current_sms", lambda device: sms)
    elem = torch.tensor([], dtype=dtype).element_size()
    monkeypatch.setenv("GRPO_FAST_SCRATCH_MIB", str(_scratch_mib(n, chunk, elem, max_splits)))
    case = _case(n, v, chunk, tile, seed=5)
    launches = _record_launches(monkeypatch)
    out = _run("triton", dtype, case, return_entropy, frozen_head)
    monkeypatch.undo()  # the references run without the hooks
    pt = _run("reference", dtype, case, return_entropy, frozen_head)
    ref = _run("reference", torch.float64, case, return_entropy, frozen_head)
    for name, a, b, c in zip(("logps", "entropy", "d hidden", "d weight", "d bias"), out, pt, ref):
        assert_close_rule(a, b, c, dtype, name)
    dead = (case[4] == 0) & ((case[5] == 0) | (not return_entropy))
    assert 0 < int(dead.sum()) and (n - int(dead.sum())) % tile.block_n  # the gathered rows end in a partial block
    assert (out[2][dead.to(DEVICE)] == 0).all()  # rows gathered away: exactly zero

    by_name = {}
    for name, grid, constexprs in launches:
        by_name.setdefault(name, []).append((grid, constexprs))
    assert set(by_name) == {"chunk_stats", "stats_finalize", "chunk_dlogits"}, sorted(by_name)
    for name, runs in by_name.items():
        for _, constexprs in runs:
            assert constexprs["BLOCK_N"] == tile.block_n and constexprs.get("BLOCK_C", tile.block_c) == tile.block_c
    stats = by_name["chunk_stats"]
    assert len(stats) == triton.cdiv(v, chunk)  # the budget gave the chunks this case is shaped for
    assert {grid for grid, _ in stats} == {(row_blocks, max_splits if split else 1)}
    assert len(by_name["chunk_dlogits"]) >= 2  # the backward walks several chunks too


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "logps"])
@pytest.mark.parametrize("split", [False, True], ids=["one-program", "column-split"])
@pytest.mark.parametrize("tile", [cfg for cfg, _ in TILES], ids=TILE_IDS)
def test_shipped_tile_against_the_reference(monkeypatch, tile, split, return_entropy, dtype):
    """One shipped tile: log-probs, entropy and the gradients of hidden, weight and bias (vocabulary chunks outer)
    to the reference rule."""
    _check_tile(monkeypatch, tile, split, return_entropy, dtype)


@pytest.mark.parametrize("tile", [cfg for cfg, _ in TILES], ids=TILE_IDS)
def test_shipped_tile_with_a_frozen_head(monkeypatch, tile):
    """The backward without a weight gradient (row stripes, each over the whole vocabulary) on the same tile."""
    _check_tile(monkeypatch, tile, False, True, torch.float16, frozen_head=True)


def test_every_table_entry_has_a_case():
    """Each (family, N bucket) of the table is covered by the tile of one case: the cases come from the table."""
    covered = {entry for _, entries in TILES for entry in entries}
    assert covered == {f"{family}/{bucket}/w{cfg.num_warps}" for (family, bucket), cfg in CONFIGS.items()}
    assert all(cfg in CONFIGS.values() for cfg, _ in TILES)
