"""What a run shows while it trains: its progress (a bar on a terminal, plain lines in a log file) and the
completions ``--log-completions-every`` logs (a table for ``completions.jsonl`` and the trackers, a few lines in the
log)."""

from __future__ import annotations

import logging
import math
import sys
import time

logger = logging.getLogger("grpo_fast.train")

# the progress line's and the bar's fields: (metric, label)
PROGRESS_FIELDS = (("reward", "reward"), ("kl", "kl"), ("loss", "loss"))
_BAR_FIELDS = (("reward", "reward"), ("kl", "kl"), ("entropy", "ent"), ("clip_ratio_region", "clip"))


def progress(config, initial: int, enabled: bool = True, stream=None):
    """A tqdm bar when ``stream`` (stderr) is a terminal; otherwise :class:`ProgressLines`, since tqdm writes its
    updates to a file as one line of carriage returns. Off with ``--progress false`` or ``enabled=False``."""
    stream = sys.stderr if stream is None else stream
    on = config.progress and enabled
    if on and not _is_terminal(stream):
        return ProgressLines(config.steps, initial, config.log_every)
    from tqdm.auto import tqdm

    return _Bar(tqdm(total=config.steps, initial=initial, disable=not on, desc="grpo-fast", unit="step",
                     dynamic_ncols=True, file=stream))


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stream-less object
        return False


class _Bar:
    def __init__(self, bar):
        self.bar = bar

    def update(self, metrics: dict) -> None:
        self.bar.set_postfix({short: f"{metrics[k]:.3f}" for k, short in _BAR_FIELDS
                              if isinstance(metrics.get(k), (int, float))}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """One log line every ``every`` steps and at the last: ``step 40/800 (5%) | reward 0.312 | kl 0.0021 | loss
    0.0134 | 0.21 s/step | ETA 2m40s``. The step time is the mean over this process's steps so far (checkpoints
    included), the ETA the steps left at that pace."""

    def __init__(self, total: int, initial: int, every: int):
        self.total, self.step, self.every = total, initial, every
        self.first, self.started = initial, time.perf_counter()

    def update(self, metrics: dict) -> None:
        self.step += 1
        if self.step % self.every and self.step != self.total:
            return
        logger.info("%s", self.line(metrics, time.perf_counter() - self.started))

    def line(self, metrics: dict, elapsed: float) -> str:
        per_step = elapsed / max(self.step - self.first, 1)
        parts = [f"step {self.step}/{self.total} ({100 * self.step / self.total:.0f}%)"]
        for key, label in PROGRESS_FIELDS:
            value = metrics.get(key)
            if key == "kl" and value is None and "loss" in metrics:
                continue  # no reference model (beta = 0): no KL at all
            parts.append(f"{label} {_number(value)}")
        parts += [f"{per_step:.3g} s/step", f"ETA {duration(per_step * (self.total - self.step))}"]
        return " | ".join(parts)

    def close(self) -> None:
        pass


def _number(value) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    return f"{value:.4g}" if abs(value) < 1e-3 and value else f"{value:.4f}".rstrip("0").rstrip(".") or "0"


def duration(seconds: float) -> str:
    """``2h05m``, ``3m07s``, ``42s``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


# ---------------------------------------------------------------------------------------------- completions


def completion_table(sample, reward_names: list[str]) -> tuple[list[str], list[list]]:
    """``(columns, rows)`` of a step's ``trainer.Sample``, TRL's completions table: prompt, completion, one column
    per reward function (named after it; None: unscored), the weighted total ``reward``, the ``advantage``."""
    fixed = ("step", "prompt", "completion", "reward", "advantage")
    names = [f"rewards/{n}" if n in fixed else n for n in reward_names]  # a function named like a fixed column
    columns = ["prompt", "completion", *names, "reward", "advantage"]
    scores = sample.rewards.tolist()
    rows = []
    for i, (prompt, completion) in enumerate(zip(sample.prompts, sample.completions)):
        per_function = [None if math.isnan(x) else x for x in scores[i]]
        rows.append([prompt, completion, *per_function, float(sample.total[i]), float(sample.advantages[i])])
    return columns, rows


def log_completions(step: int, columns: list[str], rows: list[list], shown: int | None) -> None:
    """The first ``shown`` rows (None: all) in the log, one line each, long texts cut."""
    count = len(rows) if shown is None else min(shown, len(rows))
    if not count:
        return
    logger.info("step %d: %d of the step's %d completions (all in completions.jsonl)", step, count, len(rows))
    for row in rows[:count]:
        values = dict(zip(columns, row))
        scores = ", ".join(f"{name} {_number(values[name])}" for name in columns[2:-2])
        logger.info("  %s -> %s | %s | reward %s | advantage %s", _short(values["prompt"]),
                    _short(values["completion"]), scores, _number(values["reward"]), _number(values["advantage"]))


def _short(value, limit: int = 120) -> str:
    if not isinstance(value, str):  # chat messages: the last one's content
        value = value[-1].get("content", "") if isinstance(value, list) and value and isinstance(value[-1], dict) \
            else str(value)
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"
