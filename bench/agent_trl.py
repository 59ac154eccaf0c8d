"""Agentic GRPO with TRL: TRL 1.16's ``GRPOTrainer`` with ``tools=[calc]`` on the built-in ``calc`` task, in the tiny
model's compact tool format, the peer of grpo-fast's agentic rollouts on the same tokens.

The task (``grpo_fast.train.tasks``): prompts ``"37*408="``, answer ``"15096"``, judged by ``last_number_reward`` on
the transcript's last number, the tool's output included. The compact format (``grpo_fast.agents.formats.
CompactFormat``) in tokens: the prompt's characters, the model's turn ``37*408<call>``, the tool's result ``15096 ``
(characters and a space), the model's next turn ``<eos>``.

TRL drives tools through a chat template and a response parser, so :func:`compact_chat_template` gives the tiny
tokenizer both, written so that TRL produces exactly the compact format's tokens:

* the chat template renders a user (or system) message as its content (no header, ``tools=`` ignored, no generation
  prompt), an assistant message with ``tool_calls`` as each call's argument values then ``<call>`` (its content is
  not rendered: in the compact format the turn's text *is* the argument), any other assistant message as its content
  then ``<eos>``, and a tool message as its content then a space. TRL's ``_get_tool_suffix_ids`` (the render with
  the tool message minus the render without) is then ``15096 ``, what ``CompactFormat.suffix_ids`` gives. TRL's
  ``supports_tool_calling`` insists that a call's name and argument key appear in the render; the compact tool's
  never do, so a call of any other tool is spelled out as ``name(key=value)<call>``: only TRL's check renders one.
* the response template (transformers >= 5.13 ``tokenizer.response_template``, read by ``parse_response``; TRL skips
  its own ``add_response_schema``, which knows only named model families, when one is set) opens the tool call with
  a zero-width look-ahead for ``<call>``, so a turn ``37*408<call>`` parses as ``calc(expression="37*408")`` and a
  turn without ``<call>`` (``15096<eos>``, or one cut at the length limit) as content alone; its start anchor
  ``\\Z`` matches the end of the prefix TRL passes (the template has no assistant header to find). One difference
  from ``CompactFormat.calls``: a special token sampled inside a call (``<unk>``, ``<pad>``) stays in the argument
  TRL parses (``"<unk>5"``), where CompactFormat decodes without it (``"5"``).

Stopping at ``<call>``: TRL ends a turn at its ``eos_token_ids``, the tokenizer's EOS plus every id of the model's
``generation_config.eos_token_id``, and masks everything after the first of them. :func:`stop_at_call` puts
``<call>`` there (saved with the model, so grpo-fast's ``eos_token_ids`` read it too). ``GRPOConfig.
generation_kwargs={"eos_token_id": [...]}`` is not enough: ``generate`` stops the row at ``<call>`` but TRL's mask
still looks for EOS alone, and keeps the pad tokens ``generate`` appends to the finished row as completion tokens.

A multi-turn row in TRL (``_tool_call_loop``): the ids are never re-tokenised, prompt + turn + tool suffix + next
turn; ``completion_mask`` is 1 on every token of that (model and tool), ``tool_mask`` 0 on the suffix, and the loss
mask and ``num_items_in_batch`` are their product. A suffix that would take the completion past
``max_completion_length`` (or the model's context) is dropped with its messages, and the row ends with the turn that
called (its last token ``<call>``); the turn after a tool result is sampled with ``max_new_tokens =
max_completion_length`` again and then cut to what the budget has left. Each post-tool turn is generated as a new
left-padded batch of the rows that called, their whole transcripts prefilled again. Rewards get TRL's message lists
(``[assistant, tool, assistant, ...]``), which ``last_number_reward`` joins, tool results included: it needs no
wrapper.

:func:`run_mirrored` runs the ``trl`` arm of ``bench/bench_agent.py``: grpo-fast's own set-up of the run (the
tiny model of the seed, the supervised warm-up, the held-out evaluation before GRPO) makes the start, which TRL loads
from a saved directory; ``bench.bench_peer.trl_args`` maps every option to ``GRPOConfig`` (the mapping
tests/test_bench_peer.py holds to every field), and grpo-fast's ``evaluate`` scores TRL's weights on the held-out
split every ``eval_every`` steps, with the tool, as it scores grpo-fast's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import warnings

from grpo_fast.agents.formats import CALL_TOKEN, CompactFormat
from grpo_fast.agents.tools import as_tool
from grpo_fast.train.tasks import calc

# the curve's columns from TRL's logs of each step: mean reward, tool calls per completion, failed calls per call
CURVE_LOGS = {"reward": "reward", "call_frequency": "tools/call_frequency",
              "failure_frequency": "tools/failure_frequency"}


# --------------------------------------------------------------------------------------------------------------------
# The compact format as a chat template and a response template


def _chat_template(tool: str) -> str:
    """The Jinja chat template of the compact format whose single tool is named ``tool`` (module docstring)."""
    return (
        "{%- for message in messages -%}"
        "{%- if message.role == 'assistant' and message.tool_calls -%}"
        "{%- for call in message.tool_calls -%}"
        f"{{%- if call.function.name == {json.dumps(tool)} -%}}"
        "{{- call.function.arguments.values() | join('') -}}"
        "{%- else -%}"
        "{{- call.function.name ~ '(' -}}"
        "{%- for key, value in call.function.arguments.items() -%}"
        "{{- key ~ '=' ~ value ~ (', ' if not loop.last else '') -}}"
        "{%- endfor -%}"
        "{{- ')' -}}"
        "{%- endif -%}"
        f"{CALL_TOKEN}"
        "{%- endfor -%}"
        "{%- elif message.role == 'assistant' -%}{{- message.content ~ eos_token -}}"
        "{%- elif message.role == 'tool' -%}{{- message.content ~ ' ' -}}"
        "{%- else -%}{{- message.content -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


def _response_template(tool: str, parameter: str, eos_token: str) -> dict:
    """transformers' ``response_template`` that parses a compact turn into TRL's assistant message."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\Z",  # the turn starts where the prefix ends: no assistant header to look for
        "fields": {
            "tool_calls": {
                "open_pattern": rf"(?=.*?{CALL_TOKEN})",  # zero-width: the call is the turn's text up to <call>
                "close": CALL_TOKEN,
                "repeats": True,
                "content": "text",
                "transform": {"type": "function", "function": {"name": tool, "arguments": {parameter: "{content}"}}},
            },
            "content": {"close": eos_token, "content": "text", "content_args": {"strip": False}},
        },
    }


