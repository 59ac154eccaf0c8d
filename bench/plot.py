"""Bar charts from a benchmark CSV: median time and peak extra memory per implementation, grouped by shape.

    python -m bench.plot bench/results/loss_cpu.csv        # writes bench/results/loss_cpu.png

Plots are made from the CSV only (never from a live run), so any stored result can be redrawn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/plot.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import read_csv

IMPL_LABELS = {"torch": "grpo-fast (torch)", "triton": "grpo-fast (triton)", "reference": "reference (logits)",
               "liger": "Liger-Kernel"}
IMPL_COLORS = {"triton": "#1b7837", "torch": "#5aae61", "reference": "#999999", "liger": "#2166ac"}


def _shape_label(row: dict) -> str:
    head = row.get("model") or f"H={row['H']}"
    return f"{head}\nV={int(row['V']):,}"


def plot_csv(csv_path, out_path=None) -> Path:
    """Write a PNG (default: the CSV's path with ``.png``) with one time panel and one memory panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path = Path(csv_path)
    out_path = Path(out_path) if out_path else csv_path.with_suffix(".png")
    rows = read_csv(csv_path)
    if not rows:
        raise ValueError(f"{csv_path}: no rows")
    shapes = list(dict.fromkeys(_shape_label(r) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(_shape_label(r), r["impl"]): r for r in rows}

    fig, axes = plt.subplots(1, 2, figsize=(max(8, 3.2 * len(shapes) + 4), 4.8))
    width = 0.8 / len(impls)
    panels = [("median_ms", "median time per fwd+bwd step (ms)"), ("peak_extra_mib", "peak extra memory (MiB)")]
    for ax, (col, title) in zip(axes, panels):
        for j, impl in enumerate(impls):
            xs, ys, errs = [], [], []
            for i, s in enumerate(shapes):
                r = cell.get((s, impl))
                if r is None:
                    continue
                x = i + (j - (len(impls) - 1) / 2) * width
                if r.get(col):
                    xs.append(x)
                    ys.append(float(r[col]))
                else:
                    errs.append(x)
            bars = ax.bar(xs, ys, width, label=IMPL_LABELS.get(impl, impl), color=IMPL_COLORS.get(impl))
            ax.bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
            for x in errs:  # a failed configuration (e.g. out of memory) is shown, not silently dropped
                ax.text(x, 0, "error", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_xlim(-0.5, len(shapes) - 0.5)
        values = [float(r[col]) for r in rows if r.get(col) and float(r[col]) > 0]
        if values and max(values) / min(values) > 30:  # logits-sized bars would flatten the others
            ax.set_yscale("log")
            title += ", log scale"
        else:
            ax.margins(y=0.15)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    r0 = rows[0]
    dims = f"N={r0.get('N')}, {r0.get('dtype')}, {r0.get('loss_type', '')} beta={r0.get('beta', '')}"
    fig.suptitle(f"{r0.get('benchmark', '')}: {dims}\n{r0.get('device', '')}, torch {r0.get('torch', '')}, "
                 f"commit {r0.get('commit', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path, help="a CSV written by a bench/ benchmark")
    p.add_argument("-o", "--out", type=Path, default=None, help="PNG path (default: next to the CSV, .png)")
    args = p.parse_args(argv)
    print(plot_csv(args.csv, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
