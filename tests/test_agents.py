"""Agentic rollouts: tools and environments (TRL's meaning), the tool-call formats, the multi-turn loop inside the
sampler (tool tokens fed through the KV cache, masked from the loss), the python tool and the calc task.

The multi-turn sampler runs a real tiny model with its real KV cache; only the choice of sampled tokens is scripted
(``_next_token`` replaced), so that each row takes a known path (a call, a final answer, results too long to fit, the
iteration cap). The log-probs it records must then equal a fresh teacher-forced forward over the whole transcript on
every sampled token: the cache saw the tool tokens where the transcript has them.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import torch

from agent_fixtures import byte_chat_tokenizer

from grpo_fast.agents import Agent, AgentOptions, CompactFormat, ToolCall, ToolRunner, as_tool, tool_format
from grpo_fast.agents.tools import environment_tools, tool_set
from grpo_fast.logprobs import fused_logprobs
from grpo_fast.train import rollout as rollout_module
from grpo_fast.train.forward import completion_hidden, head_of
from grpo_fast.train.rewards import last_number_reward
from grpo_fast.train.rollout import SamplingParams, generate
from grpo_fast.train.tasks import builtin_records, calc, tiny_model, tiny_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def fails(x: str) -> str:
    """Always raises (a bare LookupError for "bare").

    Args:
        x: ignored.
    """
    raise RuntimeError("the tool broke") if x != "bare" else LookupError()


def sleeps(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "slept"


async def async_add(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first.
        b: the second.
    """
    await asyncio.sleep(0)
    return a + b


