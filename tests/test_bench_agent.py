"""bench/bench_agent.py and bench/agent_trl.py: the compact format as a chat template writes, to TRL, exactly the
tokens grpo-fast's compact format writes, and the TRL arm maps every option and runs."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("trl")

from bench import agent_trl, bench_agent  # noqa: E402
from bench.bench_peer import trl_args  # noqa: E402
from grpo_fast.agents import CompactFormat, ToolCall, as_tool  # noqa: E402
from grpo_fast.train.tasks import calc, tiny_tokenizer  # noqa: E402


@pytest.fixture
def tokenizer():
    return agent_trl.compact_chat_template(tiny_tokenizer("calc"))


def _render(tokenizer, messages, generation_prompt):
    return list(tokenizer.apply_chat_template(messages, tools=[as_tool(calc).schema], tokenize=True,
                                              add_generation_prompt=generation_prompt, return_dict=False))


def test_the_compact_template_writes_the_compact_format(tokenizer):
    schema = as_tool(calc).schema
    fmt = CompactFormat(tokenizer, [schema], [tokenizer.eos_token_id])
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    user = [{"role": "user", "content": "37*408="}]
    assert _render(tokenizer, user, True) == encode("37*408=")  # no header, no tool listing
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "37*408"}}}]}
    head = _render(tokenizer, user + [call], False)
    assert head == encode("37*408=37*408<call>")
    full = _render(tokenizer, user + [call, {"role": "tool", "name": "calc", "content": "15096"}], True)
    # TRL's tool suffix (the render with the tool message minus the one without) is the compact format's
    assert full[: len(head)] == head and full[len(head):] == fmt.suffix_ids([("calc", "15096")])
    turn = encode("37*408<call>")
    parsed = tokenizer.parse_response(turn, prefix=encode("37*408="), tools=[schema])
    assert parsed["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expression": "37*408"}}
    assert fmt.calls(turn, encode("37*408=")) == [ToolCall("calc", {"expression": "37*408"})]  # grpo-fast reads it alike
    final = tokenizer.parse_response(encode("15096") + [tokenizer.eos_token_id], prefix=[], tools=[schema])
    assert not final.get("tool_calls")


def test_the_trl_arm_maps_every_option_but_the_warm_up(tmp_path):
    config = bench_agent.task_config("trl", steps=3, seed=1, warmup=40, prompts=4, group=8, eval_size=8,
                                     output_dir=str(tmp_path), threads=1)
    with pytest.raises(ValueError, match="sft_warmup_steps"):  # TRL has no warm-up: it starts from its result
        trl_args(config, str(tmp_path / "trl"))
    args = trl_args(dataclasses.replace(config, sft_warmup_steps=0, max_tool_calling_iterations=3),
                    str(tmp_path / "trl"))
    assert (args["max_completion_length"], args["num_generations"], args["max_tool_calling_iterations"]) == (24, 8, 3)


def test_the_trl_arm_runs_from_the_warmed_up_weights():
    result = bench_agent.run_trl(steps=2, seed=0, warmup=40, prompts=4, group=8, eval_size=8, eval_every=1,
                                 threads=1)
    ours = bench_agent.run_grpo_fast("grpo_fast", steps=1, seed=0, warmup=40, prompts=4, group=8, eval_size=8,
                                     eval_every=1, threads=1)
    assert result["held_out"][0] == ours["held_out"][0] > 0.3  # the same start, judged the same way
    assert sorted(result["held_out"]) == [0, 1, 2]
    assert [c["step"] for c in result["curve"]] == [1, 2]
    assert all(c["call_frequency"] > 0.5 for c in result["curve"])
