"""Resuming the way users expect: ``grpo-fast train --resume --output-dir DIR`` alone continues the run with its own
options (``DIR/config.json``), options given with it are checked as before, ``--config`` takes a run's config.json,
and a save (a resumed run's ``model/``) never deletes files it did not write, with the modes the umask gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_fast.cli import main
from grpo_fast.train.config import build_config, read_config_file, resumed_config, run_options
from grpo_fast.train.export import save_model
from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

# a run whose options are far from the defaults: a resume that took the defaults would differ in all of them
RUN = ["--steps", "3", "--prompts-per-step", "2", "--group-size", "3", "--micro-batch-size", "6", "--eval-size", "2",
       "--max-new-tokens", "2", "--lr", "0.002", "--seed", "5", "--loss.beta", "0.1", "--save-every", "1",
       "--keep-checkpoints", "0", "--progress", "false", "--plot", "false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 3-step run with a checkpoint after every step, and its final weights."""
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", *RUN, "--output-dir", str(out)]) == 0
    return out, load_file(out / "model" / "model.safetensors")


def test_resume_alone_continues_with_the_runs_options(finished_run, capsys):
    out, final = finished_run
    saved = json.loads((out / "config.json").read_text())
    (out / "checkpoints" / "checkpoint-000003.pt").unlink()  # the run as a stop after step 2 left it
    (out / "model" / "eval.json").write_text('{"mean": 0.5}\n')  # what grpo-fast eval writes there by default
    (out / "model" / "notes").mkdir()
    (out / "model" / "notes" / "a.txt").write_text("mine\n")
    assert main(["train", "--resume", "--output-dir", str(out)]) == 0, capsys.readouterr().err
    resumed = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in resumed.items() if k != "resume"} == {k: v for k, v in saved.items() if k != "resume"}
    assert resumed["group_size"] == 3 and resumed["lr"] == 0.002 and resumed["loss"]["beta"] == 0.1
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["event"] == "step"] == [1, 2, 3]  # cut back to step 2, then step 3
    again = load_file(out / "model" / "model.safetensors")
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)  # bit-exact
    assert (out / "model" / "eval.json").read_text() == '{"mean": 0.5}\n'
    assert (out / "model" / "notes" / "a.txt").read_text() == "mine\n"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".model")]  # no temporary left behind


def test_an_option_given_with_resume_is_checked_against_the_run(finished_run, capsys):
    out, _ = finished_run
    assert main(["train", "--resume", "--output-dir", str(out), "--lr", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("grpo-fast train: error: --resume: ") and "(--lr: 0.002 -> 0.1)" in err, err  # named by its flag
    assert "--resume --output-dir alone continues with the run's own options" in err


def test_an_option_a_resume_may_change_is_taken(finished_run):
    out, _ = finished_run
    config = resumed_config({}, {"resume": "true", "output-dir": str(out), "steps": "7", "threads": "1"})
    assert (config.steps, config.threads, config.group_size, config.lr, config.seed) == (7, 1, 3, 0.002, 5)
    assert config.output_dir == str(out)


def test_config_takes_a_runs_config_json(finished_run, tmp_path):
    out, _ = finished_run
    values = read_config_file(out / "config.json")
    assert "resume" not in values and "overwrite" not in values  # how that run started, not its options
    config = build_config(values, {"output-dir": str(tmp_path / "new")})
    saved = json.loads((out / "config.json").read_text())
    assert config.to_dict() == {**saved, "output_dir": str(tmp_path / "new"), "resume": False, "overwrite": False}


def test_run_options(tmp_path):
    assert run_options(tmp_path) == {}  # no config.json: the flags and defaults alone
    (tmp_path / "config.json").write_text('{"steps": 5, "output_dir": "elsewhere", "resume": true}')
    assert run_options(tmp_path) == {"steps": 5}  # the directory read is the run's, wherever it was
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^--resume: .*config.json, the run's options, cannot be read"):
        run_options(tmp_path)
    bad = tmp_path / "c.json"
    bad.write_text("[1")
    with pytest.raises(ValueError, match=r"^--config: .*c.json is not valid JSON"):
        read_config_file(bad)
    (tmp_path / "config.json.bak").write_text("{}")
    with pytest.raises(ValueError, match=r"expected a .toml, .yaml, .yml or .json"):
        read_config_file(tmp_path / "config.json.bak")


def test_json_null_is_none_for_an_optional_option():
    assert build_config({"tokenizer": None, "lr": None, "eval_dataset": None}).lr is None
    with pytest.raises(ValueError, match="steps: expected int, got None"):
        build_config({"steps": None})


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_save_keeps_what_it_did_not_write_and_the_umask_modes(tmp_path, umask):
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0)
    out = tmp_path / "model"
    previous = os.umask(umask)
    try:
        save_model(model, tokenizer, out)
        (out / "eval.json").write_text("{}\n")
        (out / "adapter_model.safetensors").write_text("an earlier LoRA save's")  # a save's file: replaced
        (out / "model-00001-of-00002.safetensors").write_text("an earlier sharded save's")
        (out / "README.md").write_text("my notes\n")
        save_model(model, tokenizer, out)
    finally:
        os.umask(previous)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "eval.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]
    assert (out / "eval.json").read_text() == "{}\n" and (out / "README.md").read_text() == "my notes\n"
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert not [p for p in tmp_path.iterdir() if p.name != "model"]  # no .model.*.tmp or .old left