class Counter:
    """An environment: a counter per rollout row."""

    def __init__(self):
        self.count = 0

    def reset(self, **record):
        self.count = int(record.get("start", 0))

    def increment(self, by: int) -> int:
        """Increment the counter.

        Args:
            by: how much.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)

    def _private(self):
        return "hidden"


# ------------------------------------------------------------------------------------------------ tools


def test_a_tool_needs_type_hints_and_a_docstring():
    def bare(x):
        return x

    with pytest.raises(ValueError, match=r"tools: tool 'bare' needs a type hint"):
        as_tool(bare)
    tool = as_tool(add)
    assert tool.name == "add" and tool.required == ("a", "b")
    assert tool.schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"


def _run(runner, tools, calls):
    return runner.run([(tool_set([as_tool(t) for t in tools]), calls)])[0]


@pytest.mark.parametrize(("calls", "expected", "failed"), [
    ([ToolCall("add", {"a": 2, "b": 3})], ["5"], [False]),
    ([ToolCall("nope", {})], ["{'error': 'Tool nope not found.'}"], [True]),
    ([ToolCall("add", {"a": 2})], ["{'error': 'add: missing arguments b'}"], [True]),
    ([ToolCall("add", {"a": 2, "b": 3, "c": 4})], ["{'error': 'add: unknown arguments c'}"], [True]),
    ([ToolCall("fails", {"x": "1"})], ["{'error': 'the tool broke'}"], [True]),
    ([ToolCall("fails", {"x": "bare"})], ["{'error': 'LookupError'}"], [True]),  # no message: its type
    ([ToolCall("add", {"a": "2", "b": 3})], None, [True]),  # TypeError inside the tool: its message
    ([ToolCall("async_add", {"a": 1, "b": 1}), ToolCall("add", {"a": 1, "b": 2})], ["2", "3"], [False, False]),
])
def test_tool_calls_and_their_failures_become_messages(calls, expected, failed):
    runner = ToolRunner(workers=2, timeout_s=5.0)
    try:
        out = _run(runner, [add, fails, async_add], calls)
    finally:
        runner.close()
    assert [name for name, _, _ in out] == [c.name for c in calls]
    assert [f for _, _, f in out] == failed
    if expected is not None:
        assert [text for _, text, _ in out] == expected
    else:
        assert out[0][1].startswith("{'error': ") and "str" in out[0][1]


def test_a_tool_that_hangs_times_out_and_rows_run_concurrently():
    runner = ToolRunner(workers=4, timeout_s=0.5)
    try:
        start = time.monotonic()
        (hung,), = runner.run([(tool_set([as_tool(sleeps)]), [ToolCall("sleeps", {"seconds": 30})])])
        assert time.monotonic() - start < 2.0
        assert hung[2] and "timed out after 0.5 s" in hung[1]
        start = time.monotonic()
        rows = runner.run([(tool_set([as_tool(sleeps)]), [ToolCall("sleeps", {"seconds": 0.3})])] * 4)
        assert time.monotonic() - start < 0.3 * 4 * 0.75, "the rows' calls ran one after the other"
        assert [row[0][1] for row in rows] == ["slept"] * 4
    finally:
        runner.close()


def test_an_environment_offers_its_public_methods():
    tools = environment_tools(Counter())
    assert [t.name for t in tools] == ["increment"]

    class Gadgets(Counter):
        limit = 3

        def __init__(self):
            super().__init__()
            self.helper = add  # a callable the instance holds: not one of its methods

        @property
        def state(self):
            raise RuntimeError("a property is never run to list the tools")

    assert [t.name for t in environment_tools(Gadgets())] == ["increment"]  # inherited, bound to the instance
    gadgets = Gadgets()
    assert environment_tools(gadgets)[0].fn(2) == 2 and gadgets.count == 2
    with pytest.raises(TypeError, match="must define a callable reset"):
        environment_tools(object())

    class Clash(Counter):
        def add(self, a: int, b: int) -> int:
            """Clash.

            Args:
                a: a.
                b: b.
            """
            return 0

    with pytest.raises(ValueError, match="has the name of a tool the run already offers"):
        tool_set([as_tool(add)], Clash())


def test_each_row_has_its_own_environment():
    tokenizer = byte_chat_tokenizer()
    agent = Agent([], Counter, tokenizer, [tokenizer.eos_token_id])
    try:
        envs, observations = agent.start([{"start": 1}, {"start": 5}], group_size=2)
        assert [e.count for e in envs] == [1, 1, 5, 5] and observations == [None, None]
        out = agent.runner.run([(agent._tool_set(envs[0]), [ToolCall("increment", {"by": 2})]),
                                (agent._tool_set(envs[1]), [ToolCall("increment", {"by": 3})])])
        assert [row[0][1] for row in out] == ["3", "4"]  # rows never share state
        assert agent.has_environment_reward and agent.environment_name == "Counter"
    finally:
        agent.close()


def test_reset_strings_must_agree_within_a_group():
    class Observed(Counter):
        def reset(self, **record):
            return f"start at {record['start']}"

    class Random(Counter):
        def reset(self, **record):
            return str(id(self))

    tokenizer = byte_chat_tokenizer()
    agent = Agent([], Observed, tokenizer, [tokenizer.eos_token_id])
    assert agent.start([{"start": 3}], 2)[1] == ["start at 3"]
    agent = Agent([], Random, tokenizer, [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match="reset returned different strings for the 2 rows of record 0"):
        agent.start([{"start": 3}], 2)


# ------------------------------------------------------------------------------------------------ formats


def test_compact_format_calls_the_single_tool_with_the_turn_text():
    tok = tiny_tokenizer("calc")
    fmt = tool_format(tok, [as_tool(calc).schema], [tok.eos_token_id])
    assert isinstance(fmt, CompactFormat)
    turn = tok("12*34<call>", add_special_tokens=False)["input_ids"]
    assert fmt.calls(turn, []) == [ToolCall("calc", {"expression": "12*34"})]
    assert fmt.calls(turn[:-1] + [tok.eos_token_id], []) == []
    assert tok.decode(fmt.suffix_ids([("calc", "408")])) == "408 "
    with pytest.raises(ValueError, match="offers one tool"):
        tool_format(tok, [as_tool(calc).schema, as_tool(add).schema], [tok.eos_token_id])
    with pytest.raises(ValueError, match="one required string parameter"):
        tool_format(tok, [as_tool(add).schema], [tok.eos_token_id])


def test_a_tokenizer_without_a_template_or_call_token_is_refused():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="has no chat template, so it cannot render tool calls"):
        tool_format(tok, [as_tool(calc).schema], [tok.eos_token_id])
    plain = byte_chat_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="chat template of .* cannot render tool turns"):
        tool_format(plain, [as_tool(add).schema], [plain.eos_token_id])


def test_chat_template_format_reads_hermes_calls_and_renders_results():
    tok = byte_chat_tokenizer()
    fmt = tool_format(tok, [as_tool(add).schema], [tok.eos_token_id])
    turn = tok('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
               '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
               '<tool_call>{not json</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    calls = fmt.calls(turn, [])
    assert calls[:2] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert calls[2].name == "<unparsed>"  # answered with an error message, counted as a failure
    assert fmt.calls(tok("just 5<|im_end|>", add_special_tokens=False)["input_ids"], []) == []
    suffix = tok.decode(fmt.suffix_ids([("add", "5")]))
    assert suffix == "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|><|im_start|>assistant\n"
    message = fmt.messages(turn, calls[:1])
    assert message["role"] == "assistant" and message["tool_calls"][0]["function"]["name"] == "add"
    # <tool_call> is a special token here: the blocks are cut out before the specials are dropped, JSON and all
    assert message["content"] == "Let me add."
    final = fmt.messages(tok("just 5<|im_end|>", add_special_tokens=False)["input_ids"], [])
    assert final == {"role": "assistant", "content": "just 5"}


# ------------------------------------------------------------------------------------------------ the loop


def _scripted_next_token(scripts):
    """``_next_token`` that picks row r's next scripted token (its real log-prob), or EOS when the script is done."""
    position = [0] * len(scripts)

    def next_token(logits, params, generator):
        logp_all = torch.log_softmax(logits, dim=-1)
        token = []
        for r, script in enumerate(scripts):
            token.append(script[position[r]] if position[r] < len(script) else script[-1])
        token = torch.tensor(token)
        return token, logp_all.gather(1, token[:, None])[:, 0]

    def advance(sampled):
        for r, s in enumerate(sampled.tolist()):
            if s:
                position[r] += 1

    return next_token, advance


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_multi_turn_rollout_feeds_tool_tokens_and_masks_them(monkeypatch, max_iterations):
    tok = tiny_tokenizer("calc")
    eos, call = tok.eos_token_id, tok.convert_tokens_to_ids("<call>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    model = tiny_model(tok, seed=0).eval()
    prompts = ["12*34=", "7*8="]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    scripts = [
        ids("12*34") + [call] + ids("2") + [call] + [eos],  # two calls, then the answer (or the cap after one)
        [eos],  # a final answer at once
        ids("9*9") + [call] + [eos],
        ids("1+1") + [call] + ids("5") + [eos],
    ]
    next_token, advance = _scripted_next_token(scripts)
    agent = Agent([calc], None, tok, [eos], AgentOptions(max_tool_calling_iterations=max_iterations))

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def choose(self, token, logp):
            token, logp, sampled = self.inner.choose(token, logp)
            advance(sampled)
            return token, logp, sampled

        def after(self, *args):
            return self.inner.after(*args)

    prompt_rows = [list(enc.input_ids[r // 2][enc.attention_mask[r // 2].bool()]) for r in range(4)]
    inner = agent.turns([None] * 4, prompt_rows, max_new_tokens=16, context=64)
    monkeypatch.setattr(rollout_module, "_next_token", next_token)
    try:
        ro = generate(model, enc.input_ids, enc.attention_mask, 2, SamplingParams(16, 1.0), eos_token_id=[eos],
                      pad_token_id=tok.pad_token_id, turns=Recording(inner))
    finally:
        agent.close()
    texts = [tok.decode(row[mask.bool()], skip_special_tokens=False)
             for row, mask in zip(ro.completion_ids, ro.completion_mask)]
    if max_iterations is None:
        assert texts[0] == "12*34<call>408 2<call>2 <eos>"
    else:
        assert texts[0] == "12*34<call>408 2<call>"  # the second round of calls is over the cap: the row ends
    assert texts[1] == "<eos>"
    assert texts[2] == "9*9<call>81 <eos>"
    assert texts[3] == "1+1<call>2 5<eos>"
    # the loss mask is 0 exactly on the tool's tokens, and so is the recorded log-prob
    for r, text in enumerate(texts):
        n = int(ro.completion_mask[r].sum())
        trained = tok.decode(ro.completion_ids[r][:n][ro.loss_mask[r][:n].bool()], skip_special_tokens=False)
        fed = tok.decode(ro.completion_ids[r][:n][~ro.loss_mask[r][:n].bool()], skip_special_tokens=False)
        expected_fed = {0: "408 2 " if max_iterations is None else "408 ", 1: "", 2: "81 ", 3: "2 "}[r]
        assert fed == expected_fed, (r, fed)
        expected_trained = {0: "12*34<call>2<call><eos>" if max_iterations is None else "12*34<call>2<call>",
                            1: "<eos>", 2: "9*9<call><eos>", 3: "1+1<call>5<eos>"}[r]
        assert trained == expected_trained, (r, trained)  # the model's own tokens, and only those
        assert (ro.sampling_logps[r][:n][~ro.loss_mask[r][:n].bool()] == 0).all()
    assert ro.completion_lengths.tolist() == ro.loss_mask.sum(1).tolist()
    # the cache saw the tool tokens where the transcript has them: teacher forcing gives the sampled log-probs
    with torch.no_grad():
        hidden = completion_hidden(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        head = head_of(model)
        forced = fused_logprobs(hidden, head.weight, ro.completion_ids, impl="torch")
    trained = ro.loss_mask.bool()
    torch.testing.assert_close(forced[trained], ro.sampling_logps[trained], rtol=1e-5, atol=1e-5)
    assert inner.stats.calls == (4 if max_iterations is None else 3)
    assert inner.stats.calls_per_row == ([2, 0, 1, 1] if max_iterations is None else [1, 0, 1, 1])


def _scripted_turns(monkeypatch, agent, prompt: str, script: list[int], budget: int):
    """Generate one row of ``prompt`` along ``script`` with ``budget`` new tokens; returns (rollout, turns)."""
    tok = agent.tokenizer
    model = tiny_model(tok, seed=0).eval()
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    next_token, advance = _scripted_next_token([script])
    monkeypatch.setattr(rollout_module, "_next_token", next_token)
    turns = agent.turns([None], [enc.input_ids[0].tolist()], max_new_tokens=budget, context=64)
    original = turns.choose

    def choose(token, logp):
        token, logp, sampled = original(token, logp)
        advance(sampled)
        return token, logp, sampled

    turns.choose = choose
    ro = generate(model, enc.input_ids, enc.attention_mask, 1, SamplingParams(budget, 1.0),
                  eos_token_id=agent.eos_ids, pad_token_id=tok.pad_token_id, turns=turns)
    return ro, turns


def test_results_that_would_overflow_the_budget_end_the_row(monkeypatch):
    tok = tiny_tokenizer("calc")
    eos, call = tok.eos_token_id, tok.convert_tokens_to_ids("<call>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    script = ids("999*999") + [call, eos]  # 8 tokens, then "99800 " (the result cut to 5 tokens) would make 14 > 12
    agent = Agent([calc], None, tok, [eos], AgentOptions(max_tool_response_length=5))
    try:
        ro, turns = _scripted_turns(monkeypatch, agent, "1*1=", script, 12)
    finally:
        agent.close()
    n = int(ro.completion_mask[0].sum())
    assert tok.decode(ro.completion_ids[0][:n], skip_special_tokens=False) == "999*999<call>"
    assert turns.stats.dropped_results == 1 and ro.loss_mask[0][:n].all()
    assert turns.stats.truncated_results == 0  # the cut result never reached the model: it is not counted
    assert turns.messages[0] == [{"role": "assistant", "content": "999*999", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "999*999"}}}]}]


def test_a_turn_cut_by_the_budget_is_the_rows_last_message(monkeypatch):
    """The rewards read the model's words where the budget cut them, never the tool's result as its answer."""
    tok = tiny_tokenizer("calc")
    eos, call = tok.eos_token_id, tok.convert_tokens_to_ids("<call>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    agent = Agent([calc], None, tok, [eos], AgentOptions(max_tool_response_length=1))
    try:  # "2*3<call>" (4), "6 " (2), then the model's "7777..." until 12 tokens: a final turn of 6, cut
        ro, turns = _scripted_turns(monkeypatch, agent, "2*3=", ids("2*3") + [call] + ids("7" * 20) + [eos], 12)
    finally:
        agent.close()
    assert tok.decode(ro.completion_ids[0], skip_special_tokens=False) == "2*3<call>6 777777"
    assert turns.messages[0][1:] == [{"role": "tool", "name": "calc", "content": "6"},
                                     {"role": "assistant", "content": "777777"}]
    assert turns.stats.truncated_results == 0  # "6" is one token: nothing to cut


# ------------------------------------------------------------------------------------------------ python tool, calc


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")


@linux_only
@pytest.mark.parametrize(("code", "expected"), [
    ("print(1 + 1)\n3 * 4", "2\n12"),
    ("x = [i * i for i in range(4)]\nx", "[0, 1, 4, 9]"),
    ("print('hi')", "hi"),
    ("1 / 0", "ZeroDivisionError: division by zero"),
    ("def f(:\n  pass", "SyntaxError"),
    ("import sys\nsys.stdout.write('partial')\nraise ValueError('bad')", "partial\nValueError: bad"),
    ("class A:\n    pass\nA()", "not plain data"),
    ("open('/etc/hostname').read()", "Error"),  # Landlock or the audit hook: not readable from the tool
])
def test_python_tool(code, expected):
    from grpo_fast.agents.python_tool import python

    out = python(code)
    assert expected in out, out


@linux_only
def test_python_tool_is_bounded():
    from grpo_fast.agents.python_tool import make_python_tool
    from grpo_fast.sandbox import SandboxLimits

    tool = make_python_tool(SandboxLimits(timeout_s=1.0, cpu_time_s=1.0), max_chars=100)
    start = time.monotonic()
    out = tool("while True:\n    pass")
    assert time.monotonic() - start < 5.0 and ("timeout" in out or "killed" in out), out
    out = tool("print('a' * 100000)")
    assert len(out) == 100 and out.endswith("[truncated]")
    assert threading.active_count() < 50


def test_calc_tool_and_task():
    assert calc("37*408") == "15096" and calc(" 12*(3+4) ") == "84" and calc("5-9") == "-4"
    for bad in ("__import__('os')", "2**10", "1/2", "x", "9" * 30):
        with pytest.raises(ValueError):
            calc(bad)
    records = builtin_records("calc", "train", 50)
    assert all(calc(r["prompt"][:-1]) == r["answer"] for r in records)
    held_out = {r["prompt"] for r in builtin_records("calc", "eval", 50)}
    assert not held_out & {r["prompt"] for r in records}
    tok = tiny_tokenizer("calc")
    assert tok.convert_tokens_to_ids("<call>") == len(tok) - 1 and len(tiny_tokenizer()) == 20


@pytest.mark.parametrize(("completion", "answer", "score"), [
    ("12*34<call>408 <eos>", "408", 1.0),
    ("408", "408", 1.0),
    ("407", "408", 0.0),
    ("", "408", 0.0),
    ([{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "408"},
      {"role": "assistant", "content": "done"}], "408", 1.0),
    ("-4", "-4", 1.0),
])
def test_last_number_reward(completion, answer, score):
    assert last_number_reward(["p"], [completion], [answer]) == [score]


# transformers' response template for the fixture's Hermes-style template (what TRL's add_response_schema sets for
# Qwen3): the turn's content, and its <tool_call> JSON blocks as calls
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.mark.parametrize("parser", ["hermes", "response_template"])
def test_chat_template_rollout_feeds_the_rendered_suffix(monkeypatch, parser):
    from trl_fixtures import tiny_qwen2

    tok = byte_chat_tokenizer()
    parsed = []
    if parser == "response_template":  # parse_response reads each turn, with everything before it as the prefix
        tok.response_template = RESPONSE_TEMPLATE
        original_parse = tok.parse_response

        def parse_response(ids, prefix, **kwargs):
            parsed.append((list(ids), list(prefix)))
            message = original_parse(ids, prefix=prefix, **kwargs)
            return {**message, "content": "parsed:" + message.get("content", "")}  # the messages take the parse's

        tok.parse_response = parse_response
    eos = tok.eos_token_id
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    model = tiny_qwen2(len(tok), seed=1, max_position_embeddings=512).eval()
    agent = Agent([add], None, tok, [eos])
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], tools=agent.schemas, tokenize=False,
                                     add_generation_prompt=True)
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    first = ids('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>')
    scripts = [first + ids("It is 5.<|im_end|>"), ids("No tools.<|im_end|>")]
    next_token, advance = _scripted_next_token(scripts)
    monkeypatch.setattr(rollout_module, "_next_token", next_token)
    turns = agent.turns([None, None], [enc.input_ids[0].tolist()] * 2, max_new_tokens=200, context=512)
    original = turns.choose

    def choose(token, logp):
        token, logp, sampled = original(token, logp)
        advance(sampled)
        return token, logp, sampled

    turns.choose = choose
    try:
        ro = generate(model, enc.input_ids, enc.attention_mask, 2, SamplingParams(200, 1.0), eos_token_id=[eos],
                      pad_token_id=tok.pad_token_id, turns=turns)
    finally:
        agent.close()
    suffix = agent.format.suffix_ids([("add", "5")])
    n = int(ro.completion_mask[0].sum())
    assert ro.completion_ids[0][:n].tolist() == first + suffix + ids("It is 5.<|im_end|>")
    assert ro.loss_mask[0][:n].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(ids("It is 5.<|im_end|>"))
    assert tok.decode(ro.completion_ids[1][: int(ro.completion_mask[1].sum())]) == "No tools.<|im_end|>"
    said = "parsed:" if parser == "response_template" else ""
    assert turns.messages[0] == [
        {"role": "assistant", "content": said + "Sure.",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": said + "It is 5."}]
    assert turns.messages[1] == [{"role": "assistant", "content": said + "No tools."}]
    if parser == "response_template":
        prompt_ids = enc.input_ids[0].tolist()
        assert (first, prompt_ids) in parsed  # the first turn, after the prompt
        assert (ids("It is 5.<|im_end|>"), prompt_ids + first + suffix) in parsed  # the second, after the first
    with torch.no_grad():
        hidden = completion_hidden(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        forced = fused_logprobs(hidden, head_of(model).weight, ro.completion_ids, impl="torch")
    trained = ro.loss_mask.bool()
    torch.testing.assert_close(forced[trained], ro.sampling_logps[trained], rtol=1e-5, atol=1e-5)
