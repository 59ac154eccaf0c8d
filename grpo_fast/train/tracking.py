"""Experiment trackers (``--report-to``): TensorBoard, Weights & Biases and Trackio, each through its own client.

TRL's and transformers' names and meaning (``report_to``, ``run_name``, ``project``). ``metrics.jsonl`` stays the
source of truth: ``metrics.MetricsLog`` is the one place where a row is emitted, and it hands every tracker the row
it has just written (its numbers, non-finite ones as the file's null, which a tracker is not sent), at the row's
step (the x axis); the completions table (``--log-completions-every``) likewise. Only rank 0 reports.

A tracker never stops a run: a client that is not installed, or a service it cannot reach, is one warning line,
and that tracker is dropped for the rest of the run (``metrics.jsonl`` keeps every step).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
from pathlib import Path

logger = logging.getLogger("grpo_fast.train")

TRACKERS = ("tensorboard", "wandb", "trackio")
REPORT_TO = ("none", "all", *TRACKERS)  # what --report-to takes
DEFAULT_PROJECT = "grpo-fast"
TENSORBOARD_DIR = "tensorboard"  # inside output_dir (TENSORBOARD_LOGGING_DIR overrides it, as in transformers)
# the import that tells a client is installed, and the extra that installs it
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(_MODULES[name]) is not None


def resolve_report_to(names: list[str]) -> list[str]:
    """The trackers ``--report-to`` names: ``none`` -> none, ``all`` -> every one whose client is installed (as
    transformers' ``report_to="all"``), otherwise the names as given, once each."""
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [name for name in TRACKERS if installed(name)]
    return list(dict.fromkeys(names))


def check_report_to(names) -> None:
    """``TrainConfig.report_to``'s check: known names; none and all stand alone."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"TrainConfig.report_to must be a list of tracker names ({', '.join(REPORT_TO)}), got "
                         f"{names!r}")
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown:
        raise ValueError(f"TrainConfig.report_to must name {', '.join(REPORT_TO)} (comma-separated), got "
                         f"{','.join(names)} ({', '.join(map(repr, unknown))} unknown)")
    for alone in ("none", "all"):
        if alone in names and len(names) > 1:
            raise ValueError(f"TrainConfig.report_to: {alone} stands alone, got {','.join(names)}")


class Tracker:
    """One tracker: ``log`` a metrics row at its step, ``summary`` of single values (the held-out rewards),
    ``table`` of rows (the completions), ``close``. Subclasses wrap one client."""

    name = ""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def summary(self, values: dict[str, float], step: int) -> None:
        self.log(values, step)

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _run_dir_name(run_name: str | None, out_dir: Path) -> str:
    """The run's subdirectory in a shared TensorBoard directory: ``--run-name``, else the output directory's name;
    path separators and leading dots replaced, so it stays one directory inside the shared one."""
    name = run_name or Path(out_dir).resolve().name or "run"
    return name.replace("/", "_").replace("\\", "_").lstrip(".") or "run"


class TensorBoardTracker(Tracker):
    """Event files in ``output_dir/tensorboard`` (``tensorboard --logdir output_dir``): each metric a classic
    float32 scalar (``simple_value``: the one form every TensorBoard loader charts; TensorBoard 2.21's default fast
    loader shows no double-precision scalar at all; metrics.jsonl keeps the full precision), the config and each
    completions table as text (markdown). A resumed run writes to the same directory from its checkpoint's step on;
    the earlier run's later steps are purged. ``own_dir``: the directory is the run's own (``output_dir/tensorboard``),
    so a new run there (``--overwrite``) removes the earlier run's event files; a shared one
    (``TENSORBOARD_LOGGING_DIR``) gets a subdirectory per run and loses nothing."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, config: dict, run_name: str | None, resumed_step: int, own_dir: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        if own_dir and not resumed_step:  # a new run in this output_dir (--overwrite): the earlier run's events go
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resumed_step + 1 if resumed_step else None)
        self.writer.add_text("config", _markdown_code(json.dumps(config, indent=2)), resumed_step)
        if run_name:
            self.writer.add_text("run_name", run_name, resumed_step)

    def log(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, key, columns, rows, step):
        self.writer.add_text(key, _markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run (``wandb.init``: project, name, the run's config); its x axis is the step (``wandb.log(...,
    step=)``), the held-out rewards go to its summary, completions to a ``wandb.Table``. ``WANDB_MODE=offline``
    writes it locally for a later ``wandb sync``; its files go to ``WANDB_DIR``, else ``output_dir``."""

    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, run_name: str | None, project: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run_name,
                              config=config, dir=os.environ.get("WANDB_DIR") or str(out_dir), reinit="finish_previous")

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def summary(self, values, step):
        for key, value in values.items():
            self.run.summary[key] = value

    def table(self, key, columns, rows, step):
        self.run.log({key: self.wandb.Table(columns=columns, data=[[_cell(v) for v in r] for r in rows])}, step=step)

    def close(self):
        self.run.finish()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@contextlib.contextmanager
def _stdout_to_log(name: str):
    """What a tracker's client prints to stdout (a banner, colour codes and all) goes to the log instead, one INFO
    line each, colours removed: stdout stays the run's own summary line, fit for a script to read."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line := _ANSI.sub("", line).strip():
                logger.info("%s: %s", name, line)


