"""``grpo-fast eval`` (grpo_fast/train/evaluation.py): the run's own evaluation for a saved model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from train_helpers import small_config, unwritable_path

from grpo_fast.cli import main
from grpo_fast.train import fit, prepare


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    prepared = prepare(small_config(tmp, steps=3, eval_size=32))
    summary = fit(prepared)
    return summary, tmp / "run" / "model"


def _eval(tmp_path, capsys, *args):
    out = tmp_path / "eval.json"
    assert main(["eval", *args, "--output", str(out)]) == 0, capsys.readouterr().err
    return json.loads(out.read_text()), capsys.readouterr().out


def test_greedy_eval_of_the_saved_model_is_the_runs_eval_after(trained, tmp_path, capsys):
    summary, model_dir = trained
    result, printed = _eval(tmp_path, capsys, "--model", str(model_dir), "--dataset", "builtin:digits",
                            "--limit", "32")
    assert result["decoding"] == "greedy" and result["samples"] == 1 and result["prompts"] == 32
    assert result["max_new_tokens"] == 3  # the run's, from the model's generation_config.json
    assert result["mean@1"] == summary.eval_after
    assert len(result["per_prompt"]) == 32 and all(len(p["rewards"]) == 1 for p in result["per_prompt"])
    assert result["pass@1"] == sum(p["rewards"][0] >= 1.0 for p in result["per_prompt"]) / 32
    assert "| mean@1 (mean reward)" in printed and f"{summary.eval_after:.4f}" in printed


def test_a_runs_model_is_scored_with_the_runs_rewards(trained, tmp_path, capsys, caplog):
    """No --rewards: the run's own rewards and weights (its config.json next to model/), logged; --rewards wins."""
    import logging
    import shutil

    _, model_dir = trained
    run = tmp_path / "myrun"
    shutil.copytree(model_dir, run / "model")
    config = json.loads((model_dir.parent / "config.json").read_text())
    config.update(rewards=["exact", "tests/train_helpers.py:starts_with_seven"], reward_weights=[1.0, 0.5])
    (run / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="grpo_fast.eval"):
        result, _ = _eval(tmp_path, capsys, "--model", str(run / "model"), "--dataset", "builtin:digits", "--limit", "4")
    assert (result["rewards"], result["reward_weights"]) == (config["rewards"], [1.0, 0.5])
    assert any("scoring with the run's rewards exact,tests/train_helpers.py:starts_with_seven" in r.getMessage()
               for r in caplog.records)
    result, _ = _eval(tmp_path, capsys, "--model", str(run / "model"), "--dataset", "builtin:digits", "--limit", "4",
                      "--rewards", "math")
    assert (result["rewards"], result["reward_weights"]) == (["math"], [1.0])
    shutil.copytree(run / "model", tmp_path / "elsewhere")  # not a run's model/: the train default
    result, _ = _eval(tmp_path, capsys, "--model", str(tmp_path / "elsewhere"), "--dataset", "builtin:digits",
                      "--limit", "4")
    assert result["rewards"] == ["math"]


def test_sampled_eval_reports_mean_and_pass_at_k(trained, tmp_path, capsys):
    _, model_dir = trained
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"max {a} {b} 2=", "answer": str(max(a, b, 2))}) + "\n"
                            for a, b in [(1, 5), (7, 3), (0, 0), (9, 8), (4, 6)]))
    args = ("--model", str(model_dir), "--dataset", str(data), "--prompt-column", "question", "--samples", "4",
            "--rewards", "math,tests/train_helpers.py:starts_with_seven", "--reward-weights", "1,0.5")
    result, printed = _eval(tmp_path, capsys, *args)
    assert result["decoding"] == "sampled" and result["temperature"] == 1.0 and result["prompts"] == 5
    rewards = [p["rewards"] for p in result["per_prompt"]]
    assert [len(r) for r in rewards] == [4] * 5
    assert result["mean@4"] == pytest.approx(sum(map(sum, rewards)) / 20, rel=1e-12)
    assert result["pass@4"] == sum(max(r) >= 1.0 for r in rewards) / 5
    assert {v for r in rewards for v in r} <= {0.0, 0.5, 1.0, 1.5}
    for p in result["per_prompt"]:  # each function's own score, the weighted total their sum
        math_, seven = p["scores"]["math"], p["scores"]["tests/train_helpers.py:starts_with_seven"]
        assert p["rewards"] == [m + 0.5 * s for m, s in zip(math_, seven)]
        assert seven == [float(c.startswith("7")) for c in p["completions"]]
    assert "| pass@4 (reward >= 1)" in printed
    again, _ = _eval(tmp_path, capsys, *args)  # seeded: the same samples
    assert again["per_prompt"] == result["per_prompt"]


@pytest.mark.parametrize("args,flag", [
    ([], "--model"),
    (["--model", "MODEL"], "--dataset"),
    (["--model", "nowhere", "--dataset", "builtin:digits"], "--model"),
    (["--model", "MODEL", "--dataset", "missing.jsonl"], "--dataset"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--samples", "0"], "--samples"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--samples", "two"], "--samples"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--samples", "4", "--temperature", "0"], "--temperature"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--top-p", "0"], "--top-p"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--reward-weights", "1,2"], "--reward-weights"),
    (["--model", "MODEL", "--dataset", "builtin:digits", "--rewards", "nosuch"], "nosuch"),
])
def test_bad_input_is_one_line_naming_the_flag(trained, capsys, args, flag):
    _, model_dir = trained
    args = [str(model_dir) if a == "MODEL" else a for a in args]
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("grpo-fast eval: error: ") and flag in err, err