def compact_chat_template(tokenizer, tool=calc):
    """Set on ``tokenizer`` (``tiny_tokenizer("calc")``) the chat template and response template that make TRL's
    tool loop write the compact format of ``tool`` (a function with one required string parameter, as
    ``CompactFormat`` takes); returns the tokenizer."""
    if CALL_TOKEN not in tokenizer.get_vocab():
        raise ValueError(f"compact_chat_template: the tokenizer has no {CALL_TOKEN} token (tiny_tokenizer('calc') has)")
    schema = as_tool(tool, "compact_chat_template").schema
    CompactFormat(tokenizer, [schema], [tokenizer.eos_token_id])  # refuses a tool without one string parameter
    name, parameter = schema["function"]["name"], schema["function"]["parameters"]["required"][0]
    tokenizer.chat_template = _chat_template(name)
    tokenizer.response_template = _response_template(name, parameter, tokenizer.eos_token)
    return tokenizer


def stop_at_call(model, tokenizer):
    """Make ``<call>`` end a turn as EOS does: both in the model's ``generation_config.eos_token_id`` (TRL's and
    grpo-fast's stop ids); returns the model."""
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CALL_TOKEN)]
    return model


def run_mirrored(config, *, eval_every: int) -> dict:
    """TRL's ``GRPOTrainer(tools=[calc])`` for the run ``config`` (a grpo-fast ``TrainConfig`` of the calc task with
    ``sft_warmup_steps``) describes, from the weights grpo-fast's set-up of that run warms up; returns what
    ``bench_agent.run_grpo_fast`` returns: the curve (per step: wall time, reward, calls per completion, failed calls
    per call) and the held-out rewards by step."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from bench.bench_peer import step_timer, trl_args
    from grpo_fast.train.evaluation import evaluate
    from grpo_fast.train.lifecycle import prepare
    from grpo_fast.train.rewards import load_reward
    from grpo_fast.train.tasks import TASK_SIZE, builtin_records

    started = time.perf_counter()
    prepared = prepare(config)  # the seed's tiny model, the warm-up, the before-evaluation: the same start as ours
    run = prepared.run
    held_out = {0: prepared.eval_before}
    tokenizer = compact_chat_template(run.tokenizer)
    model_dir = tempfile.mkdtemp(prefix="agent_trl_model_")
    stop_at_call(run.model, tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    def evaluate_trl(state, model):  # grpo-fast's held-out evaluation of TRL's weights, outside the step's time
        if state.global_step % eval_every == 0 or state.global_step == config.steps:
            run.model.load_state_dict(model.state_dict())
            held_out[state.global_step] = evaluate(run)
            model.train()

    timer = step_timer(evaluate_trl)

    # the warm-up made the model TRL starts from; every other option maps as in the peer comparison
    args = GRPOConfig(**trl_args(dataclasses.replace(config, sft_warmup_steps=0), os.path.join(model_dir, "trl")))
    records = builtin_records("calc", "train", TASK_SIZE)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in records])
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[load_reward(name) for name in config.rewards], args=args,
                          train_dataset=dataset, processing_class=tokenizer, tools=[calc], callbacks=[timer])
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    curve = [dict(step=step, step_ms=ms, **{name: logs.get(step, {}).get(key, math.nan)
                                            for name, key in CURVE_LOGS.items()})
             for step, ms in enumerate(timer.ms, 1)]
    return dict(curve=curve, held_out=held_out, seconds=time.perf_counter() - started)
