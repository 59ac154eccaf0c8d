"""One benchmark, two versions of the code, side by side in one run: ``python -m bench.compare_checkouts``.

Runs a ``bench`` module (default ``bench.bench_loss``) with the same arguments in a git worktree of a base commit and
in this checkout, alternating base / this for ``--rounds`` rounds so that the machine's load drifts over both
equally, and writes every row of every round to one CSV with ``checkout`` (base or this) and ``round`` columns (the
rows keep their own ``commit``, ``src_sha`` and ``command`` columns, which say which code ran). Then it prints, per
configuration, the median of each side's ``median_ms`` over the rounds and their ratio.

Example (the check a rework of the GPU path must pass: the torch path's CPU time stays within 10% of the code before
it, docs/design.md §7)::

    python -m bench.compare_checkouts --base 051fc01 --csv bench/results/torch_path_vs_051fc01.csv -- \\
        --impls torch --vocab 32768 151936 --no-check

Both sides run with this checkout's Python environment; the base worktree comes first on ``PYTHONPATH`` so its
``grpo_fast`` is the one imported (its ``grpo_fast.kernels`` is not: do not compare Triton rows this way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness


def _run(root: Path, module: str, args: list[str], csv_path: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", module, *args, "--csv", str(csv_path)]
    subprocess.run(cmd, cwd=root, env=env, check=True)
    return harness.read_csv(csv_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_checkouts", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Arguments after -- go to the benchmark module unchanged.")
    p.add_argument("--base", required=True, help="the base commit (any git revision)")
    p.add_argument("--module", default="bench.bench_loss", help="benchmark module (default bench.bench_loss)")
    p.add_argument("--rounds", type=int, default=3, help="base/this alternations (default 3)")
    p.add_argument("--csv", type=Path, required=True, help="where to write every row of every round")
    p.add_argument("--key", nargs="+", default=["impl", "N", "H", "V", "dtype"],
                   help="columns that name a configuration (default: impl N H V dtype)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the benchmark's own arguments")
    ns = p.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    this = harness.REPO_ROOT
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="grpo_fast_base_") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), ns.base], cwd=this, check=True,
                       capture_output=True)
        try:
            for r in range(ns.rounds):
                for side, root in (("base", base), ("this", this)):
                    for row in _run(root, ns.module, args, Path(tmp) / f"{side}{r}.csv"):
                        rows.append({"checkout": side, "round": r, **row})
                    harness.write_csv(ns.csv, rows)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=this, check=False)
    configs = sorted({tuple(row.get(k, "") for k in ns.key) for row in rows})
    print(f"\n{'configuration':<50}{'base ms':>10}{'this ms':>10}{'this/base':>11}")
    for cfg in configs:
        med = {}
        for side in ("base", "this"):
            times = [float(r["median_ms"]) for r in rows if r["checkout"] == side
                     and tuple(r.get(k, "") for k in ns.key) == cfg and r.get("median_ms")]
            med[side] = statistics.median(times) if times else float("nan")
        print(f"{' '.join(map(str, cfg)):<50}{med['base']:>10.1f}{med['this']:>10.1f}{med['this'] / med['base']:>11.3f}")
    print(f"rows: {ns.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
