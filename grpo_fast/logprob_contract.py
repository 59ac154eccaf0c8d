"""The contract both log-prob backends implement: the options of a call and what its backward is asked for.

A backend (``grpo_fast.logprobs_torch`` for CPU, ``grpo_fast.kernels.linear_logprobs`` for GPUs) is a module with

- ``forward(hidden, weight, target_ids, bias, params) -> (logp, entropy or None, m, log_s)``: hidden ``[N, H]``, weight
  ``[V, H]``, target_ids ``[N]`` int64, bias ``[V]`` or None; each output ``[N]`` in ``stats_dtype(hidden.dtype)``
  (``lse = m + log_s``; the entropy only with ``params.return_entropy``);
- ``backward(hidden, weight, target_ids, bias, params, grads) -> (d hidden, d weight, d bias)``: the gradients of
  ``sum(g * logp + ge * entropy)`` that ``grads`` asks for (None for the others);
- ``stats_dtype(dtype)``: the dtype of the forward's ``[N]`` outputs.

The GPU backend's pair takes keywords beyond the contract for the tools that plan without running (the cost model,
the static gate: ``plan``, where the launches are recorded; the backward's ``rows`` / ``every_row``, which rows to
walk when meta tensors hold no gradients to look at); ``grpo_fast.ops`` never passes them.

``params`` (``LogprobParams``) holds every option, ``grads`` (``BackwardInputs``) every per-row vector the backward
reads beyond the forward's inputs and which gradients it returns. ``grpo_fast.ops`` wraps whichever backend ``impl``
names in custom ops, carrying ``params`` through them as one JSON string (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from dataclasses import dataclass

from torch import Tensor

from grpo_fast.checks import check_positive_scalar
from grpo_fast.kernels.logprob_layout import scratch_bytes


def _json_scalar(x) -> str:
    return "null" if x is None else "true" if x is True else "false" if x is False else repr(x)


@dataclass(frozen=True)
class LogprobParams:
    """The options of a log-prob forward and backward, on either backend.

    temperature, softcap: the logits' shaping; return_entropy: the forward also returns the entropy (the backward:
    the forward did). vocab_chunk, token_chunk: the torch path's tile (None: from the budget; the GPU path sizes its
    chunks from the budget alone). budget: the temporaries budget in bytes (None: ``scratch_bytes()``, read when
    the op runs)."""

    temperature: float = 1.0
    softcap: float | None = None
    return_entropy: bool = False
    vocab_chunk: int | None = None
    token_chunk: int | None = None
    budget: int | None = None

    def __post_init__(self):
        # one type per option (a softcap of 30 and of 30.0 launch the same kernels; numpy scalars become Python
        # ones), and only values the JSON below carries: finite positive scales, positive sizes
        for name in ("temperature", "softcap"):
            value = check_positive_scalar("LogprobParams", name, getattr(self, name), optional=name == "softcap")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "return_entropy", bool(self.return_entropy))
        for name in ("vocab_chunk", "token_chunk", "budget"):
            value = getattr(self, name)
            if value is not None:
                value = operator.index(value)
                if value < 1:
                    raise ValueError(f"LogprobParams: {name} must be a positive integer or None, got {value!r}")
                object.__setattr__(self, name, value)

    def budget_bytes(self) -> int:
        return scratch_bytes() if self.budget is None else self.budget

    def to_json(self) -> str:
        """The options as one JSON object: how they cross a custom op's schema (which takes no objects). Written
        field by field (numbers by ``repr``, which round-trips) rather than by ``json.dumps``, which
        ``torch.compile`` cannot trace: a params object is made inside compiled code (``GRPOLossConfig``, made by
        the caller before any tracing, keeps ``json.dumps``)."""
        return "{" + ", ".join(f'"{f.name}": {_json_scalar(getattr(self, f.name))}'
                               for f in dataclasses.fields(self)) + "}"

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_json(text: str) -> "LogprobParams":
        return LogprobParams(**json.loads(text))


@dataclass(frozen=True)
class SavedStats:
    """What a log-prob forward saves per row for its backward: ``m`` and ``log_s`` (``lse = m + log_s``) and the
    entropy (None when the forward did not return it), each ``[N]`` in ``stats_dtype``."""

    m: Tensor
    log_s: Tensor
    entropy: Tensor | None = None


@dataclass(frozen=True)
class BackwardInputs:
    """What a log-prob backward reads beyond the forward's inputs, and what it returns.

    saved: the forward's statistics. g, ge: the upstream gradients of the log-probs and of the entropy, ``[N]`` or
    None (absent: zero; an entropy gradient needs ``saved.entropy``). Rows whose g and ge are both exactly zero cost
    no matmul work on either backend. need_hidden, need_weight, need_bias: which gradients to return (need_bias only
    with a bias)."""

    saved: SavedStats
    g: Tensor | None
    ge: Tensor | None = None
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = False

    def __post_init__(self):
        if self.ge is not None and self.saved.entropy is None:
            raise ValueError("BackwardInputs: an entropy gradient `ge` needs the forward's entropy in `saved`")