@pytest.mark.parametrize("damage", ["empty", "truncated", "missing"])
def test_damaged_or_missing_weights_are_one_line_naming_the_file(trained, tmp_path, capsys, damage):
    """An empty or truncated model.safetensors (a raw SafetensorError otherwise), or none at all (random weights
    from config.json otherwise): exit code 2, one line naming the file, before anything is evaluated."""
    _, model_dir = trained
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    assert main(["eval", "--model", str(copy), "--dataset", "builtin:digits", "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    expected = {
        "empty": f"--model: {weights} cannot be read (SafetensorError: Error while deserializing header: header too "
                 "small); an empty or truncated copy?",
        "truncated": f"--model: {weights} cannot be read (SafetensorError: Error while deserializing header: "
                     "incomplete metadata, file not fully covered); an empty or truncated copy?",
        "missing": f"--model: {copy} holds no weights (no model.safetensors)",
    }[damage]
    assert "\n" not in err and err.startswith(f"grpo-fast eval: error: {expected}"), err
    assert not (copy / "eval.json").exists()


def test_results_go_into_the_model_directory_not_the_current_one(trained, tmp_path, capsys, monkeypatch):
    _, model_dir = trained
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["eval", "--model", str(copy), "--dataset", "builtin:digits", "--limit", "4"]) == 0
    printed = capsys.readouterr().out
    assert list(cwd.iterdir()) == [] and f"results: {copy / 'eval.json'}" in printed
    result = json.loads((copy / "eval.json").read_text())
    assert result["prompts"] == 4 and len(result["per_prompt"]) == 4


def test_an_unwritable_output_is_refused_before_the_evaluation(trained, tmp_path, capsys):
    _, model_dir = trained
    output = f"{unwritable_path(tmp_path)}/eval.json"
    assert main(["eval", "--model", str(model_dir), "--dataset", "builtin:digits", "--output", output]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"grpo-fast eval: error: --output: cannot create or write in "
                                              f"{Path(output).parent} ("), err


@pytest.mark.parametrize("args,expected", [
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    (["--reward-weights", "nan"], "--reward-weights must be finite numbers, got [nan]"),
    (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16; got 'int8'"),
])
def test_trainer_field_errors_name_the_eval_flag(trained, capsys, args, expected):
    _, model_dir = trained
    assert main(["eval", "--model", str(model_dir), "--dataset", "builtin:digits", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"grpo-fast eval: error: {expected}", err


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for phrase in ("--samples", "mean@K", "pass@K", "--temperature", "eval_after", "--base-model"):
        assert phrase in text, phrase


UNSCORED = "def unscored(prompts, completions, **kwargs):\n    return [None] * len(completions)\n"
RAISES = "def raises(prompts, completions, **kwargs):\n    return [float(kwargs['answer_typo']) for _ in completions]\n"


def test_an_unscored_evaluation_reads_n_a_and_writes_null(trained, tmp_path, capsys):
    """A reward that scores nothing: mean@K and pass@K are n/a (null in eval.json) and every reward null, not 0."""
    _, model_dir = trained
    (tmp_path / "unscored.py").write_text(UNSCORED)
    result, printed = _eval(tmp_path, capsys, "--model", str(model_dir), "--dataset", "builtin:digits", "--limit",
                            "3", "--samples", "2", "--rewards", f"{tmp_path / 'unscored.py'}:unscored")
    assert result["mean@2"] is None and result["pass@2"] is None
    assert [p["rewards"] for p in result["per_prompt"]] == [[None, None]] * 3
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in printed.splitlines()[2:-1]}
    assert rows["mean@2 (mean reward)"] == rows["pass@2 (reward >= 1)"] == "n/a (no completion was scored)"


def test_a_reward_that_raises_is_exit_1_as_in_train_and_debug_shows_the_traceback(trained, tmp_path, capsys):
    _, model_dir = trained
    (tmp_path / "raising.py").write_text(RAISES)
    spec = f"{tmp_path / 'raising.py'}:raises"
    argv = ["eval", "--model", str(model_dir), "--dataset", "builtin:digits", "--limit", "2", "--rewards", spec,
            "--output", str(tmp_path / "eval.json")]
    expected = (f"grpo-fast eval: error: reward_func raises ({tmp_path / 'raising.py'}:2) raised KeyError: "
                "'answer_typo' in the evaluation; nothing was written: fix the function and run the same command "
                "again")
    assert main(argv) == 1
    assert capsys.readouterr().err.strip() == expected + " (--debug: the traceback)"
    assert main([*argv, "--debug"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):" and err[-2] == "KeyError: 'answer_typo'", err
    assert err[-1] == expected and f'File "{tmp_path / "raising.py"}", line 2, in raises' in "\n".join(err)
    assert not (tmp_path / "eval.json").exists()


def test_a_prompt_column_the_builtin_records_lack_is_one_line(trained, capsys):
    _, model_dir = trained
    assert main(["eval", "--model", str(model_dir), "--dataset", "builtin:digits", "--prompt-column", "nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "grpo-fast eval: error: --prompt-column: expected a column of builtin:digits's records ('prompt', 'answer'; "
        "the prompt is 'prompt'), got 'nope'")
