"""Metrics as JSON lines (``{"event": "start" | "step" | "end", ...}``), the completions file and the reward/KL plot.

:class:`MetricsLog` is the one place a run's rows are emitted: each goes to ``metrics.jsonl`` (or
``completions.jsonl``) and then, as written, to the run's trackers (``grpo_fast.train.tracking``)."""

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


COMPLETIONS_FILE = "completions.jsonl"  # next to metrics.jsonl: one line per logged completion


class MetricsLog:
    """Appends one JSON object per line, flushed at once so nothing is lost when a run stops, and hands each row, as
    written, to ``trackers`` (a ``tracking.Trackers``; None: none).

    On resume (``truncate_after = N > 0``) the lines of steps after ``N`` and the old end line are dropped, so the
    file reads as one uninterrupted run; ``completions.jsonl`` alongside likewise (a new run starts it empty).
    """

    def __init__(self, path: Path, truncate_after: int = 0, trackers=None):
        self.path = Path(path)
        self.completions_path = self.path.parent / COMPLETIONS_FILE
        self.trackers = trackers
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
        if self.completions_path.exists():  # only rows of the steps kept
            rows = read_records(self.completions_path) if truncate_after else []
            self.completions_path.write_text("".join(json.dumps(r) + "\n" for r in rows
                                                     if r.get("step", math.inf) <= truncate_after))

    def _append(self, record: dict, path: Path | None = None) -> dict:
        record = {k: _clean(v) for k, v in record.items()}
        with (path or self.path).open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    def write_header(self, fields: dict) -> None:
        self.header = self._append({"event": "start", **fields})
        if self.trackers:
            self.trackers.summary({"eval_before": self.header.get("eval_before")}, 0)

    def write(self, metrics: dict) -> None:
        record = self._append({"event": "step", **metrics})
        if self.trackers:
            self.trackers.log(record, record["step"])

    def write_completions(self, step: int, columns: list[str], rows: list[list]) -> None:
        """One line per completion (``{"step": step, column: value, ...}``) in ``completions.jsonl``, and the same
        rows as one table (``completions``) to the trackers."""
        rows = [[_clean(v) for v in row] for row in rows]
        with self.completions_path.open("a") as f:
            f.write("".join(json.dumps({"step": step, **dict(zip(columns, row))}, ensure_ascii=False) + "\n"
                            for row in rows))
        if self.trackers:
            self.trackers.table("completions", ["step", *columns], [[step, *row] for row in rows], step)

    def write_footer(self, fields: dict, step: int | None = None) -> None:
        record = self._append({"event": "end", **fields})
        if self.trackers and step is not None:
            self.trackers.summary({k: v for k, v in record.items() if k != "event"}, step)

    def close(self) -> None:
        """Ends the trackers' runs (the files need no closing)."""
        if self.trackers:
            self.trackers.close()


def read_steps(path: Path) -> list[dict]:
    return [r for r in read_records(path) if r.get("event") == "step"]


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Reward and KL (when the run had a reference model) against the step, each raw and as a moving average, the run
    (model, data, rewards) in the title. Redrawn at every checkpoint and at the end: the file is replaced whole."""
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
    else:  # a checkpoint's plot: the run is not over
        held_out = f"; held-out {before:.3f} before training" if before is not None else ""
        ax.set_title(f"training reward, to step {x[-1]}{held_out}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    if has_kl:
        ax = axes[0][1]
        kl = [s.get("kl") for s in steps]
        known = [(i, v) for i, v in zip(x, kl) if v is not None]  # a skipped update has no KL
        ax.plot(x, [math.nan if v is None else v for v in kl], color="tab:red", lw=0.8, alpha=0.4,
                label="KL (step mean)")
        ax.plot([i for i, _ in known], smooth([v for _, v in known]), color="tab:red", lw=2,
                label="KL (moving average)")
        ax.set_title("KL to the reference model", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("KL")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    title = run_title(start.get("config") or {})
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    partial = Path(png_path).with_name(f".{Path(png_path).name}.tmp")  # a viewer never sees half a file
    fig.savefig(partial, dpi=120, format=Path(png_path).suffix.lstrip(".") or "png")
    plt.close(fig)
    partial.replace(png_path)
    return Path(png_path)


def run_title(config: dict) -> str:
    """The run in one line, from its saved config: model, dataset (or task), rewards, and the name when it has one."""
    if not config:
        return ""
    rewards = config.get("rewards") or []
    weights = config.get("reward_weights") or []
    named = [f"{r} x {w:g}" for r, w in zip(rewards, weights)] if weights else list(rewards)
    if config.get("environment"):
        named.append(f"{config['environment']}.get_reward")
    parts = [f"model {config.get('model')}", f"data {config.get('dataset')}",
             f"rewards {', '.join(map(str, named)) or 'none'}"]
    if config.get("run_name"):
        parts.insert(0, str(config["run_name"]))
    return "; ".join(parts)


def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
