"""Tools in ``grpo-fast train`` and ``grpo-fast eval``: the options, the built-in tool task with its supervised
warm-up, tools given as functions, an environment's reward and column, a resumed tool run, and the command line.

The sampler's multi-turn loop, the formats and the masks are tested in tests/test_agents.py and
tests/test_lockstep_trl.py; here the pieces run together through the trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from train_helpers import REPO, small_config

from grpo_fast.train import TrainConfig, train
from grpo_fast.train import checkpoint as ckpt
from grpo_fast.train.metrics import read_steps
from grpo_fast.train.tasks import calc

# the calc task at test size: 24 new tokens hold a call, its result and the end of the turn
CALC = dict(dataset="builtin:calc", tools="calc", rewards="last_number", max_new_tokens=24, steps=2,
            sft_warmup_steps=40, prompts_per_step=4, group_size=8, micro_batch_size=16, eval_size=16)


def _steps(run_dir) -> list[dict]:
    return read_steps(run_dir / "metrics.jsonl")


def test_calc_run_calls_its_tool_and_logs_the_calls(tmp_path):
    config = small_config(tmp_path, **CALC)
    summary = train(config)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 2
    for m in steps:  # the warmed-up model calls the tool in most completions
        assert m["tools/call_frequency"] > 0.5, m
        assert 0 <= m["tools/failure_frequency"] <= 1
        assert {"tools/rows_with_calls", "tools/truncated_results", "tools/dropped_results"} <= m.keys()
        # completion_length counts the model's tokens only: a call is at least 5 of them ("10*10<call>")
        assert 5 <= m["completion_length"] <= 24
    # 40 warm-up steps are enough for the greedy held-out answers to come out right often
    assert summary.eval_before is not None and summary.eval_before > 0.3
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["tools"] == ["calc"] and saved["sft_warmup_steps"] == 40
    tokenizer_file = json.loads((tmp_path / "run" / "model" / "tokenizer.json").read_text())
    assert any(t["content"] == "<call>" for t in tokenizer_file["added_tokens"])


def test_the_same_run_without_tools_cannot_multiply(tmp_path):
    config = small_config(tmp_path, **{**CALC, "tools": "", "sft_warmup_steps": 0})
    summary = train(config)
    assert summary.eval_before == 0.0 and summary.eval_after == 0.0
    assert not any(k.startswith("tools/") for k in _steps(tmp_path / "run")[0])


def test_tools_given_as_functions_are_recorded_by_name(tmp_path):
    base = small_config(tmp_path, **CALC)
    config = TrainConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "tools": [calc]})
    summary = train(config)
    assert summary.steps == 2
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["tools"] == ["grpo_fast.train.tasks:calc"]


ENVIRONMENT = '''
class CalcDesk:
    """One row's calculator: it remembers the record's answer and what its tool last returned."""

    seen_columns = set()

    def reset(self, **record):
        CalcDesk.seen_columns.update(record)
        self.answer, self.last = record["answer"], None

    def calc(self, expression: str) -> str:
        """Evaluate integer arithmetic.

        Args:
            expression: integers joined by + - *.
        """
        from grpo_fast.train.tasks import calc
        self.last = calc(expression)
        return self.last

    def get_reward(self) -> float:
        return 1.0 if self.last == self.answer else 0.0


class SpacedDesk(CalcDesk):
    """A desk whose reset() extends the prompt (TRL's rule; the rewards then see the prompt so extended)."""

    def reset(self, **record):
        super().reset(**record)
        return " "


def environments_seen(prompts, completions, environments=None, **kwargs):
    assert environments is not None and len(environments) == len(completions)
    assert all(isinstance(env, CalcDesk) for env in environments)
    assert len({id(env) for env in environments}) == len(environments)  # one instance per row
    assert {"prompt", "answer"} <= CalcDesk.seen_columns  # reset(**record) got the whole record
    # the prompts the rewards see are the ones the model saw: extended where reset() returned a string
    assert all(p.endswith("=" if type(env) is CalcDesk else "= ") for p, env in zip(prompts, environments)), prompts
    return [float(env.last is not None) for env in environments]
'''


@pytest.mark.parametrize("desk", ["CalcDesk", "SpacedDesk"])
def test_an_environment_gives_its_tools_its_reward_and_its_column(tmp_path, desk):
    (tmp_path / "desk.py").write_text(ENVIRONMENT)
    config = small_config(tmp_path, **{**CALC, "tools": "", "environment": f"{tmp_path / 'desk.py'}:{desk}",
                                       "rewards": f"{tmp_path / 'desk.py'}:environments_seen"})
    train(config)  # the warm-up's demonstrations call "calc": the desk's method of that name
    m = _steps(tmp_path / "run")[0]
    assert f"rewards/{desk}" in m and "rewards/environments_seen" in m
    if desk == "CalcDesk":  # the desk's method is the tool the warmed-up model calls (the reward: desks that ran)
        assert m["rewards/environments_seen"] > 0.5 and m["tools/call_frequency"] > 0.5
    # (the warm-up's demonstrations end in "=": after "= " the model rarely calls; the prompts are the point there)


def test_the_environment_reward_alone(tmp_path):
    """--rewards none: the environment's get_reward() is the only reward (TRL's reward_funcs=[])."""
    (tmp_path / "desk.py").write_text(ENVIRONMENT)
    config = small_config(tmp_path, **{**CALC, "tools": "", "rewards": "none",
                                       "environment": f"{tmp_path / 'desk.py'}:CalcDesk"})
    summary = train(config)
    m = _steps(tmp_path / "run")[0]
    assert [k for k in m if k.startswith("rewards/")] == ["rewards/CalcDesk"]
    assert m["reward"] == m["rewards/CalcDesk"]
    assert summary.eval_before is not None and summary.eval_before > 0.3  # held out, by the desk's reward too
    with pytest.raises(ValueError, match="TrainConfig.rewards must name at least one reward function"):
        TrainConfig(rewards=["none"])  # and no environment


def test_the_environment_reward_counts_in_the_held_out_evaluation(tmp_path):
    """The calc desk's reward of a warmed-up model: its greedy calls compute the answer as often as the reward on
    the transcript says (the same calls, judged twice)."""
    (tmp_path / "desk.py").write_text(ENVIRONMENT)
    run = small_config(tmp_path, **{**CALC, "steps": 1})
    train(run)
    from grpo_fast.train.evaluation import EvalOptions, evaluate_model

    def mean(**kw):
        options = EvalOptions(model=str(tmp_path / "run" / "model"), dataset="builtin:calc", max_new_tokens=24,
                              limit=16, **kw)
        return evaluate_model(options)["mean@1"]

    by_transcript = mean(rewards=["last_number"], tools=["calc"])
    by_environment = mean(rewards=["last_number"], reward_weights=[0.0],
                          environment=f"{tmp_path / 'desk.py'}:CalcDesk")
    assert by_transcript > 0.3
    assert by_environment == pytest.approx(by_transcript)
    assert mean(rewards=["last_number"]) == 0.0  # the same model without its tool


def test_a_resumed_tool_run_matches_an_uninterrupted_one(tmp_path):
    """The warm-up runs again on resume (it is seeded), so the reference model the KL term uses is the same."""
    kwargs = dict(CALC, steps=4, **{"loss.beta": "0.05"})
    train(small_config(tmp_path, **kwargs, output_dir=str(tmp_path / "straight")))
    train(small_config(tmp_path, **{**kwargs, "steps": 2}, output_dir=str(tmp_path / "halted"),
                       keep_checkpoints=0))  # (a constant learning rate: steps may change on resume)
    train(small_config(tmp_path, **kwargs, output_dir=str(tmp_path / "halted"), resume=True))

    def final(name):
        return ckpt.read_state(ckpt.list_checkpoints(tmp_path / name / "checkpoints")[-1][1])["model"]

    expected, got = final("straight"), final("halted")
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert [m["kl"] for m in _steps(tmp_path / "halted")] == [m["kl"] for m in _steps(tmp_path / "straight")]
    # another warm-up would make another reference model: refused, not resumed silently
    with pytest.raises(ValueError, match="sft_warmup_steps"):
        train(small_config(tmp_path, **{**kwargs, "steps": 5, "sft_warmup_steps": 20},
                           output_dir=str(tmp_path / "halted"), resume=True))


@pytest.mark.parametrize("field, value, message", [
    ("tools", [""], "TrainConfig.tools must be a list"),
    ("tools", [3], "TrainConfig.tools must be a list"),
    ("environment", "", "TrainConfig.environment must be None"),
    ("max_tool_calling_iterations", 0, "TrainConfig.max_tool_calling_iterations must be an int >= 1 or None"),
    ("max_tool_response_length", True, "TrainConfig.max_tool_response_length must be an int >= 1 or None"),
    ("tool_timeout", float("inf"), "TrainConfig.tool_timeout must be a finite number"),
    ("tool_timeout", 0, "TrainConfig.tool_timeout must be a finite number"),
    ("tool_workers", 0, "TrainConfig.tool_workers must be an int >= 1"),
    ("sft_warmup_steps", -1, "TrainConfig.sft_warmup_steps must be an int >= 0"),
])
def test_bad_tool_options_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("overrides", [
    dict(tools="python"),  # calc's demonstrations call calc
    dict(tools=""),  # no tools at all
])
def test_a_warm_up_without_demonstrations_is_refused(tmp_path, overrides):
    config = small_config(tmp_path, **{**CALC, **overrides})
    with pytest.raises(ValueError, match=r"TrainConfig\.sft_warmup_steps: demonstrations exist for .*builtin:calc "
                                         r"--tools calc"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_the_tiny_model_takes_tools_only_in_a_tool_task(tmp_path):
    config = small_config(tmp_path, **{**CALC, "dataset": "builtin:digits", "rewards": "math"})
    with pytest.raises(ValueError, match=r"TrainConfig\.tools: the tiny model's character tokenizer writes tool "
                                         r"calls only in the built-in tool tasks \(builtin:calc\), got "
                                         r"dataset='builtin:digits'"):
        train(config)


def test_an_unknown_tool_is_refused_before_training(tmp_path):
    config = small_config(tmp_path, **{**CALC, "tools": "calculator"})
    with pytest.raises(ValueError, match="tool.*calculator"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_the_command_line_trains_and_evaluates_with_tools(tmp_path):
    out = tmp_path / "cli"
    flags = ["--dataset", "builtin:calc", "--tools", "calc", "--rewards", "last_number", "--max-new-tokens", "24",
             "--sft-warmup-steps", "40", "--steps", "1", "--prompts-per-step", "2", "--group-size", "4",
             "--eval-size", "8", "--max-tool-calling-iterations", "2", "--max-tool-response-length", "8",
             "--tool-timeout", "5", "--output-dir", str(out), "--progress", "false", "--plot", "false"]
    proc = subprocess.run([sys.executable, "-m", "grpo_fast", "train", *flags], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "agent: tools calc, CompactFormat" in proc.stderr
    assert "supervised warm-up: 40 steps" in proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert (saved["max_tool_calling_iterations"], saved["max_tool_response_length"], saved["tool_timeout"]) == (2, 8, 5.0)
    proc = subprocess.run([sys.executable, "-m", "grpo_fast", "eval", "--model", str(out / "model"), "--dataset",
                           "builtin:calc", "--rewards", "last_number", "--tools", "calc", "--limit", "8",
                           "--max-new-tokens", "24", "--output", str(tmp_path / "eval.json")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["prompts"] == 8 and result["mean@1"] > 0
    proc = subprocess.run([sys.executable, "-m", "grpo_fast", "eval", "--model", str(out / "model"), "--dataset",
                           "builtin:calc", "--rewards", "last_number", "--tools", "calc",
                           "--max-tool-calling-iterations", "x"], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 2 and "--max-tool-calling-iterations: expected an int, got 'x'" in proc.stderr


def test_the_prompt_length_check_counts_the_tools_the_template_renders():
    """The pre-flight check renders each prompt as the rollout will: with the tools' schemas in the template."""
    from agent_fixtures import byte_chat_tokenizer

    from grpo_fast.train.data import render_prompt
    from grpo_fast.train.trainer import check_dataset_prompts

    tok = byte_chat_tokenizer()
    located = [("data.jsonl, line 1", {"prompt": "2*3=", "answer": "6"})]
    bare = len(tok(render_prompt(tok, "2*3="), add_special_tokens=False)["input_ids"])
    config = TrainConfig(model="unused", dataset="data.jsonl", max_prompt_length=bare + 3, tools=[calc])
    assert check_dataset_prompts(TrainConfig(model="unused", dataset="data.jsonl", max_prompt_length=bare + 3),
                                 located, tok) == ("data.jsonl, line 1", bare)
    with pytest.raises(ValueError, match=r"data\.jsonl, line 1: the prompt is \d+ tokens long once rendered, more "
                                         r"than TrainConfig\.max_prompt_length"):
        check_dataset_prompts(config, located, tok)


def test_a_reset_string_extends_the_last_message_whatever_its_role():
    """TRL's rule: appended to ``prompt[-1]``'s content (a new list; the record is left as it was)."""
    from grpo_fast.train.agentic import extend_prompt

    chat = [{"role": "user", "content": "Play."}, {"role": "assistant", "content": "Board:"}]
    assert extend_prompt(chat, " X..") == [chat[0], {"role": "assistant", "content": "Board: X.."}]
    assert chat[1]["content"] == "Board:"
    assert extend_prompt([], "Hi") == [{"role": "user", "content": "Hi"}]
    assert extend_prompt("2*3=", " ") == "2*3= " and extend_prompt(chat, None) is chat


def test_no_reward_source_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "desk.py").write_text(ENVIRONMENT + "\n\nclass Unscored(CalcDesk):\n    get_reward = None\n")
    config = small_config(tmp_path, **{**CALC, "tools": "", "rewards": "none",
                                       "environment": f"{tmp_path / 'desk.py'}:Unscored"})
    with pytest.raises(ValueError, match=r"TrainConfig\.rewards: no reward source; .* environment Unscored without "
                                         r"get_reward\(\)"):
        train(config)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="TrainConfig.rewards: none stands alone"):
        TrainConfig(rewards=["math", "none"])
