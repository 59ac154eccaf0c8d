"""How tool calls look in tokens: finding the calls in a finished turn, and the tokens that carry their results.

The rollout never re-tokenises: a row's ids are the prompt, then the model's turn as sampled, then the tool suffix
(the tool messages and the next assistant header, rendered by the chat template), then the model's next turn, and so
on. Two formats:

* :class:`ChatTemplateFormat`: any tokenizer whose chat template renders assistant ``tool_calls`` and ``tool``
  messages. A turn ends at EOS; its calls are read with the tokenizer's ``response_template``
  (``tokenizer.parse_response``, as TRL does) when it has one, else as Hermes-style ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes and most open models). The suffix is the
  difference between two renders of a small conversation (with and without the tool messages), so it is exactly what
  the template would have produced.
* :class:`CompactFormat`: the built-in tiny model's (``grpo_fast.train.tasks``): a character vocabulary with one
  ``<call>`` token. The model writes the argument of the run's single tool and then ``<call>``; the result follows as
  characters and a space. No JSON to learn: a 2-layer model can find the format from rewards.

:func:`tool_format` picks the format for a tokenizer, or refuses in one line naming the tokenizer and why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

from grpo_fast.agents.tools import ToolCall

__all__ = ["CALL_TOKEN", "ChatTemplateFormat", "CompactFormat", "ToolFormat", "tool_format"]

CALL_TOKEN = "<call>"  # the compact format's call token
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolFormat(Protocol):
    """What the multi-turn rollout needs from a tool-call format."""

    stop_ids: frozenset[int]  # tokens that end a turn (EOS, and the compact format's call token)

    def calls(self, turn_ids: Sequence[int], history_ids: Sequence[int]) -> list[ToolCall]:
        """The calls in a finished turn (``turn_ids``, its stop token included; ``history_ids`` is everything before
        it); an empty list when the turn is the row's final answer."""

    def suffix_ids(self, results: Sequence[tuple[str, str]]) -> list[int]:
        """The tokens after a turn that made calls: the ``(tool name, result text)`` messages and the next
        assistant header."""

    def messages(self, turn_ids: Sequence[int], calls: Sequence[ToolCall]) -> dict:
        """The assistant message of a turn, as reward functions receive it (TRL's form)."""