class TrackioTracker(Tracker):
    """A Trackio run (``trackio.init``: project, name, the run's config), stored locally (``TRACKIO_DIR``, else
    Hugging Face's cache; ``trackio show`` opens the dashboard) unless ``TRACKIO_SPACE_ID`` or
    ``TRACKIO_SERVER_URL`` names a remote one; completions as a ``trackio.Table``."""

    name = "trackio"

    def __init__(self, config: dict, run_name: str | None, project: str | None):
        import trackio

        self.trackio = trackio
        with _stdout_to_log("trackio"):  # its banner: the log's, not stdout's (which holds the run's summary)
            self.run = trackio.init(project=project or DEFAULT_PROJECT, name=run_name, config=config, embed=False)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def table(self, key, columns, rows, step):
        self.run.log({key: self.trackio.Table(columns=columns, data=[[_cell(v) for v in r] for r in rows])},
                     step=step)

    def close(self):
        with _stdout_to_log("trackio"):
            if self.trackio.context_vars.current_run.get() is self.run:
                self.trackio.finish()  # and trackio's exit handler has no run left to finish again
            else:
                self.run.finish()


def open_trackers(names: list[str], out_dir: Path, config: dict, run_name: str | None, project: str | None,
                  resumed_step: int = 0) -> list[Tracker]:
    """The trackers of ``names`` (``resolve_report_to``'s), started; one that cannot start (its client missing, its
    service out of reach) is one warning line and left out."""
    trackers = []
    for name in names:
        if not installed(name):
            logger.warning("--report-to %s: not reported, its client is not installed (pip install "
                           "'grpo-fast[%s]'); metrics.jsonl has every step", name, name)
            continue
        try:
            if name == "tensorboard":
                shared = os.environ.get("TENSORBOARD_LOGGING_DIR")
                # a shared directory: one subdirectory per run, named as TensorBoard's run list shows it
                log_dir = Path(shared) / _run_dir_name(run_name, out_dir) if shared else out_dir / TENSORBOARD_DIR
                trackers.append(TensorBoardTracker(log_dir, config, run_name, resumed_step, own_dir=not shared))
            elif name == "wandb":
                trackers.append(WandbTracker(out_dir, config, run_name, project))
            else:
                trackers.append(TrackioTracker(config, run_name, project))
        except Exception as e:  # noqa: BLE001: a tracker never stops a run
            _warn(name, "could not start", e)
    return trackers


class Trackers:
    """The run's trackers as one sink: each call reaches every tracker still up; one that raises is one warning
    line and is dropped (the others and the run go on)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001
                self.trackers.remove(tracker)
                _warn(tracker.name, "stopped reporting", e)
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001: already reported once
                    pass

    def log(self, record: dict, step: int) -> None:
        """A metrics row as ``metrics.jsonl`` holds it: its numbers but ``step`` (the x axis), nulls left out."""
        numbers = {k: v for k, v in record.items() if k not in ("event", "step") and _number(v)}
        if numbers:
            self._each("log", numbers, step)

    def summary(self, values: dict, step: int) -> None:
        numbers = {k: v for k, v in values.items() if _number(v)}
        if numbers:
            self._each("summary", numbers, step)

    def table(self, key: str, columns: list[str], rows: list[list], step: int) -> None:
        self._each("table", key, columns, rows, step)

    def close(self) -> None:
        self._each("close")
        self.trackers = []


def _warn(name: str, what: str, error: BaseException) -> None:
    reason = (str(error).strip().splitlines() or [""])[0][:300]
    logger.warning("--report-to %s: %s (%s: %s); metrics.jsonl has every step, the run goes on", name, what,
                   type(error).__name__, reason)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _cell(value):
    """A table cell: text, a number, or None; a chat-message list as its JSON."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, ensure_ascii=False)


def _markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())  # an indented code block: shown verbatim


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        value = _cell(value)
        if isinstance(value, float):
            return f"{value:.4g}"
        text = "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])
