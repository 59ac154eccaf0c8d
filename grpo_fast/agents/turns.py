"""The multi-turn side of a rollout: which token each row feeds next, when its turn ends, what its tools answer.

The sampler (``grpo_fast.train.rollout.generate``) decodes every row in lock-step, one token per row per forward,
with one KV cache. :class:`ToolTurns` is what it asks at each step. A row whose turn ended with tool calls gets the
calls run (:class:`~grpo_fast.agents.tools.ToolRunner`: rows concurrently) and the result tokens queued; while its
queue lasts, the row feeds those tokens instead of sampling (their log-prob 0, their loss mask 0), then samples again,
with everything before it in the cache. So no id is ever re-tokenised and the prompt is prefilled once per group.

A row ends when a turn has no call (its final answer), when it has used ``max_iterations`` rounds of calls, or when
the results would not fit (TRL's rule: the tool messages that would push the completion past ``max_new_tokens``, or
the sequence past the model's context, are dropped and the row ends with the turn that asked for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from grpo_fast.agents.formats import ToolFormat
from grpo_fast.agents.tools import ToolRunner, ToolSet

__all__ = ["ToolTurns", "TurnStats"]


@dataclass
class TurnStats:
    """What the rows' tool use came to, for the metrics."""

    calls: int = 0
    failures: int = 0
    truncated_results: int = 0  # results cut to max_tool_response_length tokens
    dropped_results: int = 0  # rounds of results that did not fit (the row ended instead)
    calls_per_row: list[int] = field(default_factory=list)


