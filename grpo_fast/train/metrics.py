"""Metrics as JSON lines (``{"event": "start" | "step" | "end", ...}``) and the reward/KL plot."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    """JSON has no NaN: non-finite floats are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_records(path: Path) -> list[dict]:
    """Every complete line of a metrics file (a last line cut short by a crash or a full disk is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """Appends one JSON object per line, flushed at once so nothing is lost when a run stops.

    On resume (``truncate_after = N > 0``) the lines of steps after ``N`` and the old end line are dropped, so the
    file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, truncate_after: int = 0):
        self.path = Path(path)
        self.header: dict = {}
        records = read_records(self.path) if truncate_after and self.path.exists() else []
        kept = []
        for record in records:
            if record.get("event") == "start":
                self.header = record
            if record.get("event") == "end" or (record.get("event") == "step" and record["step"] > truncate_after):
                continue
            kept.append(record)
        self.path.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def _append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def write_header(self, fields: dict) -> None:
        self.header = {"event": "start", **fields}
        self._append(self.header)

    def write(self, metrics: dict) -> None:
        self._append({"event": "step", **metrics})

    def write_footer(self, fields: dict) -> None:
        self._append({"event": "end", **fields})


def read_steps(path: Path) -> list[dict]:
    return [r for r in read_records(path) if r.get("event") == "step"]


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Reward (mean and per function) and KL (when the run had a reference model) against the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_records(metrics_path)
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        return None
    start = next((r for r in records if r.get("event") == "start"), {})
    end = next((r for r in records if r.get("event") == "end"), {})
    x = [s["step"] for s in steps]
    has_kl = any(s.get("kl") is not None for s in steps)
    fig, axes = plt.subplots(1, 2 if has_kl else 1, figsize=(10 if has_kl else 6, 3.6), squeeze=False)
    ax = axes[0][0]
    ax.plot(x, [s["reward"] for s in steps], lw=0.8, alpha=0.4, label="reward (step mean)")
    ax.plot(x, smooth([s["reward"] for s in steps]), lw=2, label="reward (moving average)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    before, after = start.get("eval_before"), end.get("eval_after")
    if before is not None and after is not None:
        ax.set_title(f"held-out reward (greedy): {before:.3f} before, {after:.3f} after", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    if has_kl:
        ax = axes[0][1]
        ax.plot(x, [s.get("kl") for s in steps], color="tab:red")
        ax.set_xlabel("step")
        ax.set_ylabel("KL to reference")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
