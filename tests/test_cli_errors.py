"""``grpo-fast train`` as a careless or hostile user runs it: every mistake is one line on stderr that names the flag,
file or row, exit code 2, nothing written that blocks the corrected rerun; Ctrl-C saves the step and exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import small_config, unwritable_path

from grpo_fast.cli import main, resume_command
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train import prepare, train
from grpo_fast.train.metrics import read_steps
from grpo_fast.train.lifecycle import TrainingInterrupted, fit

TINY = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "2",
        "--progress", "false", "--plot", "false"]


def _one_line_error(capsys, argv, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("grpo-fast train: error: "), err
    return errors[0]


@pytest.mark.parametrize("case", ["device", "impl", "weights", "toml", "yaml", "file", "unwritable", "empty-dir",
                                  "rewards-ints", "loss-int", "weights-strings"])
def test_bad_input_is_one_line(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # conftest runs Triton on the CPU; a user's CPU does not
    out = str(tmp_path / "run")
    toml, yaml = tmp_path / "c.toml", tmp_path / "c.yaml"
    toml.write_text({"toml": "steps = [\n", "rewards-ints": "rewards = [1, 2]\n", "loss-int": "loss = 5\n",
                     "weights-strings": 'reward_weights = ["a"]\n'}.get(case, ""))
    yaml.write_text("steps: [1\nlr: 2\n")
    (tmp_path / "a-file").write_text("")
    argv, expected = {
        "device": (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        "impl": (["--impl", "triton"], "--impl: grpo_loss: impl='triton' needs CUDA tensors"),
        "weights": (["--reward-weights", "nan"], "--reward-weights must be finite numbers, got [nan]"),
        "toml": (["--config", str(toml)], f"--config: {toml} is not valid TOML: "),
        "yaml": (["--config", str(yaml)], f"--config: {yaml} is not valid YAML at line 2, column 3: expected ','"),
        "file": (["--output-dir", str(tmp_path / "a-file")], f"{tmp_path / 'a-file'} is a file, expected a directory"),
        "unwritable": (["--output-dir", unwritable_path(tmp_path)], "--output-dir: cannot create or write in"),
        "empty-dir": (["--output-dir", ""], "--output-dir must name a directory, got ''"),
        "rewards-ints": (["--config", str(toml)], f"--config {toml}: rewards: expected a list of str, got [1, 2] "
                                                  "(item 0 is int, expected a string)"),
        "loss-int": (["--config", str(toml)], f"--config {toml}: loss must be a table of loss options ([loss] in "
                                              "TOML, a mapping in YAML, --loss.NAME on the command line), got 5"),
        "weights-strings": (["--config", str(toml)], f"--config {toml}: reward_weights: expected a list of float, "
                                                     "got ['a'] (item 0 is str, expected a number)"),
    }[case]
    if case == "impl" and torch.cuda.is_available():
        pytest.skip("--impl triton is valid where CUDA is")
    line = _one_line_error(capsys, ["train", *TINY, "--output-dir", out, *argv])
    assert expected in line
    assert not (tmp_path / "run").exists()  # nothing written, not even the directory


def test_no_abbreviated_options(capsys, tmp_path):
    """argparse would take --step for --steps (and --out for --output-dir): every parser refuses prefixes."""
    with pytest.raises(SystemExit) as info:
        main(["train", "--step", "3", "--output-dir", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo-fast train: error: unknown option(s): --step 3; did you mean --steps? (see grpo-fast train "
                   "--help)"]
    with pytest.raises(SystemExit):
        main(["train", "--output", str(tmp_path)])
    assert "unknown option(s): --output" in capsys.readouterr().err
    from grpo_fast.memory.fit import build_parser

    assert build_parser().allow_abbrev is False


@pytest.mark.parametrize("problem", ["empty", "long", "type"])
def test_the_whole_dataset_is_checked_before_step_1(problem, tmp_path, capsys):
    """A bad prompt far down the file is found at start, with its line, even for a run too short to sample it."""
    rows = [{"prompt": "max 1 2 3=", "answer": "3"} for _ in range(40)]
    rows[29]["prompt"] = {"empty": " \n", "long": "max " + " ".join("123456789" * 4) + "=", "type": 7}[problem]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _one_line_error(capsys, ["train", *TINY, "--dataset", str(data), "--max-prompt-length", "40",
                                    "--output-dir", str(tmp_path / "run")])
    expected = {"empty": "column 'prompt' is an empty prompt, got ' \\n'",
                "long": "the prompt is 76 tokens long once rendered, more than --max-prompt-length 40",
                "type": "column 'prompt' must be a string or a non-empty list of chat messages"}[problem]
    assert f"{data}, line 30: {expected}" in line


def test_a_default_value_in_an_error_is_named_as_its_flag(tmp_path, capsys):
    """An error about a field the user left at its default names the flag that changes it (a field from --config
    keeps the file's name for it)."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1 " * 300, "answer": "1"}) + "\n")
    line = _one_line_error(capsys, ["train", *TINY, "--dataset", str(data), "--output-dir", str(tmp_path / "run")])
    assert line == (f"grpo-fast train: error: {data}, line 1: the prompt is 600 tokens long once rendered, more than "
                    "--max-prompt-length 512; raise --max-prompt-length or drop the long prompts")
    config = tmp_path / "c.toml"
    config.write_text("max_prompt_length = 500\n")
    line = _one_line_error(capsys, ["train", *TINY, "--config", str(config), "--dataset", str(data), "--output-dir",
                                    str(tmp_path / "run")])
    assert line.startswith(f"grpo-fast train: error: --config {config}: {data}, line 1: the prompt is 600 tokens long "
                           "once rendered, more than max_prompt_length 500;"), line


def test_a_prompt_column_the_builtin_records_lack_is_one_line(tmp_path, capsys):
    line = _one_line_error(capsys, ["train", *TINY, "--prompt-column", "question", "--output-dir",
                                    str(tmp_path / "run")])
    assert line == ("grpo-fast train: error: --prompt-column: expected a column of builtin:digits's records "
                    "('prompt', 'answer'; the prompt is 'prompt'), got 'question'")


def test_a_failed_start_does_not_block_the_rerun(tmp_path, capsys):
    """A reward that fails in the before-evaluation stops the run before anything is written; the corrected rerun
    needs no --overwrite. A start that failed in step 1 (metrics.jsonl with a start line only) blocks nothing either."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def broken(prompts, completions, **kw):\n    raise ValueError('broken reward')\n\n"
                       "def fine(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    out = tmp_path / "run"
    line = _one_line_error(capsys, ["train", *TINY, "--rewards", f"{rewards}:broken", "--output-dir", str(out)],
                           code=1)  # the function's failure, not an option's
    assert f"reward_func broken ({rewards}:2) raised ValueError: broken reward in the evaluation before training" \
        in line
    assert not (out / "metrics.jsonl").exists() and not (out / "config.json").exists()
    assert main(["train", *TINY, "--rewards", f"{rewards}:fine", "--output-dir", str(out)]) == 0
    assert [s["step"] for s in read_steps(out / "metrics.jsonl")] == [1]

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text(json.dumps({"event": "start", "eval_before": 0.0}) + "\n")
    assert train(small_config(tmp_path, steps=1, output_dir=str(crashed))).steps == 1
    with pytest.raises(FileExistsError, match="already holds a run"):  # a run with a step is protected
        train(small_config(tmp_path, steps=1, output_dir=str(crashed)))


def test_steps_below_the_checkpoint_are_refused_and_nothing_is_touched(tmp_path):
    train(small_config(tmp_path, steps=3))
    out = tmp_path / "run"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"TrainConfig.steps: .*checkpoint-000003.pt is at step 3, past --steps 2; "
                                         r"resume with --steps 3 or more \(nothing was changed\)"):
        prepare(small_config(tmp_path, steps=2, resume=True))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "not-a-checkpoint"])
def test_a_damaged_newest_checkpoint_is_named_skipped_and_the_older_one_used(damage, tmp_path, caplog):
    """The newest checkpoint damaged: resume warns with its name, continues from the older one, sets the damaged
    file aside, and ends where the undamaged run ended (nothing lost but the recomputed step)."""
    train(small_config(tmp_path, steps=3, save_every=1, keep_checkpoints=0))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    newest = ckpt_dir / "checkpoint-000003.pt"
    expected = ckpt.read_state(newest)["model"]
    data = newest.read_bytes()
    newest.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"garbage\n" * 10}.get(
        damage, b""))
    if damage == "not-a-checkpoint":
        torch.save({"step": 3}, newest)
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        summary = train(small_config(tmp_path, steps=3, save_every=1, keep_checkpoints=0, resume=True))
    assert summary.steps == 3
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert warnings[0].startswith(f"--resume: skipping a damaged checkpoint: {newest} ")
    assert (ckpt_dir / "checkpoint-000003.pt.damaged").exists()
    got = ckpt.read_state(newest)["model"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert [s["step"] for s in read_steps(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_resume_refuses_when_every_checkpoint_is_damaged(tmp_path):
    train(small_config(tmp_path, steps=2, save_every=1, keep_checkpoints=0))
    for _, path in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints"):
        path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"--resume: every checkpoint in .* is damaged \(.*checkpoint-000002.pt "
                                         r"cannot be read \(the file is empty\); .*checkpoint-000001.pt"):
        train(small_config(tmp_path, steps=2, resume=True))
    assert len(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")) == 2  # not renamed: nothing was used


def test_resume_needs_a_checkpoint_and_excludes_overwrite(tmp_path, capsys):
    """--resume where there is nothing to resume, and --resume with --overwrite: one line each, naming the flags;
    neither creates the output directory (nor its missing parents)."""
    out = tmp_path / "new" / "run"
    line = _one_line_error(capsys, ["train", *TINY, "--output-dir", str(out), "--resume"])
    assert line == (f"grpo-fast train: error: --resume: nothing to resume ({out} does not exist); start the run "
                    "without --resume")
    line = _one_line_error(capsys, ["train", *TINY, "--output-dir", str(out), "--resume", "--overwrite"])
    assert line == ("grpo-fast train: error: --resume and --overwrite exclude each other (resume continues the run in "
                    "output_dir, overwrite deletes its checkpoints and starts over); pass one, got both")
    assert not (tmp_path / "new").exists()


def test_resume_command_repeats_the_options_with_resume(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/grpo-fast"])
    assert resume_command(["train", "--steps", "9", "--overwrite", "--output-dir", "a b"]) == \
        "grpo-fast train --steps 9 --output-dir 'a b' --resume"
    assert resume_command(["train", "--overwrite", "true", "--resume=false", "--seed", "1"]) == \
        "grpo-fast train --seed 1 --resume"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command(["train"]) == "torchrun [the same torchrun options] -m grpo_fast train --resume"


def _interrupting_step(monkeypatch, at_step: int, times: int = 1, signum=signal.SIGINT, signums=None):
    """train_step that sends itself ``times`` ``signum`` (or the ``signums`` in turn) in the middle of step
    ``at_step`` (SIGINT: as a terminal would; SIGTERM and the others: as a scheduler would)."""
    from grpo_fast.train import lifecycle

    real = lifecycle.train_step

    def step(run):
        if run.step + 1 == at_step:
            for each in signums or [signum] * times:
                os.kill(os.getpid(), each)
                time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        return real(run)

    monkeypatch.setattr(lifecycle, "train_step", step)


def test_ctrl_c_finishes_the_step_and_saves_it(tmp_path, monkeypatch):
    _interrupting_step(monkeypatch, at_step=2, times=1)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a job started in the background
    with pytest.raises(TrainingInterrupted, match=r"stopped by Ctrl-C after step 2 of 4, saved in .*"
                                                  r"checkpoint-000002.pt") as info:
        fit(prepare(small_config(tmp_path, steps=4)))
    assert info.value.clean and info.value.step == 2 and info.value.checkpoint.exists()
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    monkeypatch.undo()
    assert train(small_config(tmp_path, steps=4, resume=True)).steps == 4
    assert [s["step"] for s in read_steps(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU"])
def test_a_schedulers_stop_signal_is_ctrl_c(tmp_path, monkeypatch, name):
    """A scheduler's stop (SIGTERM) or warning signal in step 2 of 4: the step finishes and is saved, every handler
    is put back, and the resumed run ends bit for bit where an uninterrupted run ends."""
    signum = getattr(signal, name)
    straight = train(small_config(tmp_path / "straight", steps=4, save_every=4))
    assert straight.steps == 4
    _interrupting_step(monkeypatch, at_step=2, times=1, signum=signum)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signum)}
    with pytest.raises(TrainingInterrupted, match=rf"^stopped by {name} after step 2 of 4, saved in .*"
                                                  r"checkpoint-000002.pt$") as info:
        fit(prepare(small_config(tmp_path / "stopped", steps=4, save_every=4)))
    assert info.value.clean and info.value.step == 2
    assert {s: signal.getsignal(s) for s in before} == before
    monkeypatch.undo()
    assert train(small_config(tmp_path / "stopped", steps=4, save_every=4, resume=True)).steps == 4
    final = [ckpt.read_state(ckpt.list_checkpoints(tmp_path / run_name / "run" / "checkpoints")[-1][1])
             for run_name in ("straight", "stopped")]
    assert final[0]["step"] == final[1]["step"] == 4
    assert all(torch.equal(final[0]["model"][k], final[1]["model"][k]) for k in final[0]["model"])


def test_a_second_stop_signal_abandons_the_step(tmp_path, monkeypatch):
    _interrupting_step(monkeypatch, at_step=3, signums=[signal.SIGTERM, signal.SIGUSR1])
    with pytest.raises(TrainingInterrupted, match=r"stopped at once by a second SIGUSR1 after 2 of 4 steps"):
        fit(prepare(small_config(tmp_path, steps=4, save_every=2)))


def test_a_second_ctrl_c_abandons_the_step(tmp_path, monkeypatch):
    _interrupting_step(monkeypatch, at_step=3, times=2)
    with pytest.raises(TrainingInterrupted, match=r"stopped at once by a second Ctrl-C after 2 of 4 steps; the newest "
                                                  r"checkpoint is .*checkpoint-000002.pt \(step 2\), later steps are "
                                                  r"lost$") as info:
        fit(prepare(small_config(tmp_path, steps=4, save_every=2)))
    assert not info.value.clean and info.value.step == 2
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


@pytest.mark.parametrize("signum, by", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_a_stop_signal_to_a_real_process_saves_and_resumes(tmp_path, signum, by):
    """SIGINT (a terminal's Ctrl-C) or SIGTERM (a scheduler's stop) to ``python -m grpo_fast train`` after its first
    step: exit 130, no traceback, a checkpoint of the step it stopped at, and the printed resume command continues
    from it."""
    out = tmp_path / "run"
    argv = ["train", *TINY[2:], "--steps", "1000", "--output-dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "grpo_fast", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and read_steps(out / "metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert f"{by}: stopping after this step, with a checkpoint" in stderr
    last = stderr.strip().splitlines()[-1]
    step = read_steps(out / "metrics.jsonl")[-1]["step"]
    saved = ckpt.checkpoint_path(out / "checkpoints", step)
    assert last.startswith(f"grpo-fast train: stopped by {by} after step {step} of 1000, saved in {saved}; "
                           "resume with: python -m grpo_fast train ")
    assert last.endswith(" --resume") and saved.exists()
    # the printed command, one more step, continues from the checkpoint
    command = last.split("resume with: python -m grpo_fast ")[1].split()
    command[command.index("--steps") + 1] = str(step + 1)
    assert main(command) == 0
    assert [s["step"] for s in read_steps(out / "metrics.jsonl")] == list(range(1, step + 2))


def test_ctrl_c_before_the_first_step_is_one_line(tmp_path, capsys, monkeypatch):
    from grpo_fast.train import lifecycle

    def interrupted(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "evaluate", interrupted)  # Ctrl-C in the before-evaluation
    out = tmp_path / "run"
    assert main(["train", *TINY, "--output-dir", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "grpo-fast train: interrupted before the first step; nothing was trained or saved"
    assert not out.exists()  # the rerun needs no --overwrite, and no empty directory is left behind


def test_a_stop_with_nothing_saved_says_to_start_again(tmp_path, capsys, monkeypatch):
    """A second Ctrl-C before the first checkpoint leaves nothing to resume: the message says to start again with
    --overwrite, not to --resume (which would start from step 0 and look like a resume)."""
    import grpo_fast.train as train
    from grpo_fast.train.lifecycle import TrainingInterrupted

    def stopped(prepared):
        raise TrainingInterrupted("stopped at once by a second Ctrl-C after 0 of 1 steps; no checkpoint was saved",
                                  0, None, clean=False)

    monkeypatch.setattr(train, "fit", stopped)
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--output-dir", out]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"nothing to resume: start again with: grpo-fast train {' '.join(TINY)} --output-dir {out} "
                        "--overwrite"), err
    assert "--resume" not in err


# ------------------------------------------------------------------------------------------------ first contact


def _last_error_line(capsys, argv, code, command="train") -> str:
    """main(argv) exits with ``code`` and stderr holds one error line (the last), no traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    errors = [line for line in err if line.startswith(f"grpo-fast {command}: error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err
    return errors[0]


@pytest.mark.parametrize("tokenizer", ["none", "config only"])
def test_a_model_directory_without_a_tokenizer_is_one_line(tokenizer, tmp_path, capsys):
    """A config.json and weights but no tokenizer: AutoTokenizer would build an empty one that encodes every prompt
    to no tokens (a 60-frame reshape error later); train and eval name the directory instead."""
    from grpo_fast.train.tasks import tiny_model, tiny_tokenizer

    model_dir = tmp_path / "model"
    tiny_model(tiny_tokenizer(), seed=0).save_pretrained(model_dir)
    if tokenizer == "config only":  # a tokenizer_config.json naming a class, and no vocabulary beside it
        (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    missing = {"none": f"{model_dir} holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model "
                       "or vocab file)",
               "config only": f"the tokenizer in {model_dir} has no vocabulary (Qwen2Tokenizer encodes "}[tokenizer]
    line = _last_error_line(capsys, ["train", *TINY, "--model", str(model_dir), "--output-dir",
                                     str(tmp_path / "run")], 2)
    assert line.startswith(f"grpo-fast train: error: --model: {missing}"), line
    assert line.endswith(f"save the model's tokenizer there with tokenizer.save_pretrained('{model_dir}')")
    line = _last_error_line(capsys, ["eval", "--model", str(model_dir), "--dataset", "builtin:digits", "--output",
                                     str(tmp_path / "eval.json")], 2, command="eval")
    assert missing in line


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_model_weights_are_one_line_naming_the_file(damage, tmp_path, capsys):
    """train --model DIR with an empty or truncated model.safetensors: the check eval makes (a raw SafetensorError
    traceback otherwise), one line naming --model and the file; nothing written."""
    from train_helpers import save_local_model

    model = save_local_model(tmp_path / "model", "qwen2", None)
    weights = Path(model) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    reason = {"empty": "header too small", "truncated": "incomplete metadata, file not fully covered"}[damage]
    out = tmp_path / "run"
    line = _last_error_line(capsys, ["train", *TINY, "--model", model, "--output-dir", str(out)], 2)
    assert line == (f"grpo-fast train: error: --model: {weights} cannot be read (SafetensorError: Error while "
                    f"deserializing header: {reason}); an empty or truncated copy? Export or copy the model again")
    assert not out.exists()


REWARDS = '''calls = 0


def flaky(prompts, completions, **kwargs):
    global calls
    calls += 1  # the before-evaluation is call 1, step s is call s + 1
    if calls == FAIL_AT:
        return [float(kwargs["answer_typo"]) for _ in completions]
    return [float(len(c)) for c in completions]
'''


def _flaky_rewards(tmp_path, fail_at: int) -> str:
    path = tmp_path / f"rewards_{fail_at}.py"  # one module per file: the import is cached by its path
    path.write_text(f"FAIL_AT = {fail_at}\n" + REWARDS)
    return f"{path}:flaky"


def _raising_line(spec: str) -> str:
    """``file:line`` of the line that raises in ``_flaky_rewards``' file."""
    file = spec.rpartition(":")[0]
    lines = Path(file).read_text().splitlines()
    return f"{file}:{next(i for i, line in enumerate(lines, 1) if 'answer_typo' in line)}"


def test_a_reward_that_raises_mid_run_is_one_line_and_the_run_resumes(tmp_path, capsys):
    """KeyError in step 3: one line naming the function, its file and line, the exception and the step; step 2 is
    saved, and the printed command resumes it to the numbers of a run that never failed."""
    spec = _flaky_rewards(tmp_path, fail_at=4)
    out = tmp_path / "run"
    argv = ["train", *TINY[2:], "--steps", "4", "--rewards", spec, "--output-dir", str(out)]
    line = _last_error_line(capsys, argv, 1)
    saved = ckpt.checkpoint_path(out / "checkpoints", 2)
    assert line == (f"grpo-fast train: error: reward_func flaky ({_raising_line(spec)}) raised KeyError: "
                    f"'answer_typo' at step 3; resume from {saved}: fix the function, then run: "
                    f"{resume_command(argv)} (--debug: the traceback)")
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [2]
    # the module's counter is past the failure now: the same command with --resume runs steps 3 and 4
    assert main(resume_command(argv).split()[1:]) == 0
    clean = tmp_path / "clean"
    assert main(["train", *TINY[2:], "--steps", "4", "--rewards", _flaky_rewards(tmp_path, fail_at=0),
                 "--output-dir", str(clean)]) == 0

    def steps(run):
        return [{k: v for k, v in s.items() if not k.startswith("time_")} for s in read_steps(run / "metrics.jsonl")]

    assert [s["step"] for s in steps(out)] == [1, 2, 3, 4] and steps(clean)[2]["loss"] != 0
    assert steps(out) == steps(clean)  # sampler and RNG as after step 2: the same steps 3 and 4


def test_a_reward_that_raises_in_step_1_saves_nothing_and_the_rerun_needs_no_overwrite(tmp_path, capsys):
    spec = _flaky_rewards(tmp_path, fail_at=2)
    out = tmp_path / "run"
    argv = ["train", *TINY, "--rewards", spec, "--output-dir", str(out)]
    line = _last_error_line(capsys, argv, 1)
    assert "raised KeyError: 'answer_typo' at step 1; nothing was trained or saved: fix the function and run the " \
           "same command again" in line
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert main(argv) == 0  # the counter is past the failure; the same command, no --overwrite


def test_a_reward_that_raises_in_the_evaluation_and_debug_shows_the_traceback(tmp_path, capsys):
    spec = _flaky_rewards(tmp_path, fail_at=1)
    argv = ["train", *TINY, "--rewards", spec, "--output-dir", str(tmp_path / "run"), "--debug"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"grpo-fast train: error: reward_func flaky ({_raising_line(spec)}) ") and err[-1].endswith(
        "raised KeyError: 'answer_typo' in the evaluation before training; nothing was trained or saved: fix the "
        "function and run the same command again")
    assert err[0] == "Traceback (most recent call last):" and err[-2] == "KeyError: 'answer_typo'"
    file, line = _raising_line(spec).rsplit(":", 1)
    assert f'File "{file}", line {line}, in flaky' in "\n".join(err)


@pytest.mark.parametrize("third_call, line, told", [
    ("raise SystemExit('bye')", 8, "raised SystemExit: bye"),
    ("return completions[:1]", 4, "returned a bad value: reward function 'flaky' returned 1 scores for 4 completions"),
    ("return [float('nan')] * len(completions)", 4, "returned a bad value: reward function 'flaky' returned the "
                                                    "non-finite score nan at index 0: return None to leave a sample "
                                                    "unscored"),
    ("return 'abc'", 4, "returned a bad value: reward function 'flaky' must return a list of 4 floats (or None), got "
                        "str"),
])
def test_a_reward_that_fails_mid_run_saves_the_finished_steps(tmp_path, capsys, third_call, line, told):
    """A reward function that fails at its third call (step 2): SystemExit (sys.exit in it), handled like any
    exception from one, or an output that is no list of one score per completion (too few, NaN, a string), which
    used to stop the run with a traceback and nothing saved. One line naming the function, its line and the step,
    and step 1 saved to resume from."""
    rewards = tmp_path / "flaky_rewards.py"
    rewards.write_text("calls = 0\n\n\ndef flaky(prompts, completions, **kwargs):\n    global calls\n"
                       "    calls += 1  # the before-evaluation is call 1\n    if calls == 3:\n"
                       f"        {third_call}\n    return [float(len(c)) for c in completions]\n")
    out = tmp_path / "run"
    argv = ["train", *TINY[2:], "--steps", "3", "--rewards", f"{rewards}:flaky", "--output-dir", str(out)]
    saved = ckpt.checkpoint_path(out / "checkpoints", 1)
    assert _last_error_line(capsys, argv, 1) == (
        f"grpo-fast train: error: reward_func flaky ({rewards}:{line}) {told} at step 2; resume from {saved}: fix the "
        f"function, then run: {resume_command(argv)} (--debug: the traceback)")
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [1]


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    """--resume of a run that did all its steps and its evaluation: one line, exit 0, no step, no evaluation, no
    file rewritten (a scheduler may rerun a finished job); --steps above it continues as before."""
    out = tmp_path / "run"
    argv = ["train", *TINY, "--output-dir", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    assert main([*argv, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"grpo-fast train: the run in {out} is complete (1 of 1 steps, evaluated: held-out reward " in printed
    assert "nothing was run or changed; --resume with --steps above 1 continues it" in printed
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == files
    assert main([*argv, "--resume", "--steps", "2"]) == 0
    assert [r["step"] for r in read_steps(out / "metrics.jsonl")] == [1, 2]


def test_a_file_dataset_without_a_held_out_set_says_so(tmp_path, capsys):
    """A file dataset and no --eval-dataset: nothing to evaluate, and the summary says how to get a held-out set
    instead of reading as if prompts had been scored and failed."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"max {i} 2=", "answer": str(max(i, 2))}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    assert main(["train", *TINY, "--dataset", str(data), "--output-dir", str(out)]) == 0
    assert ("held-out reward n/a -> n/a (no held-out set: a file dataset is evaluated with --eval-dataset FILE); "
            in capsys.readouterr().out)


def test_a_reward_that_scores_nothing_reads_n_a(tmp_path, capsys):
    rewards = tmp_path / "unscored.py"
    rewards.write_text("def unscored(prompts, completions, **kwargs):\n    return [None] * len(completions)\n")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--rewards", f"{rewards}:unscored", "--output-dir", str(out)]) == 0
    assert "held-out reward n/a -> n/a (n/a: no held-out prompt was scored); " in capsys.readouterr().out
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["eval_before"] is None


@pytest.mark.parametrize("suffix, text, flag, expected", [
    (".toml", "[loss]\nepsilon = -1.0\n", [], "loss.epsilon must be >= 0.0, got -1.0"),
    (".yaml", "loss:\n  loss_type: foo\n", [], "loss.loss_type must be one of "),
    (".toml", "steps = 0\n", [], "steps must be an int >= 1, got 0"),
    (".toml", "[loss]\ntemperature = 0.5\n", [], "loss.temperature is set by the trainer"),
    (".yaml", "reward-weights: [1, .nan]\n", [], "reward-weights must be finite numbers, got [1.0, nan]"),
    (".toml", "temperature = 1e-40\n", [], "temperature must be in [0.01, 3.4e+38], got 1e-40: "),
    (".toml", "[loss]\nepsilon = -1.0\n", ["--loss.epsilon", "-2"], "--loss.epsilon must be >= 0.0, got -2.0"),
])
def test_a_bad_value_in_a_config_file_names_the_file(suffix, text, flag, expected, tmp_path, capsys):
    """Values the loss's or the trainer's own checks refuse name the file they came from; a flag over the file's
    value names the flag."""
    config = tmp_path / f"c{suffix}"
    config.write_text(text)
    line = _last_error_line(capsys, ["train", "--config", str(config), *flag, "--output-dir",
                                     str(tmp_path / "run")], 2)
    prefix = "grpo-fast train: error: " + ("" if flag else f"--config {config}: ")
    assert line.startswith(prefix + expected), line


def test_the_default_run_prints_no_duplicate_line_no_library_bar_and_logs_above_the_bar(tmp_path):
    """A real process, as a user runs it (stderr a terminal, so the progress bar is on; a local model that loads
    weights): the shared-prefix line once, no transformers bars, and every log line on a line of its own (not after
    the progress bar's text)."""
    import fcntl
    import pty
    import re
    import struct
    import termios
    import threading

    from train_helpers import save_local_model

    model = save_local_model(tmp_path / "model", "qwen2", None)
    master, terminal = pty.openpty()  # stderr a terminal: a pipe gets plain progress lines instead of the bar
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns for the bar
    chunks: list[bytes] = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child's side closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "grpo_fast", "train", *TINY[:-4], "--steps", "2", "--model", model,
                           "--output-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=terminal,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(terminal)
    reader.join(timeout=30)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")  # the terminal's newline
    assert proc.returncode == 0, err[-3000:]
    assert err.count("shared prefix: attention implementation") == 1, err
    assert "Loading weights" not in err and "Writing model shards" not in err, err
    assert "grpo-fast:" in err  # the bar is there
    logged = [line for line in err.split("\n") if "grpo_fast.train:" in line]
    assert any("shared-prefix forward on at step 1" in line for line in logged), err
    for line in logged:  # what the terminal shows of a line is what follows its last carriage return
        assert re.match(r"\d\d:\d\d:\d\d grpo_fast\.train: ", line.rsplit("\r", 1)[-1]), repr(line)


def test_a_tokenizer_directory_that_is_not_there_is_one_line(tmp_path, capsys):
    from train_helpers import save_local_model

    model = save_local_model(tmp_path / "model", "qwen2", None)
    line = _last_error_line(capsys, ["train", *TINY, "--model", model, "--tokenizer", str(tmp_path / "nope"),
                                     "--output-dir", str(tmp_path / "run")], 2)
    assert line == (f"grpo-fast train: error: --tokenizer: expected a directory holding a tokenizer, got "
                    f"'{tmp_path / 'nope'}' (not a directory; grpo-fast never downloads)")
