"""TrainConfig: defaults, TOML/YAML files, command-line overrides, errors, and ``grpo-fast train --help``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from grpo_fast.cli import main
from grpo_fast.config import GRPOLossConfig, LossType
from grpo_fast.train.config import TrainConfig, build_config, field_help, read_config_file


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
        ({"lr": "inf"}, "TrainConfig.lr must be a finite number > 0 or None, got inf"),
        ({"top_k": "-1"}, "TrainConfig.top_k must be an int >= 0"),
        ({"adam_betas": "0.9,1.5"}, r"adam_betas must be two numbers in \[0, 1\)"),
    ],
)
def test_bad_options_name_the_option_and_what_came(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_config(overrides=overrides)


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_config_file(tmp_path / "missing.toml")
    bad = tmp_path / "c.ini"
    bad.write_text("x=1")
    with pytest.raises(ValueError, match=r"expected a .toml, .yaml or .yml file"):
        read_config_file(bad)


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


def test_cli_reports_bad_input_without_a_traceback(capsys, tmp_path):
    code = main(["train", "--steps", "0", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "grpo-fast train: error: TrainConfig.steps must be an int >= 1" in err
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
