"""TrainConfig: defaults, TOML/YAML files, command-line overrides, errors, and ``grpo-fast train --help``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from grpo_fast.cli import main
from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.train.config import (TRAINER_OWNED_LOSS_FIELDS, TrainConfig, build_config, field_help,
                                    read_config_file)


def test_defaults_are_valid_and_serialisable():
    config = TrainConfig()
    assert config.model == "tiny" and config.loss == GRPOLossConfig(beta=0.04)
    assert json.loads(json.dumps(config.to_dict()))["loss"]["loss_type"] == "dapo"


def test_file_then_command_line_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('steps = 7\ngroup_size = 4\nrewards = ["math", "format"]\n[loss]\nloss_type = "grpo"\n'
                    "beta = 0.02\n")
    values = read_config_file(toml)
    config = build_config(values, {"steps": "9", "loss.epsilon": "0.3"})
    assert (config.steps, config.group_size, config.rewards) == (9, 4, ["math", "format"])
    assert config.loss.loss_type == LossType.GRPO and config.loss.beta == 0.02 and config.loss.epsilon == 0.3
    yaml = tmp_path / "c.yaml"
    yaml.write_text("steps: 3\nlr: 1.0e-4\nloss:\n  loss_type: cispo\n  epsilon_high: 5\n")
    config = build_config(read_config_file(yaml), {"lr": "2e-4", "progress": "false"})
    assert (config.steps, config.lr, config.progress) == (3, 2e-4, False)
    assert config.loss.loss_type == LossType.CISPO and config.loss.epsilon_high == 5.0
    assert config.loss.beta == 0.04  # fields the file leaves alone keep the trainer's defaults


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"stepz": "3"}, "unknown option 'stepz'; did you mean steps"),
        ({"loss.betta": "0.1"}, "unknown loss option 'betta'; did you mean beta"),
        ({"steps": "many"}, r"TrainConfig.steps: expected int, got 'many'"),
        ({"steps": "0"}, r"TrainConfig.steps must be an int >= 1, got 0"),
        ({"group_size": "1"}, "group_size must be >= 2"),
        ({"dtype": "float8"}, "TrainConfig.dtype must be one of auto, float32, bfloat16, float16; got 'float8'"),
        ({"progress": "maybe"}, "TrainConfig.progress: expected bool"),
        ({"loss.temperature": "0.7"}, "loss.temperature is set by the trainer"),
        ({"loss.loss_type": "ppo"}, "loss_type must be one of"),
        ({"rewards": "math,format", "reward_weights": "1"}, "one weight per reward"),
        ({"reward_weights": "1,2"}, r"one weight per reward \(1: \['math'\]\), got 2"),
        ({"rewards": ""}, "TrainConfig.rewards must name at least one reward function"),
        ({"temperature": "0"}, "temperature must be > 0"),
        ({"threads": "0"}, "TrainConfig.threads must be an int >= 1 or None, got 0"),
        ({"threads": "10000"}, r"TrainConfig.threads must be at most the \d+ CPUs this process may use, got 10000"),
        ({"lr": "inf"}, "TrainConfig.lr must be a finite number > 0 or None, got inf"),
        ({"top_k": "-1"}, "TrainConfig.top_k must be an int >= 0"),
        ({"adam_betas": "0.9,1.5"}, r"adam_betas must be two numbers in \[0, 1\)"),
        ({"device": "tpu"}, "TrainConfig.device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        ({"device": "cuda:x"}, "TrainConfig.device must be auto, cpu, cuda or cuda:N; got 'cuda:x'"),
        ({"output_dir": ""}, "TrainConfig.output_dir must name a directory, got ''"),
        ({"output_dir": "  "}, "TrainConfig.output_dir must name a directory, got '  '"),
        ({"reward_weights": "nan"}, r"TrainConfig.reward_weights must be finite numbers, got \[nan\]"),
        ({"reward_weights": "-inf"}, r"TrainConfig.reward_weights must be finite numbers, got \[-inf\]"),
    ],
)
def test_bad_options_name_the_option_and_what_came(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_config(overrides=overrides)


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_config_file(tmp_path / "missing.toml")
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(FileNotFoundError, match="--config: not a file .*dir.toml"):
        read_config_file(tmp_path / "dir.toml")
    bad = tmp_path / "c.ini"
    bad.write_text("x=1")
    with pytest.raises(ValueError, match=r"expected a .toml, .yaml, .yml or .json \(a run's config.json\) file"):
        read_config_file(bad)


@pytest.mark.parametrize("name, text, match", [
    ("c.toml", "steps = 3\nlr = \n", r"--config: .*c.toml is not valid TOML: Invalid value \(at line 2, column \d+"),
    ("c.toml", "steps = 3\nsteps = 4\n", r"c.toml is not valid TOML: Cannot overwrite a value \(at line 2, column \d+"),
    ("c.toml", b"steps = '\xff'\n", r"c.toml is not valid TOML: 'utf-8' codec can't decode"),
    ("c.yaml", "steps: 3\n  lr: 2\n", r"--config: .*c.yaml is not valid YAML at line 2, column 5: mapping values are "
                                       "not allowed here"),
    ("c.yml", "- 1\n- 2\n", r"--config: .*c.yml must hold a table of fields, got list"),
])
def test_config_file_syntax_errors_name_the_file_and_line(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_config_file(path)


@pytest.mark.parametrize("values, match", [
    ({"rewards": [1, 2]}, r"config file: TrainConfig.rewards: expected a list of str, got \[1, 2\] \(item 0 is int, "
                          r"expected a string\)"),
    ({"rewards": "math"}, None),  # a string is a comma-separated list, as on the command line
    ({"reward_weights": [1, "x"]}, r"TrainConfig.reward_weights: expected a list of float, got \[1, 'x'\] \(item 1 "
                                   r"is str"),
    ({"loss": 5}, r"config file: loss must be a table of loss options \(\[loss\] in TOML, a mapping in YAML, "
                  r"--loss.NAME on the command line\), got 5"),
    ({"steps": 2.5}, r"TrainConfig.steps: expected int, got 2.5 \(float, expected a whole number\)"),
    ({"model": 5}, r"TrainConfig.model: expected str, got 5 \(int, expected a string\)"),
    ({"progress": 1}, r"TrainConfig.progress: expected bool, got 1 \(int, expected true or false\)"),
    ({1: 2}, r"config file: option names are strings, got 1"),
])
def test_file_values_of_the_wrong_type_name_the_option(values, match):
    if match is None:
        assert build_config(values).rewards == ["math"]
        return
    with pytest.raises(ValueError, match=match):
        build_config(values)


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    config = build_config({"temperature": np.float32(0.5), "steps": np.int64(7), "reward_weights": [np.float16(2)],
                           "progress": np.bool_(False), "loss": {"beta": np.float64(0.25), "epsilon": np.float32(0.5)}})
    assert (config.temperature, config.steps, config.reward_weights, config.progress) == (0.5, 7, [2.0], False)
    assert type(config.temperature) is float and type(config.steps) is int and type(config.reward_weights[0]) is float
    assert (config.loss.beta, config.loss.epsilon) == (0.25, 0.5)
    with pytest.raises(ValueError, match=r"TrainConfig.steps: expected int, got np.float64\(7.0\)"):
        build_config({"steps": np.float64(7)})  # a float is no step count, whatever its type
    direct = TrainConfig(temperature=np.float32(0.5), steps=np.int64(3), reward_weights=[np.float64(2.0)],
                         adam_betas=[np.float32(0.5), np.float32(0.25)])  # from Python: the same
    assert (direct.temperature, direct.steps, direct.reward_weights, direct.adam_betas) == (0.5, 3, [2.0], [0.5, 0.25])
    assert type(direct.steps) is int and type(direct.adam_betas[0]) is float
    with pytest.raises(ValueError, match=r"TrainConfig.steps must be an int >= 1, got 0"):
        TrainConfig(steps=np.int32(0))


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in dataclasses.fields(TrainConfig):
        if f.name != "loss":
            assert f"--{f.name.replace('_', '-')}" in text, f.name
    for _, flag, default, _ in field_help():
        assert f"{flag} " in text or f"{flag}\n" in text
        assert f"(default: {default})" in text, flag
    assert "--loss.beta" in text and "--loss.temperature" not in text


def test_loss_help_is_the_fields_metadata():
    """Every loss field describes itself (``help`` metadata); ``--help`` shows that text for the ones a user sets."""
    rows = {flag: text for _, flag, _, text in field_help()}
    for f in dataclasses.fields(GRPOLossConfig):
        assert f.metadata.get("help"), f.name
        if f.name not in TRAINER_OWNED_LOSS_FIELDS:
            assert rows[f"--loss.{f.name}"] == f.metadata["help"]
    assert all(t.value in rows["--loss.loss_type"] for t in LossType)


def test_cli_reports_bad_input_without_a_traceback(capsys, tmp_path):
    code = main(["train", "--steps", "0", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "grpo-fast train: error: --steps must be an int >= 1" in err
    assert "Traceback" not in err


def test_cli_runs_a_short_training(tmp_path):
    """The installed entry point (python -m grpo_fast) end to end: a summary line and exit code 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_fast", "train", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
         "--eval-size", "8", "--output-dir", str(tmp_path / "run"), "--progress", "false", "--plot", "false"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "grpo-fast: 2 steps" in proc.stdout and "held-out reward" in proc.stdout
    assert "fused-loss kernel path: torch" in proc.stderr  # the log says which kernel path ran


def test_documented_example_config_loads():
    from pathlib import Path

    path = Path(__file__).parents[1] / "docs" / "train_example.toml"
    config = build_config(read_config_file(path))
    assert config.lr_schedule == "cosine" and config.loss.epsilon_high == 0.28


def test_a_bool_in_a_file_is_not_a_number():
    with pytest.raises(ValueError, match=r"TrainConfig.temperature: expected float, got True \(bool, expected a "
                                         "number\)"):
        build_config({"temperature": True})


def test_threads_are_bounded_by_the_cpus_this_process_may_use(monkeypatch):
    import grpo_fast.train.config as config_module

    monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert build_config(overrides={"threads": "3"}).threads == 3
    with pytest.raises(ValueError, match="^TrainConfig.threads must be at most the 3 CPUs this process may use, got 4$"):
        build_config(overrides={"threads": "4"})


def test_cli_threads_error_names_the_flag(capsys):
    from grpo_fast.cli import main

    assert main(["train", "--threads", "10000"]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "CPUs this process may use, got 10000" in err and "Traceback" not in err