class ToolTurns:
    """The tool loop of one generation call (module docstring).

    Args:
        fmt: the tool-call format (:func:`~grpo_fast.agents.formats.tool_format`).
        tools: one :class:`ToolSet` per row (rows grouped by prompt, as the rollout lays them out).
        runner: runs the calls.
        prompts: each row's prompt ids, without padding.
        max_new_tokens: the completion budget, model and tool tokens together.
        context: the model's context (positions); a row's prompt and completion must stay below it.
        max_iterations: rounds of calls per row (None: no limit but the budget).
        max_result_tokens: a result longer than this many tokens is cut to it (None: no cut).
        tokenizer: to cut results by tokens.
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[ToolSet], runner: ToolRunner, prompts: Sequence[list[int]],
                 *, max_new_tokens: int, context: int | None, max_iterations: int | None,
                 max_result_tokens: int | None, tokenizer) -> None:
        rows = len(tools)
        if len(prompts) != rows:
            raise ValueError(f"ToolTurns got {len(prompts)} prompts for {rows} rows")
        self._fmt = fmt
        self._tools = list(tools)
        self._runner = runner
        self._prompts = [list(p) for p in prompts]
        self._budget = max_new_tokens
        self._context = context
        self._max_iterations = max_iterations
        self._max_result_tokens = max_result_tokens
        self._tokenizer = tokenizer
        self.completions: list[list[int]] = [[] for _ in range(rows)]  # every token fed after the prompt
        self._turn_start = [0] * rows  # where the current model turn begins in completions[r]
        self._queue: list[list[int]] = [[] for _ in range(rows)]
        self._rounds = [0] * rows
        self._messages: list[list[dict]] = [[] for _ in range(rows)]  # the finished turns' messages
        self.stats = TurnStats(calls_per_row=[0] * rows)

    @property
    def messages(self) -> list[list[dict]]:
        """Each row's assistant and tool messages (TRL's form), a turn cut off by the length budget included (as
        text: a call it had not finished is not a call)."""
        out = []
        for r, finished in enumerate(self._messages):
            cut = self.completions[r][self._turn_start[r]:]
            out.append(finished + [self._fmt.messages(cut, [])] if cut else list(finished))
        return out

    def choose(self, token: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens the rows feed this step: a row with queued tool tokens feeds the next one (log-prob 0), the
        others what they sampled. Returns (tokens, log-probs, whether each row's token is the model's)."""
        forced = [(r, q[0]) for r, q in enumerate(self._queue) if q]
        model = torch.ones_like(token, dtype=torch.bool)
        if forced:
            rows = torch.tensor([r for r, _ in forced], device=token.device)
            token = token.index_put((rows,), torch.tensor([t for _, t in forced], device=token.device,
                                                          dtype=token.dtype))
            logp = logp.index_put((rows,), torch.zeros(len(forced), device=logp.device, dtype=logp.dtype))
            model = model.index_put((rows,), torch.zeros(len(forced), device=token.device, dtype=torch.bool))
            for r, _ in forced:
                self._queue[r].pop(0)
        return token, logp, model

    def after(self, token: torch.Tensor, model: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Record this step's tokens; run the calls of the turns that ended; returns which rows are done."""
        tokens, from_model, live = token.tolist(), model.tolist(), alive.tolist()
        ended = []
        for r, (t, m, a) in enumerate(zip(tokens, from_model, live)):
            if a:
                self.completions[r].append(t)
                if m and t in self._fmt.stop_ids:
                    ended.append(r)
        done = self.end_turns(ended)
        return torch.tensor([r in done for r in range(len(tokens))], dtype=torch.bool, device=token.device)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end a turn."""
        return self._fmt.stop_ids

    def end_turns(self, rows: list[int]) -> set[int]:
        """The rows whose turn just ended (its stop token recorded last): read their calls, run them, queue the
        results; returns the rows that are done (a final answer, the cap, results that do not fit)."""
        done, pending = set(), []
        for r in rows:
            turn = self.completions[r][self._turn_start[r]:]
            calls = self._fmt.calls(turn, self._prompts[r] + self.completions[r][: self._turn_start[r]])
            self._messages[r].append(self._fmt.messages(turn, calls))
            self._turn_start[r] = len(self.completions[r])  # the turn is in the messages (results move it on)
            if not calls or (self._max_iterations is not None and self._rounds[r] >= self._max_iterations):
                done.add(r)
            else:
                pending.append((r, calls))
        if pending:
            answers = self._runner.run([(self._tools[r], calls) for r, calls in pending])
            for (r, calls), results in zip(pending, answers):
                if not self._queue_results(r, calls, results):
                    done.add(r)
        return done

    def take_queued(self, r: int) -> list[int]:
        """Row ``r``'s queued tool tokens, all at once, recorded as fed (an engine that prefills them in one go)."""
        queued, self._queue[r] = self._queue[r], []
        self.completions[r].extend(queued)
        return queued

    def record_turn(self, r: int, tokens: list[int]) -> None:
        """Record a whole sampled turn of row ``r`` (an engine that samples turn by turn)."""
        self.completions[r].extend(tokens)

    def _queue_results(self, r: int, calls, outcomes: list[tuple[str, str, bool]]) -> bool:
        """Queue a round's result tokens for row ``r``; False (the row ends) when they would not fit."""
        self.stats.calls += len(calls)
        self.stats.calls_per_row[r] += len(calls)
        self.stats.failures += sum(failed for _, _, failed in outcomes)
        cut = [self._cut(text) for _, text, _ in outcomes]
        results = [(name, text) for (name, _, _), (text, _) in zip(outcomes, cut)]
        suffix = self._fmt.suffix_ids(results)
        used = len(self.completions[r]) + len(suffix)
        if used > self._budget or (self._context is not None and len(self._prompts[r]) + used >= self._context):
            self.stats.dropped_results += 1
            return False
        self.stats.truncated_results += sum(was_cut for _, was_cut in cut)  # results the model reads cut
        self._rounds[r] += 1
        self._queue[r] = list(suffix)
        self._messages[r].extend({"role": "tool", "name": name, "content": text} for name, text in results)
        self._turn_start[r] = len(self.completions[r]) + len(suffix)
        return True

    def _cut(self, text: str) -> tuple[str, bool]:
        """The result as the model reads it (at most ``max_result_tokens`` tokens), and whether it was cut."""
        if self._max_result_tokens is None:
            return text, False
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= self._max_result_tokens:
            return text, False
        return self._tokenizer.decode(ids[: self._max_result_tokens]), True
