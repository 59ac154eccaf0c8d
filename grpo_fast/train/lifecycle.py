"""A training run from start to finish, around the steps of ``grpo_fast.train.trainer``.

:func:`prepare` makes every check that can fail on the user's input (model, data, rewards, output directory,
checkpoint) before anything is written; :func:`fit` runs the steps in one loop, saves checkpoints, stops cleanly on
Ctrl-C, evaluates and writes the trained model; :func:`train` is both. A run's checkpoints (:func:`save_checkpoint`,
:func:`load_checkpoint`) are ``grpo_fast.train.checkpoint``'s atomic files that cannot run code.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train import distributed as dist_
from grpo_fast.train.config import TrainConfig, config_changes
from grpo_fast.train.evaluation import evaluate
from grpo_fast.train.export import MODEL_DIR, base_model_path, full_state_dict, save_model
from grpo_fast.train.metrics import MetricsLog, plot_metrics, read_records, read_steps
from grpo_fast.train.reporting import completion_table, log_completions, progress
from grpo_fast.train.rewards import reward_name
from grpo_fast.train.tracking import Trackers, open_trackers, resolve_report_to
from grpo_fast.train.model import load_trained_state, trained_state
from grpo_fast.train.rewards import RewardError
from grpo_fast.train.engines import engine_of
from grpo_fast.train.trainer import Run, setup, train_step

logger = logging.getLogger("grpo_fast.train")


@dataclass
class Summary:
    steps: int
    eval_before: float | None
    eval_after: float | None
    skipped_updates: int
    output_dir: Path
    seconds: float
    held_out_prompts: int = 1  # 0: the run had no held-out set (a file dataset without --eval-dataset)

    def line(self) -> str:
        def fmt(x):
            return "n/a" if x is None else f"{x:.3f}"

        if not self.held_out_prompts:
            unscored = " (no held-out set: a file dataset is evaluated with --eval-dataset FILE)"
        elif None in (self.eval_before, self.eval_after):
            unscored = " (n/a: no held-out prompt was scored)"
        else:
            unscored = ""
        return (f"grpo-fast: {self.steps} steps in {self.seconds:.0f} s; held-out reward {fmt(self.eval_before)} -> "
                f"{fmt(self.eval_after)}{unscored}; {self.skipped_updates} skipped updates; outputs in "
                f"{self.output_dir}")


@dataclass
class Prepared:
    """A run ready to train: set up, resumed if asked, its before-evaluation done and logged."""

    run: Run
    log: MetricsLog
    eval_before: float | None
    out_dir: Path
    started: float


def train(config: TrainConfig) -> Summary:
    """Runs ``config.steps`` GRPO steps; returns the before/after evaluation. Metrics go to
    ``output_dir/metrics.jsonl``, checkpoints to ``output_dir/checkpoints``, the trained model to
    ``output_dir/model`` (``save_pretrained``)."""
    return fit(prepare(config))


def prepare(config: TrainConfig) -> Prepared:
    """Everything that can fail on the user's input (model, data, rewards, output directory, checkpoint), before
    the first step. Nothing is written before all of it has passed (the before-evaluation included), so a failed
    start leaves nothing that blocks the corrected rerun."""
    started = time.perf_counter()
    out_dir = Path(config.output_dir)
    ckpt_dir = out_dir / "checkpoints"
    _check_output_dir(config, out_dir, ckpt_dir)
    run = setup(config)
    main = run.world.is_main  # only rank 0 writes the metrics, the config and single-file checkpoints
    resumed = config.resume and load_checkpoint(run, ckpt_dir)
    if resumed:
        _check_complete(run, out_dir)
    engine = engine_of(run)  # built now, from the resumed weights when resuming; logs which engine runs
    eval_before = None if resumed else evaluate(run)
    resolved = config.to_dict()
    log = None
    if main:
        if config.overwrite and not config.resume:
            for _, path in ckpt.list_checkpoints(ckpt_dir):
                ckpt.remove(path)
        out_dir.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no empty directory behind
        (out_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        trackers = Trackers(open_trackers(resolve_report_to(config.report_to), out_dir, resolved, config.run_name,
                                          config.project, resumed_step=run.step if resumed else 0))
        log = MetricsLog(out_dir / "metrics.jsonl", truncate_after=run.step if resumed else 0, trackers=trackers)
        if resumed:
            eval_before = log.header.get("eval_before")
        else:
            log.write_header({"eval_before": eval_before, "config": resolved, "rollout": engine.name})
    dist_.barrier(run.world)
    return Prepared(run, log, eval_before, out_dir, started)


def fit(prepared: Prepared) -> Summary:
    """The loop: steps up to ``config.steps``, checkpoints, the after-evaluation and the plot.

    Ctrl-C, or a stop signal a scheduler sends (SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGXCPU), finishes the step in
    progress, saves a checkpoint and raises :class:`TrainingInterrupted` (a KeyboardInterrupt); a second one abandons
    the step without saving it. The trackers' runs end with it, however it ends."""
    try:
        return _fit(prepared)
    finally:
        if prepared.log is not None:
            prepared.log.close()


