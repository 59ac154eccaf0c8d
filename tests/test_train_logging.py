"""What a run shows as it trains: plain progress lines when stderr is a file, completions.jsonl and its printout
(``--log-completions-every``), the plot redrawn at every checkpoint with the run in its title and a smoothed,
labelled KL panel, and the completions in ``grpo-fast eval``'s eval.json."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
import torch
from train_helpers import small_config

from grpo_fast import group_advantages
from grpo_fast.cli import main
from grpo_fast.train import fit, lifecycle, prepare
from grpo_fast.train.metrics import plot_metrics, read_steps, smooth
from grpo_fast.train.reporting import ProgressLines, duration, progress
from grpo_fast.train.rewards import math_reward


def test_stderr_not_a_terminal_gets_lines_a_terminal_gets_the_bar(tmp_path):
    config = small_config(tmp_path, progress="true", log_every=2)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress(config, 0, stream=io.StringIO()), ProgressLines)
    bar = progress(config, 0, stream=Terminal())
    assert not isinstance(bar, ProgressLines)
    bar.close()
    assert progress(small_config(tmp_path, progress="false"), 0, stream=io.StringIO()).bar.disable is True


def test_a_progress_line_says_step_reward_kl_loss_step_time_and_eta():
    lines = ProgressLines(total=800, initial=0, every=10)
    lines.step = 40
    metrics = {"reward": 0.3125, "kl": 0.00213, "loss": 0.0134}
    assert lines.line(metrics, elapsed=8.4) == ("step 40/800 (5%) | reward 0.3125 | kl 0.0021 | loss 0.0134 | "
                                                "0.21 s/step | ETA 2m40s")
    assert "kl" not in lines.line({"reward": 0.5, "loss": 0.1}, 1.0)  # beta = 0: no KL
    assert "loss n/a" in lines.line({"reward": 0.5, "kl": None, "grad_norm": float("nan")}, 1.0)  # a skipped update
    resumed = ProgressLines(total=100, initial=50, every=1)
    resumed.step = 60
    assert resumed.line({}, elapsed=20.0).endswith("| 2 s/step | ETA 1m20s")  # this process's steps only
    assert [duration(s) for s in (42, 187, 7500)] == ["42s", "3m07s", "2h05m"]


def test_a_run_logged_to_a_file_has_one_plain_line_every_log_every_steps(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_fast", "train", "--steps", "5", "--prompts-per-step", "2", "--group-size", "4",
         "--eval-size", "4", "--max-new-tokens", "2", "--output-dir", str(tmp_path / "run"), "--plot", "false",
         "--log-every", "2", "--loss.beta", "0.04"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if " | reward " in line]
    assert [line.split("grpo_fast.train: ")[1].split(" |")[0] for line in lines] == [
        "step 2/5 (40%)", "step 4/5 (80%)", "step 5/5 (100%)"]  # every 2 steps, and the last
    for line in lines:
        assert all(f" | {field} " in line for field in ("kl", "loss")) and " s/step | ETA " in line


def test_the_plot_is_redrawn_at_every_checkpoint(tmp_path, monkeypatch):
    drawn = []
    real = lifecycle.plot_metrics

    def recording(metrics_path, png_path):
        drawn.append([r["step"] for r in read_steps(metrics_path)][-1])
        return real(metrics_path, png_path)

    monkeypatch.setattr(lifecycle, "plot_metrics", recording)
    fit(prepare(small_config(tmp_path, steps=5, save_every=2, plot="true")))
    assert drawn == [2, 4, 5] and (tmp_path / "run" / "reward_kl.png").stat().st_size > 0
    assert not list((tmp_path / "run").glob(".*.tmp"))


def test_the_plot_names_the_run_and_smooths_and_labels_the_kl(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    config = {"model": "tiny", "dataset": "builtin:median", "rewards": ["math", "format"], "reward_weights": [1, 0.5],
              "run_name": "exp-7"}
    kl = [0.001 * i * (1 + (-1) ** i * 0.5) for i in range(1, 41)]
    rows = [{"event": "start", "eval_before": 0.1, "config": config}]
    rows += [{"event": "step", "step": i + 1, "reward": i / 40, "kl": v} for i, v in enumerate(kl)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_metrics(path, tmp_path / "plot.png") == tmp_path / "plot.png"
    (fig,) = figures
    assert fig._suptitle.get_text() == "exp-7; model tiny; data builtin:median; rewards math x 1, format x 0.5"
    reward_ax, kl_ax = fig.axes
    assert reward_ax.get_title() == "training reward, to step 40; held-out 0.100 before training"
    raw, smoothed = kl_ax.get_lines()
    assert list(raw.get_ydata()) == kl and list(smoothed.get_ydata()) == pytest.approx(smooth(kl))
    assert kl_ax.get_title() == "KL to the reference model"
    assert (kl_ax.get_xlabel(), kl_ax.get_ylabel()) == ("step", "KL")
    assert [t.get_text() for t in kl_ax.get_legend().get_texts()] == ["KL (step mean)", "KL (moving average)"]


def test_completions_are_logged_every_n_steps_with_rewards_and_advantages(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        fit(prepare(small_config(tmp_path, steps=4, log_completions_every=2, num_completions_to_print=3,
                                 rewards="math,format", reward_weights="1,0.5")))
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] * 16 + [4] * 16  # 4 prompts x 4 completions, at steps 2 and 4
    assert list(rows[0]) == ["step", "prompt", "completion", "math_reward", "format_reward", "reward", "advantage"]
    metrics = {r["step"]: r for r in read_steps(run / "metrics.jsonl")}
    for step in (2, 4):
        mine = [r for r in rows if r["step"] == step]
        assert all(r["prompt"] == mine[4 * (i // 4)]["prompt"] for i, r in enumerate(mine))  # group by group
        for r in mine:  # the total is the functions' weighted sum
            assert r["reward"] == pytest.approx(r["math_reward"] + 0.5 * r["format_reward"])
        totals = torch.tensor([r["reward"] for r in mine])
        expected = group_advantages(torch.tensor([[r["math_reward"], r["format_reward"]] for r in mine]),
                                    group_size=4, reward_weights=torch.tensor([1.0, 0.5])).advantages
        assert torch.tensor([r["advantage"] for r in mine]) == pytest.approx(expected, abs=1e-6)
        assert float(totals.mean()) == pytest.approx(metrics[step]["reward"])
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("  '")]
    assert len(printed) == 6 and all(" | reward " in p and " | advantage " in p for p in printed)
    assert any("step 2: 3 of the step's 16 completions" in r.getMessage() for r in caplog.records)


def test_completions_jsonl_reads_as_one_run_after_a_resume(tmp_path):
    config = dict(steps=4, save_every=2, keep_checkpoints=0, log_completions_every=1)
    fit(prepare(small_config(tmp_path, **config)))
    (tmp_path / "run" / "checkpoints" / "checkpoint-000004.pt").unlink()
    fit(prepare(small_config(tmp_path, **config, resume="true")))
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and [steps.count(s) for s in (1, 2, 3, 4)] == [16] * 4
    fit(prepare(small_config(tmp_path, steps=1, overwrite="true")))  # a new run starts the file over (here: none)
    assert (tmp_path / "run" / "completions.jsonl").read_text() == ""


def test_eval_json_has_each_completion_next_to_its_reward(tmp_path, capsys):
    fit(prepare(small_config(tmp_path, steps=2, eval_size=8)))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"max {a} 3=", "answer": str(max(a, 3))}) + "\n" for a in range(6)))
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tmp_path / "run" / "model"), "--dataset", str(data), "--samples", "3",
                 "--output", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    for record, entry in zip((json.loads(x) for x in data.read_text().splitlines()), result["per_prompt"]):
        assert set(entry) == {"prompt", "rewards", "completions", "scores"} and entry["prompt"] == record["prompt"]
        assert entry["scores"] == {"math": entry["rewards"]}  # the run's one reward, weight 1
        assert len(entry["completions"]) == len(entry["rewards"]) == 3
        scored = math_reward([record["prompt"]] * 3, entry["completions"], [record["answer"]] * 3)
        assert [0.0 if s is None else s for s in scored] == [0.0 if r is None else r for r in entry["rewards"]]