def _tool_call_dicts(calls: Sequence[ToolCall]) -> list[dict]:
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class ChatTemplateFormat:
    """Tool calls as the tokenizer's chat template writes them (module docstring)."""

    def __init__(self, tokenizer: Any, schemas: list[dict], eos_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._schemas = schemas
        self.stop_ids = frozenset(int(i) for i in eos_ids)
        self._eos = self.stop_ids
        self._parser = "response_template" if getattr(tokenizer, "response_template", None) else "hermes"
        self._suffix_cache: dict[tuple[str, ...], list[int]] = {}
        self._parsed: tuple[tuple[int, ...], dict] | None = None  # the last turn parse_response read, and its parse
        self._specials = _special_tokens(tokenizer)  # cut from a turn's text with calls (messages())
        self._check_template()

    def _render(self, messages: list[dict], generation_prompt: bool, tokenize: bool = True) -> list[int] | str:
        out = self._tokenizer.apply_chat_template(messages, tools=self._schemas, tokenize=tokenize,
                                                  add_generation_prompt=generation_prompt, return_dict=False)
        return list(out) if tokenize else out

    def _check_template(self) -> None:
        """Refuse a template that drops the assistant's calls or the tool messages (it would train the model on
        turns it never sees)."""
        name = self._schemas[0]["function"]["name"]
        marker, argument = "grpo-fast-tool-result-7319", "grpo-fast-argument-4421"
        call = [{"type": "function", "function": {"name": name, "arguments": {"probe": argument}}}]
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        try:
            self._suffix_for([(name, marker)])  # the renders with and without the tool message must extend
            # the template's text, not its tokens decoded: a vocabulary without the markers' letters decodes <unk>
            text = self._render(head + [{"role": "tool", "name": name, "content": marker}], True, tokenize=False)
            rendered = self._render(head, False, tokenize=False)
        except Exception as e:  # a template that raises on tool messages, or renders them without the assistant turn
            raise ValueError(f"the chat template of {_describe(self._tokenizer)} cannot render tool turns: "
                             f"{type(e).__name__}: {e}") from None
        if marker not in text:
            raise ValueError(f"the chat template of {_describe(self._tokenizer)} cannot render tool turns: a tool "
                             "message's content does not appear in what it renders")
        if argument not in rendered:
            raise ValueError(f"the chat template of {_describe(self._tokenizer)} cannot render tool turns: an "
                             "assistant message's tool_calls do not appear in what it renders")

    def _suffix_for(self, results: Sequence[tuple[str, str]]) -> list[int]:
        # As TRL's _get_tool_suffix_ids: the real tool name (some templates name it in the header), a dummy call
        calls = [{"type": "function", "function": {"name": results[0][0], "arguments": {}}}]
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        tools = [{"role": "tool", "name": name, "content": text} for name, text in results]
        prefix = self._render(head, False)
        full = self._render(head + tools, True)
        ends = [i for i, token in enumerate(prefix) if token in self._eos]
        if ends:  # templates that write "<eos>\n" after a turn: the sampled turn stops at the EOS itself
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the render with tool messages does not extend the render without them")
        return full[len(prefix):]

    def suffix_ids(self, results: Sequence[tuple[str, str]]) -> list[int]:
        return self._suffix_for(results)

    def calls(self, turn_ids: Sequence[int], history_ids: Sequence[int]) -> list[ToolCall]:
        self._parsed = None
        if self._parser == "response_template":
            try:
                message = self._tokenizer.parse_response(list(turn_ids), prefix=list(history_ids),
                                                         tools=self._schemas)
            except Exception:  # a turn the template's parser cannot read makes no call (TRL: likewise)
                return []
            if not isinstance(message, dict):
                return []
            self._parsed = (tuple(turn_ids), message)  # its content is the turn's message (messages())
            found = message.get("tool_calls") or []
            return [ToolCall(str(c.get("function", {}).get("name", "")), _arguments(c.get("function", {})))
                    for c in found if isinstance(c, dict)]
        text = self._tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        calls = []
        for block in _HERMES.findall(text):
            try:
                parsed = json.loads(block)
            except ValueError:
                calls.append(ToolCall("<unparsed>", {"text": block[:200]}))  # answered with an error, counted
                continue
            if isinstance(parsed, dict):
                calls.append(ToolCall(str(parsed.get("name", "")), _arguments(parsed)))
        return calls

    def messages(self, turn_ids: Sequence[int], calls: Sequence[ToolCall]) -> dict:
        """The turn's text without its calls: the content of the response template's parse where the tokenizer has
        one (the parse :meth:`calls` made, with the history: TRL's message), else the text with the ``<tool_call>``
        blocks cut out before the special tokens are dropped (the tags are special tokens in many vocabularies:
        dropped first, they would leave the JSON)."""
        if self._parsed is not None and self._parsed[0] == tuple(turn_ids):  # calls() just parsed this turn
            content = self._parsed[1].get("content")
            content = content if isinstance(content, str) else ""  # TRL's message: no content, none
        elif calls:
            text = _HERMES.sub("", self._tokenizer.decode(list(turn_ids), skip_special_tokens=False))
            for special in self._specials:
                text = text.replace(special, "")
            content = text.strip()
        else:
            content = self._tokenizer.decode(list(turn_ids), skip_special_tokens=True)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = _tool_call_dicts(calls)
        return message


def _special_tokens(tokenizer: Any) -> list[str]:
    """Every special token's text, the added ones outside ``all_special_tokens`` included (Llama-3's
    ``<|eom_id|>``), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)} | set(tokenizer.all_special_tokens)
    return sorted(found, key=len, reverse=True)


def _arguments(function: dict) -> dict:
    """A call's arguments as a dict: some models write them as a JSON string."""
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {"<unparsed>": arguments[:200]}
    return arguments if isinstance(arguments, dict) else {"<unparsed>": str(arguments)[:200]}


class CompactFormat:
    """The tiny model's format: ``<argument><call>`` calls the run's single tool with its single string parameter;
    the result follows as characters, then a space."""

    def __init__(self, tokenizer: Any, schemas: list[dict], eos_ids: Sequence[int]) -> None:
        if len(schemas) != 1:
            raise ValueError(f"the compact tool format of {_describe(tokenizer)} offers one tool, got "
                             f"{len(schemas)} ({', '.join(s['function']['name'] for s in schemas)})")
        function = schemas[0]["function"]
        params = function["parameters"].get("properties", {})
        required = function["parameters"].get("required", [])
        if len(required) != 1 or params.get(required[0], {}).get("type") != "string":
            raise ValueError(f"the compact tool format of {_describe(tokenizer)} calls a tool with one required "
                             f"string parameter; {function['name']} takes {sorted(params)}")
        self._tokenizer = tokenizer
        self._tool, self._parameter = function["name"], required[0]
        self.call_id = tokenizer.convert_tokens_to_ids(CALL_TOKEN)
        self.stop_ids = frozenset({*map(int, eos_ids), self.call_id})

    def calls(self, turn_ids: Sequence[int], history_ids: Sequence[int]) -> list[ToolCall]:
        if not turn_ids or turn_ids[-1] != self.call_id:
            return []
        argument = self._tokenizer.decode(list(turn_ids[:-1]), skip_special_tokens=True).strip()
        return [ToolCall(self._tool, {self._parameter: argument})]

    def suffix_ids(self, results: Sequence[tuple[str, str]]) -> list[int]:
        text = "".join(f"{result} " for _, result in results)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def messages(self, turn_ids: Sequence[int], calls: Sequence[ToolCall]) -> dict:
        ids = list(turn_ids[:-1]) if calls else list(turn_ids)
        message = {"role": "assistant", "content": self._tokenizer.decode(ids, skip_special_tokens=True)}
        if calls:
            message["tool_calls"] = _tool_call_dicts(calls)
        return message


def _describe(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"tokenizer {name!r} ({type(tokenizer).__name__})" if name else f"the {type(tokenizer).__name__}"


def tool_format(tokenizer: Any, schemas: list[dict], eos_ids: Sequence[int]) -> ToolFormat:
    """The format for ``tokenizer``: compact where its vocabulary has the ``<call>`` token (the built-in tiny model of
    a tool task), else its chat template's; raises ``ValueError`` naming the tokenizer when neither can carry
    tools."""
    if not schemas:
        raise ValueError("tool_format needs at least one tool")
    if CALL_TOKEN in tokenizer.get_vocab():  # (a compact chat template, as TRL needs one, writes the same tokens)
        return CompactFormat(tokenizer, schemas, eos_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{_describe(tokenizer)} has no chat template, so it cannot render tool calls and results: "
                         "use a chat model's tokenizer (its template must render tools, assistant tool_calls and "
                         "the tool role), or the built-in tiny model of a tool task")
    return ChatTemplateFormat(tokenizer, schemas, eos_ids)