def _fit(prepared: Prepared) -> Summary:
    run, log, config = prepared.run, prepared.log, prepared.run.config
    ckpt_dir = prepared.out_dir / "checkpoints"
    main = run.world.is_main
    bar = progress(config, run.step, enabled=main)
    stop = _StopOnInterrupt(same_press_s=5.0 if run.world.distributed else 0.0)
    try:
        with stop:
            while run.step < config.steps:
                before_step = run.sampler.state_dict(), ckpt.rng_state()  # what a failed step's checkpoint restores
                metrics = train_step(run)
                if main and (run.step % config.log_every == 0 or run.step == config.steps):
                    log.write(metrics)
                if main and run.sample is not None:
                    _write_completions(run, log)
                bar.update(metrics)
                if run.step < config.steps and stop.requested(run):
                    path = save_checkpoint(run, ckpt_dir)
                    raise TrainingInterrupted(f"stopped by {stop.by} after step {run.step} of {config.steps}, saved "
                                              f"in {path}", run.step, path, clean=True)
                if config.save_every and run.step % config.save_every == 0 and run.step < config.steps:
                    save_checkpoint(run, ckpt_dir)
                    if main and config.plot:  # the curves so far, at every checkpoint
                        plot_metrics(prepared.out_dir / "metrics.jsonl", prepared.out_dir / "reward_kl.png")
            path = save_checkpoint(run, ckpt_dir)
            if stop.requested(run):  # a stop in the last step: the run is saved whole, the evaluation not run
                raise TrainingInterrupted(f"stopped by {stop.by} after the last step ({run.step}), saved in {path}; "
                                          "the after-evaluation was not run", run.step, path, clean=True)
    except TrainingInterrupted:
        raise
    except RewardError as e:  # before the step's update: the model and optimizer are those of the last step
        e.when = f"at step {run.step + 1}"
        e.checkpoint = _save_before_failed_step(run, ckpt_dir, *before_step)
        raise
    except KeyboardInterrupt:
        found = ckpt.list_checkpoints(ckpt_dir)  # (a save cut short left only a temporary, removed on resume)
        newest = found[-1][1] if found else None
        raise TrainingInterrupted(
            f"stopped at once by a second {stop.by} after {run.step} of {config.steps} steps; "
            + (f"the newest checkpoint is {newest} (step {found[-1][0]}), later steps are lost" if newest
               else "no checkpoint was saved"),
            run.step, newest, clean=False) from None
    finally:
        bar.close()
        if run.engine is not None and not run.world.distributed:  # the evaluation decodes with the policy itself
            run.engine.close()
            run.engine = None
    try:
        eval_after = evaluate(run)
    except KeyboardInterrupt:
        raise TrainingInterrupted(f"stopped by Ctrl-C in the after-evaluation; all {run.step} steps are saved in "
                                  f"{path}", run.step, path, clean=False) from None
    except RewardError as e:
        e.when, e.checkpoint = "in the evaluation after training", path
        raise
    try:
        save_trained_model(run, prepared.out_dir / MODEL_DIR)
    except ckpt.DiskFull as e:
        raise ckpt.DiskFull(f"{e}; the trained run is saved in {path} (step {run.step}): free some space, then write "
                            f"the model with: grpo-fast export {path} {prepared.out_dir / MODEL_DIR}") from None
    if main:
        log.write_footer({"eval_after": eval_after}, step=run.step)
        if config.plot:
            plot_metrics(prepared.out_dir / "metrics.jsonl", prepared.out_dir / "reward_kl.png")
    if run.engine is not None:  # distributed: vLLM's shutdown takes the process group with it, so only now
        run.engine.close()
        run.engine = None
    if run.agent is not None:
        run.agent.close()
    return Summary(run.step, prepared.eval_before, eval_after, run.skipped_updates, prepared.out_dir,
                   time.perf_counter() - prepared.started, len(run.eval_records))


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`fit`. ``clean``: every rank finished its step and ``checkpoint`` holds it; otherwise the
    step in progress was abandoned and ``checkpoint`` is the newest one saved before it (None: none was)."""

    def __init__(self, message: str, step: int, checkpoint: Path | None, clean: bool):
        super().__init__(message)
        self.step, self.checkpoint, self.clean = step, checkpoint, clean


# what a terminal (SIGINT), a scheduler's stop or pre-emption (SIGTERM: Slurm, Kubernetes, SGE; SIGUSR1/SIGUSR2:
# Slurm's --signal; SIGXCPU: a CPU-time limit) or a closed session (SIGHUP) sends: each is handled like Ctrl-C
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")
                     if hasattr(signal, name))


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class _StopOnInterrupt:
    """While active, the first stop signal (Ctrl-C, or one of :data:`STOP_SIGNALS` a scheduler sends) only asks the
    loop to stop after the step in progress (which then saves a checkpoint); a second one raises KeyboardInterrupt at
    once. A signal within ``same_press_s`` of the first counts as the same stop: under torchrun every worker gets the
    terminal's SIGINT and then torchrun's own copy of it. Outside the main thread, where Python cannot take signals,
    it does nothing. ``by``: what asked ("Ctrl-C", "SIGTERM", ...)."""

    def __init__(self, same_press_s: float = 0.0):
        self.asked = False
        self.by = "Ctrl-C"
        self.same_press_s = same_press_s
        self._first = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum, frame):
        if self.asked:
            if time.monotonic() - self._first < self.same_press_s:
                return
            self.by = _signal_name(signum)
            raise KeyboardInterrupt
        self.asked, self._first, self.by = True, time.monotonic(), _signal_name(signum)
        logger.warning("%s: stopping after this step, with a checkpoint (%s again: stop now, losing the step)",
                       self.by, "Ctrl-C" if signum == signal.SIGINT else "any stop signal")

    def requested(self, run: Run) -> bool:
        """Whether any rank was asked to stop (every rank then stops at the same step)."""
        if not run.world.distributed:
            return self.asked
        return not dist_.all_true(not self.asked, run.world, run.device)


def save_trained_model(run: Run, directory: Path) -> None:
    """The trained model as a ``save_pretrained`` directory (grpo_fast/train/export.py), written by rank 0; under
    FSDP2 every rank first joins the gathering of the full state dict. With ``merge_lora`` the adapters are merged
    into the model in place: call it last."""
    state = full_state_dict(run.model, run.world)
    if run.world.is_main:
        save_model(run.model, run.tokenizer, directory, merge_lora=run.config.merge_lora, state_dict=state,
                   base_model=base_model_path(run.config), max_new_tokens=run.config.max_new_tokens)
        logger.info("trained model written to %s", directory)
    dist_.barrier(run.world)


def _check_output_dir(config: TrainConfig, out_dir: Path, ckpt_dir: Path) -> None:
    """The output directory takes files (it is not created: :func:`prepare` does that once every check has passed);
    a new run never silently overwrites an earlier run's metrics and checkpoints, and ``--resume`` needs a
    checkpoint to resume (as TRL's ``resume_from_checkpoint=True``). An earlier start that failed before its first
    step is no run."""
    for path in (out_dir, ckpt_dir):
        if path.exists() and not path.is_dir():
            raise ValueError(f"TrainConfig.output_dir: {path} is a file, expected a directory")
    ckpt.check_writable(out_dir, "TrainConfig.output_dir")
    metrics = out_dir / "metrics.jsonl"
    found = ckpt.list_checkpoints(ckpt_dir)
    earlier = found or (metrics.exists() and read_steps(metrics))
    if config.resume and not found:
        where = f"{out_dir} does not exist" if not out_dir.exists() else f"no checkpoint in {ckpt_dir}"
        instead = ("start over in it with --overwrite instead" if earlier
                   else "start the run without --resume")
        raise ValueError(f"--resume: nothing to resume ({where}); {instead}")
    if earlier and not (config.resume or config.overwrite):
        raise FileExistsError(
            f"TrainConfig.output_dir: {out_dir} already holds a run (metrics.jsonl or checkpoints); pass --resume to "
            "continue it, --overwrite to start over in it, or choose another --output-dir"
        )


class RunComplete(Exception):
    """``--resume`` of a run that has done all its steps and its after-evaluation: nothing to do (a scheduler that
    reruns a job until it is done gets a clean exit, and the run's model/ and metrics stay as they are). ``world``:
    the process group to leave."""

    def __init__(self, message: str, world):
        super().__init__(message)
        self.world = world


def _check_complete(run: Run, out_dir: Path) -> None:
    """Raises :class:`RunComplete` when the resumed checkpoint is the run's last step and metrics.jsonl ends with
    the after-evaluation (a stop in the last step saves the step but not the evaluation: that resume evaluates)."""
    metrics = out_dir / "metrics.jsonl"
    if run.step != run.config.steps or not metrics.exists():
        return
    records = read_records(metrics)
    steps = [r["step"] for r in records if r.get("event") == "step"]
    if records and records[-1].get("event") == "end" and steps and steps[-1] == run.step:
        after = records[-1].get("eval_after")
        if run.agent is not None:
            run.agent.close()
        raise RunComplete(f"the run in {out_dir} is complete ({run.step} of {run.step} steps, evaluated: held-out "
                          f"reward {'n/a' if after is None else f'{after:.3f}'}); nothing was run or changed; "
                          f"--resume with --steps above {run.step} continues it", run.world)


def _write_completions(run: Run, log: MetricsLog) -> None:
    """The step's completions (``run.sample``) to completions.jsonl and the trackers; the first few to the log."""
    columns, rows = completion_table(run.sample, [reward_name(f) for f in run.reward_funcs])
    log.write_completions(run.step, columns, rows)
    log_completions(run.step, columns, rows, run.config.num_completions_to_print)
    run.sample = None


# ------------------------------------------------------------------------------------------------ checkpoints


def save_checkpoint(run: Run, directory: Path) -> Path:
    """Model, optimizer, schedule, sampler position, RNG states and step; a directory of shards under FSDP2, one
    file otherwise (written by rank 0: DDP replicas are identical, which this checks first)."""
    world = run.world
    trainer_state = {
        "step": run.step,
        "skipped_updates": run.skipped_updates,
        "scheduler": run.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "rng": ckpt.rng_state(),
        "config": run.config.to_dict(),
    }
    sharded = world.strategy == "fsdp2"
    path = ckpt.checkpoint_path(directory, run.step, sharded=sharded)
    try:
        if sharded:
            ckpt.save_sharded(run.model, run.optimizer, trainer_state, path, world.is_main,
                              lambda: dist_.barrier(world))
        else:
            dist_.check_replicas(run.model, world)
            if world.is_main:
                ckpt.save_atomic({**trainer_state, "model": trained_state(run.model, run.config),
                                  "optimizer": run.optimizer.state_dict()}, path)
    except ckpt.DiskFull as e:  # the run stops here: what is kept, and how to go on
        found = ckpt.list_checkpoints(directory)  # (path among them only if it was there before: untouched)
        kept = (f"the newest checkpoint, {found[-1][1]} (step {found[-1][0]}), is intact: free some space, then "
                "continue with --resume" if found else "no checkpoint was saved before it: free some space, then "
                "start again with --overwrite")
        raise ckpt.DiskFull(f"{e}; {kept}") from None
    if world.is_main:
        ckpt.prune(directory, run.config.keep_checkpoints)
    dist_.barrier(world)
    return path


def _save_before_failed_step(run: Run, ckpt_dir: Path, sampler_state: dict, rng_state: dict) -> Path | None:
    """The checkpoint ``--resume`` continues from after a step that failed before its update: the last completed
    step, with the sampler and RNG states from before the failed step (saved now unless a checkpoint of that step
    exists; None before any step). Under torchrun the other ranks may not have failed: nothing is saved, the newest
    checkpoint is named."""
    found = ckpt.list_checkpoints(ckpt_dir)
    if run.world.distributed or run.step == 0 or (found and found[-1][0] == run.step):
        return found[-1][1] if found else None
    run.sampler.load_state_dict(sampler_state)
    ckpt.set_rng_state(rng_state)
    return save_checkpoint(run, ckpt_dir)


# options a resumed run may change; any other difference from the checkpoint's config is refused
RESUMABLE_CHANGES = {"steps", "output_dir", "progress", "plot", "save_every", "keep_checkpoints", "resume",
                     "overwrite", "log_every", "threads", "eval_size", "eval_dataset", "impl", "report_to",
                     "run_name", "project", "log_completions_every", "num_completions_to_print",
                     "shared_prefix", "merge_lora", "vllm_gpu_memory_utilization", "vllm_kv_cache_mib",
                     "vllm_enable_sleep_mode", "tool_timeout", "tool_workers"}
# (not sft_warmup_steps: a resumed run repeats the warm-up to rebuild the reference model, which must be the same)


def load_checkpoint(run: Run, directory: Path) -> bool:
    """Restores the newest intact checkpoint in ``directory`` (False: there is none). A damaged newer one is named
    in a warning, skipped, and renamed ``*.damaged`` once the older one has loaded. A checkpoint refused as unsafe
    (its pickle needs more than tensors and plain values: planted, or of an older format) is not skipped: the resume
    stops there with its name, unread. Nothing in ``directory`` is touched before every check has passed: a
    checkpoint of other options, or one past ``--steps``, is refused."""
    world = run.world
    found = ckpt.list_checkpoints(directory)
    if not found:
        if world.is_main and ckpt.remove_stale_temporaries(directory):  # a save killed before any completed
            logger.warning("removed the partial checkpoint left by an interrupted save")
        logger.info("resume: no checkpoint in %s, starting from step 0", directory)
        return False
    damaged = []
    for step, path in reversed(found):
        try:
            state = ckpt.read_state(path)
            break
        except ckpt.DamagedCheckpoint as e:
            logger.warning("--resume: skipping a damaged checkpoint: %s", e)
            damaged.append((path, e))
        except ckpt.UnsafeCheckpoint as e:  # never run, never skipped for an older one: the user decides
            raise ValueError(f"--resume: {e}; nothing in {directory} was changed") from None
    else:
        reasons = "; ".join(str(e) for _, e in damaged)
        raise ValueError(f"--resume: every checkpoint in {directory} is damaged ({reasons}); restore one from a "
                         "copy, or start over with --overwrite")
    sharded = path.suffix == ".dcp"
    if sharded != (world.strategy == "fsdp2"):
        raise ValueError(f"--resume: {path} was written {'under' if sharded else 'without'} FSDP2; resume it "
                         f"{'under torchrun with --distributed fsdp2' if sharded else 'without FSDP2'}")
    saved, now = state["config"], run.config.to_dict()
    if not isinstance(saved, dict):
        raise ValueError(f"--resume: {path} holds no run options (its config is a {type(saved).__name__})")
    # an option newer than the checkpoint's run had its default there
    changed = config_changes({**TrainConfig().to_dict(), **saved}, now, RESUMABLE_CHANGES)
    if changed:
        diff = ", ".join(f"TrainConfig.{change}" for change in changed)  # the CLI names each by its flag
        raise ValueError(f"--resume: {path} was written by a run with other options ({diff}); leave those out "
                         f"(--resume --output-dir alone continues with the run's own options: only "
                         f"{', '.join(sorted(RESUMABLE_CHANGES))} may change) or start a new run")
    if state["step"] > run.config.steps:
        raise ValueError(f"TrainConfig.steps: {path} is at step {state['step']}, past --steps {run.config.steps}; "
                         f"resume with --steps {state['step']} or more (nothing was changed)")
    try:
        if sharded:
            ckpt.load_sharded(run.model, run.optimizer, path)
        else:
            load_trained_state(run.model, state["model"], run.config)
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.sampler.load_state_dict(state["sampler"])
    except (RuntimeError, KeyError) as e:  # the same options, but another model or data behind the same names
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"--resume: {path} does not fit this run ({type(e).__name__}: {reason})") from None
    ckpt.set_rng_state(state["rng"])
    run.step, run.skipped_updates = state["step"], state["skipped_updates"]
    dist_.barrier(world)  # every rank has read what it needs before rank 0 renames or removes anything
    if world.is_main:
        for broken, _ in damaged:
            logger.warning("--resume: renamed the damaged %s to %s", broken, ckpt.set_aside(broken))
        stale = ckpt.remove_stale_temporaries(directory)
        if stale:
            logger.warning("removed %d partial checkpoint(s) left by an interrupted save", len(stale))
        stale = ckpt.remove_stale_temporaries(directory.parent, f".{MODEL_DIR}.*.tmp")  # a killed model/ export
        if stale:
            logger.warning("removed %d partial %s/ export(s) left by an interrupted run: %s", len(stale), MODEL_DIR,
                           ", ".join(p.name for p in stale))
    logger.info("resumed from %s (step %d)", path, step)
    return True
