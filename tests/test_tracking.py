"""``--report-to`` (grpo_fast/train/tracking.py): TensorBoard, W&B (offline) and Trackio (local) receive exactly the
rows metrics.jsonl holds, at their steps, with the run's config; a tracker that cannot start or stops is one warning
line and the run goes on. Every check runs offline."""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from train_helpers import REPO, small_config

from grpo_fast.cli import main
from grpo_fast.train import fit, prepare
from grpo_fast.train import tracking
from grpo_fast.train.metrics import read_records, read_steps


def _train(config):
    return fit(prepare(config))


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("event", "step") and isinstance(v, (int, float))
            and not isinstance(v, bool)}


def _tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalars in ``log_dir``'s event files, read by TensorBoard's own loader (which
    applies a resumed writer's purge). Only classic scalars (``simple_value``) count: they are what TensorBoard's
    default fast loader charts (it drops double-precision tensor scalars, which an earlier version wrote), so a
    metric written any other way is missing here."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert not [t for t in acc.Tags()["tensors"] if not t.endswith("/text_summary")], acc.Tags()["tensors"]
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _f32(value: float) -> float:
    """What a float32 scalar stores of ``value``."""
    return float(np.float32(value))


def _tensorboard_texts(log_dir) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def test_report_to_names_and_errors():
    assert tracking.resolve_report_to(["none"]) == []
    assert tracking.resolve_report_to(["wandb", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]
    assert set(tracking.resolve_report_to(["all"])) == {n for n in tracking.TRACKERS if tracking.installed(n)}
    for bad, message in ((["mlflow"], "got mlflow"), (["none", "wandb"], "none stands alone"),
                         (["all", "trackio"], "all stands alone")):
        with pytest.raises(ValueError, match=message):
            tracking.check_report_to(bad)


@pytest.mark.parametrize("args, expected", [
    (["--report-to", "mlflow"], "--report-to must name none, all, tensorboard, wandb, trackio (comma-separated), "
                                "got mlflow"),
    (["--report-to", "wandb,none"], "--report-to: none stands alone, got wandb,none"),
    (["--log-completions-every", "-1"], "--log-completions-every must be an int >= 0 (0: off), got -1"),
    (["--num-completions-to-print", "-2"], "--num-completions-to-print must be an int >= 0 or None (all), got -2"),
    (["--run-name", " "], "--run-name must be a non-empty string or None, got ' '"),
])
def test_bad_values_name_the_flag_what_was_expected_and_what_came(args, expected, capsys, tmp_path):
    assert main(["train", *args, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"grpo-fast train: error: {expected}" in err and "Traceback" not in err


def test_help_describes_each_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--report-to", "none"), ("--run-name", "None"), ("--project", "None"),
                          ("--log-completions-every", "0"), ("--num-completions-to-print", "4")):
        assert f"{flag} VALUE" in out and f"(default: {default})" in out.split(f"{flag} VALUE", 1)[1][:1200], flag
    assert "TRL's report_to" in out and "TRL's num_completions_to_print" in out


def test_tensorboard_holds_metrics_jsonl_step_for_step_also_across_a_resume(tmp_path):
    """Every number of every metrics.jsonl row is a TensorBoard scalar at that row's step (float32, TensorBoard's
    scalar: the file's value rounded to it, exactly); after a resume from step 2 of a run that had reached step 4, TensorBoard's loader shows the resumed
    steps 3-4, not the abandoned ones, as metrics.jsonl does."""
    config = dict(steps=4, save_every=2, keep_checkpoints=0, report_to="tensorboard", run_name="tb-run",
                  **{"loss.beta": "0.04"})
    _train(small_config(tmp_path, **config))
    run = tmp_path / "run"
    first = {r["step"]: r for r in read_steps(run / "metrics.jsonl")}
    (run / "checkpoints" / "checkpoint-000004.pt").unlink()  # back to step 2: steps 3 and 4 run again
    _train(small_config(tmp_path, **config, resume="true", seed="0"))
    rows = read_steps(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    scalars = _tensorboard_scalars(run / "tensorboard")
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in _numbers(row).items():
            expected.setdefault(key, {})[row["step"]] = _f32(value)
    assert {k: v for k, v in scalars.items() if not k.startswith("eval_")} == expected
    assert "kl" in expected and expected["time_step_s"][3] != first[3]["time_step_s"]  # the resumed steps' values
    records = read_records(run / "metrics.jsonl")
    assert scalars["eval_before"] == {0: _f32(records[0]["eval_before"])}
    assert scalars["eval_after"] == {4: _f32(records[-1]["eval_after"])}
    texts = _tensorboard_texts(run / "tensorboard")
    config_json = json.loads(textwrap.dedent(texts["config/text_summary"][-1]))
    assert config_json == json.loads((run / "config.json").read_text())
    assert texts["run_name/text_summary"][-1] == "tb-run"


def test_a_shared_tensorboard_directory_keeps_other_runs(tmp_path, monkeypatch):
    """TENSORBOARD_LOGGING_DIR shared by runs: each run writes its own subdirectory (--run-name, else the output
    directory's name), and a new run deletes nothing there, another run's event files included."""
    shared = tmp_path / "shared"
    other = shared / "someone-else"
    other.mkdir(parents=True)
    (other / "events.out.tfevents.1.host").write_bytes(b"theirs")
    (shared / "events.out.tfevents.2.host").write_bytes(b"theirs too")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(shared))
    _train(small_config(tmp_path, steps=2, report_to="tensorboard", run_name="mine"))
    _train(small_config(tmp_path / "second", steps=2, report_to="tensorboard"))
    assert (other / "events.out.tfevents.1.host").read_bytes() == b"theirs"
    assert (shared / "events.out.tfevents.2.host").read_bytes() == b"theirs too"
    assert set(_tensorboard_scalars(shared / "mine")["reward"]) == {1, 2}
    assert set(_tensorboard_scalars(shared / "run")["reward"]) == {1, 2}  # small_config's output_dir is .../run
    assert not (tmp_path / "run" / "tensorboard").exists()


def _wandb_records(run_dir):
    """The protobuf records of an offline W&B run's ``.wandb`` file (LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header of crc, length and type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    data = open(path, "rb").read()
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind == 2 else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def test_wandb_offline_gets_every_row_at_its_step_the_config_and_the_completions(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _train(small_config(tmp_path, steps=3, report_to="wandb", run_name="offline-run", project="grpo-fast-tests",
                        log_completions_every=2))
    run = tmp_path / "run"
    (run_dir,) = glob.glob(str(tmp_path / "wandb-dir" / "wandb" / "offline-run-*"))
    records = _wandb_records(run_dir)
    history: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":  # a name is in key or nested_key; a table's parts nest
            items = {(i.key,) if i.key else tuple(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(
                {"/".join(k): v for k, v in items.items() if not k[0].startswith("_")})
    rows = read_steps(run / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        logged = history[row["step"]]
        table = {k: logged.pop(k) for k in list(logged) if k.startswith("completions")}
        assert logged == pytest.approx(_numbers(row), rel=1e-15, abs=0)
        assert bool(table) == (row["step"] == 2)
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert meta.display_name == "offline-run" and meta.project == "grpo-fast-tests"
    config = {i.key: json.loads(i.value_json) for i in meta.config.update}
    assert config["steps"] == 3 and config["report_to"] == ["wandb"] and config["loss"]["beta"] == 0.0
    summary = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update if i.key.startswith("eval_")}
    assert summary == {"eval_before": read_records(run / "metrics.jsonl")[0]["eval_before"],
                       "eval_after": read_records(run / "metrics.jsonl")[-1]["eval_after"]}
    (table_file,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "completions_2_*.table.json"))
    table = json.loads(open(table_file).read())
    lines = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    assert table["columns"] == list(lines[0])
    assert table["data"] == [list(line.values()) for line in lines]


def test_trackio_locally(tmp_path):
    """trackio in a fresh process (it reads TRACKIO_DIR at import): the rows at their steps, the config, no
    server. trackio is in the dev extra (locked), so CI runs this."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from train_helpers import small_config
        from grpo_fast.train import fit, prepare
        from grpo_fast.train.metrics import read_steps
        import pathlib, trackio
        tmp = pathlib.Path({str(tmp_path)!r})
        fit(prepare(small_config(tmp, steps=3, report_to="trackio", run_name="local", project="gf-test",
                                 log_completions_every=3)))
        logs = trackio.SQLiteStorage.get_logs("gf-test", "local")
        print(json.dumps({{"logs": logs, "rows": read_steps(tmp / "run" / "metrics.jsonl"),
                          "config": trackio.SQLiteStorage.get_run_config("gf-test", "local")}}, default=str))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout  # trackio's banner went to the log, not stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    by_step: dict[int, dict] = {}
    for entry in result["logs"]:
        by_step.setdefault(entry["step"], {}).update({k: v for k, v in entry.items()
                                                      if k not in ("step", "timestamp") and not k.startswith("_")})
    for row in result["rows"]:
        logged = {k: v for k, v in by_step[row["step"]].items() if k in _numbers(row)}
        assert logged == _numbers(row)
    assert "completions" in by_step[3] and by_step[0].get("eval_before") is not None
    assert result["config"]["steps"] == 3 and (tmp_path / "trackio").is_dir()


def _report_to_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("--report-to")]


def test_a_missing_client_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, find_spec finds none
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        summary = _train(small_config(tmp_path, steps=2, report_to="wandb,tensorboard"))
    assert summary.steps == 2
    assert _report_to_warnings(caplog) == ["--report-to wandb: not reported, its client is not installed (pip install "
                                           "'grpo-fast[wandb]'); metrics.jsonl has every step"]
    assert set(_tensorboard_scalars(tmp_path / "run" / "tensorboard")["reward"]) == {1, 2}  # the other one reports


def test_a_tracker_that_fails_mid_run_is_one_warning_and_dropped(tmp_path, monkeypatch, caplog):
    calls = []

    def unreachable(self, metrics, step):
        calls.append(step)
        raise ConnectionError("service unreachable\nsecond line of the error")

    monkeypatch.setattr(tracking.TensorBoardTracker, "log", unreachable)
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        summary = _train(small_config(tmp_path, steps=3, report_to="tensorboard"))
    assert summary.steps == 3 and calls == [0]  # eval_before's call failed: nothing else was sent
    assert _report_to_warnings(caplog) == ["--report-to tensorboard: stopped reporting (ConnectionError: service "
                                           "unreachable); metrics.jsonl has every step, the run goes on"]
    assert [r["step"] for r in read_steps(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_an_unreachable_wandb_is_one_warning(tmp_path):
    """Online, with no API key and no terminal, at an address nothing listens on: wandb refuses at once; the run
    trains without it. A fresh process: wandb keeps its first settings for the life of one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="online", WANDB_DIR=str(tmp_path / "wandb-dir"), WANDB_BASE_URL="http://127.0.0.1:9",
               HOME=str(tmp_path / "home"))  # no ~/.netrc with a key
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_fast", "train", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
         "--eval-size", "4", "--max-new-tokens", "2", "--output-dir", str(tmp_path / "run"), "--plot", "false",
         "--report-to", "wandb"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "--report-to" in line]
    assert len(warnings) == 1 and "--report-to wandb: could not start (" in warnings[0], proc.stderr[-2000:]
    assert "grpo-fast: 2 steps" in proc.stdout


def test_only_rank_zero_opens_trackers(tmp_path, monkeypatch):
    """A rank other than 0 writes no metrics and opens no tracker (the ranks' loop is the same)."""
    from grpo_fast.train import lifecycle
    from grpo_fast.train.distributed import World

    opened = []
    monkeypatch.setattr(lifecycle, "open_trackers", lambda *a, **k: opened.append(a) or [])
    real_setup = lifecycle.setup

    def as_rank_one(config):
        run = real_setup(config)
        run.world = World(rank=1, size=1)  # rank 1's view, without the process group
        return run

    monkeypatch.setattr(lifecycle, "setup", as_rank_one)
    prepared = prepare(small_config(tmp_path, steps=1, report_to="tensorboard"))
    assert prepared.log is None and opened == [] and not (tmp_path / "run" / "tensorboard").exists()
