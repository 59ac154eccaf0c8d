"""Memory by component, counted from live tensor storage: what ``grpo-fast bench memory`` reports.

How it counts. :class:`StorageTracker` is a ``TorchDispatchMode``: it sees the outputs of every op that runs while
it is active, in forward passes, in the backward (the autograd engine runs backward ops through the same
dispatcher), in the optimizer and in factories such as ``torch.empty``; custom ops written in Python (grpo-fast's
fused log-prob and loss ops) are entered, so their internal temporaries are seen too. Each output's untyped storage
is recorded once, with its size (``nbytes``), and a weak reference whose callback subtracts it again when torch
frees the storage. Views share their base's storage and are not counted twice. Tensors that existed before
tracking started (weights, optimizer states, inputs) are added with :meth:`StorageTracker.register`.

So "live bytes" is the sum of the storages of all tensors alive at a moment. Not counted: memory an op uses inside
its kernel without making a tensor (a BLAS or attention kernel's scratch), the Python and CUDA runtimes, and
allocator slack (CUDA's caching allocator rounds blocks up to 512 bytes and keeps freed blocks; glibc malloc
fragments). The bench reports the allocator's own peak (CUDA) or the process's peak RSS (CPU) next to it.

Peaks. The step is divided into phases (:meth:`StorageTracker.phase`); for each phase the tracker keeps the moment
when live bytes were highest and what was alive then, so a phase's components add up to its peak.

Components. Every storage alive at a phase's peak gets one category, the first that applies:

- ``weights``, ``gradients``, ``optimizer``, ``critic``: ownership, looked up when the phase ends (``owners()``
  maps storages to categories; the bench maps the policy's and the reference's parameters and buffers to weights,
  the policy's ``.grad`` to gradients, its optimizer state to optimizer, and everything of the critic to critic);
- ``kv_cache``: made inside transformers' ``DynamicLayer`` cache methods (``update``, ``lazy_initialization``,
  ``batch_repeat_interleave``) while :meth:`StorageTracker.tag_kv_cache` is on;
- ``critic``: made by a watched critic module's forward, or by the backward of its autograd graph;
- ``logits``: a tensor with at least two dimensions whose last one is the vocabulary size (logits, their softmax,
  log-softmax and gradients; the fused path's vocab chunks are narrower and are not logits), except the ``[H, V]``
  transposed lm_head weight (autocast casts it for the logits matmul);
- the tag in effect when it was made: ``activations`` inside a watched model's forward or in a phase whose default
  tag is activations (the bench's "train": the backward), else ``other`` (rollout results, rewards, advantages...).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits", "critic", "kv_cache", "other")
_OWNER = "grpo_fast_owner"  # autograd-node metadata key: the tag of a watched module's backward


@dataclass
class PhasePeak:
    """One phase: its highest live bytes and what was alive then (``breakdown``), what was alive when it started
    (``start_bytes``, ``start_breakdown``), and the highest live bytes of each allocation tag on its own
    (``tag_max``: e.g. the most logits alive at once, whenever that was)."""

    phase: str
    peak_bytes: int
    start_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    start_breakdown: dict[str, int] = field(default_factory=dict)
    tag_max: dict[str, int] = field(default_factory=dict)


def _custom_op_impl(func):
    """The Python implementation of a ``torch.library.custom_op`` (None for aten and other ops)."""
    if func.namespace in ("aten", "prim", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef
    except ImportError:  # pragma: no cover - older torch: custom ops stay opaque
        return None
    opdef = _maybe_get_opdef(func)
    return None if opdef is None else opdef._init_fn


class StorageTracker(TorchDispatchMode):
    """Live tensor-storage bytes by phase and component (see the module docstring).

    ``vocab_size``: the ``V`` of the logits rule, ``hidden_size``: the ``H`` of the ``[H, V]`` shape it leaves out
    (the transposed lm_head weight and its casts); ``owners()``: called at the end of each phase, returns
    ``{id(untyped_storage): category}`` for the storages whose category follows from ownership.
    """

    def __init__(self, vocab_size: int, hidden_size: int | None = None, owners=lambda: {}):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.owners = owners
        self._live: dict[int, tuple] = {}  # id(storage) -> (weakref, nbytes, tag)
        self.live_bytes = 0
        self._tags = ["other"]
        self._phase: str | None = None
        self._peak = 0
        self._snapshot: list[tuple] = []
        self._phase_start = 0
        self._start_snapshot: list[tuple] = []
        self._tag_live = dict.fromkeys(CATEGORIES, 0)  # live bytes by allocation tag
        self._tag_max = dict.fromkeys(CATEGORIES, 0)
        self.peaks: dict[str, PhasePeak] = {}

    # ------------------------------------------------------------------------------------------ recording

    def _add(self, storage, tag: str) -> None:
        key = id(storage)
        entry = self._live.get(key)
        nbytes = storage.nbytes()
        if entry is not None:
            if entry[1] != nbytes:  # resized in place (e.g. an out= op)
                self.live_bytes += nbytes - entry[1]
                self._tag_live[entry[2]] += nbytes - entry[1]
                self._live[key] = (entry[0], nbytes, entry[2])
                self._note_peak(entry[2])
            return

        def freed(_ref, key=key):
            gone = self._live.pop(key, None)
            if gone is not None:
                self.live_bytes -= gone[1]
                self._tag_live[gone[2]] -= gone[1]

        self._live[key] = (weakref.ref(storage, freed), nbytes, tag)
        self.live_bytes += nbytes
        self._tag_live[tag] += nbytes
        self._note_peak(tag)

    def _note_peak(self, tag: str) -> None:
        if self._phase is None:
            return
        if self._tag_live[tag] > self._tag_max[tag]:
            self._tag_max[tag] = self._tag_live[tag]
        if self.live_bytes > self._peak:
            self._peak = self.live_bytes
            self._snapshot = list(self._live.values())

    def _tag_for(self, t: torch.Tensor) -> str:
        node = torch._C._current_autograd_node()
        tag = node.metadata.get(_OWNER) if node is not None else None
        tag = tag or self._tags[-1]
        if tag in ("activations", "other") and t.dim() >= 2 and t.shape[-1] == self.vocab_size and not (
                t.dim() == 2 and t.shape[0] == self.hidden_size):
            return "logits"
        return tag

    def register(self, tensors, tag: str = "other") -> None:
        """Count tensors that already exist (weights, optimizer states, inputs); ``None`` entries are skipped."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), tag)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _custom_op_impl(func)
        if impl is not None:
            with self:  # run the op's Python body under the tracker: its temporaries count
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        # a view of a storage not seen yet (made below the dispatcher, e.g. autocast's cached weight casts) is
        # classified by the tensor it views, so the transpose of a [V, H] weight is not taken for [H, V] logits
        base = args[0] if getattr(func, "is_view", False) and args and isinstance(args[0], torch.Tensor) else None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t.untyped_storage(), self._tag_for(t if base is None else base))
        return out

    # ------------------------------------------------------------------------------------------ phases and tags

    @contextlib.contextmanager
    def phase(self, name: str, default_tag: str = "other"):
        """Track the peak of ``name`` (phases do not nest); ``default_tag`` for what is made outside watched
        modules."""
        if self._phase is not None:
            raise RuntimeError(f"StorageTracker.phase: {name!r} started inside {self._phase!r}")
        self._phase, self._phase_start = name, self.live_bytes
        self._peak, self._snapshot = self.live_bytes, list(self._live.values())
        self._start_snapshot = self._snapshot
        self._tag_max = dict(self._tag_live)
        self._tags.append(default_tag)
        try:
            yield
        finally:
            self._tags.pop()
            self._phase = None
            self._close_phase(name)

    def _close_phase(self, name: str) -> None:
        owners = self.owners()

        def classify(snapshot) -> dict[str, int]:
            breakdown = dict.fromkeys(CATEGORIES, 0)
            for ref, nbytes, tag in snapshot:
                storage = ref()
                category = owners.get(id(storage)) if storage is not None else None
                breakdown[category or tag] += nbytes
            return breakdown

        previous = self.peaks.get(name)
        if previous is None or self._peak > previous.peak_bytes:  # a phase run twice keeps its higher peak
            self.peaks[name] = PhasePeak(name, self._peak, self._phase_start, classify(self._snapshot),
                                         classify(self._start_snapshot), dict(self._tag_max))
        self._snapshot = self._start_snapshot = []

    @contextlib.contextmanager
    def tag(self, name: str):
        self._tags.append(name)
        try:
            yield
        finally:
            self._tags.pop()

    def watch(self, module: torch.nn.Module, tag: str):
        """Tag what ``module``'s forward makes, and what the backward of its output's graph makes, as ``tag``.
        Returns the hook handles (``.remove()`` them when done)."""

        def pre(_module, _args):
            self._tags.append(tag)

        def post(_module, _args, output):
            self._tags.pop()
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    _mark_graph(t.grad_fn, tag)

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @contextlib.contextmanager
    def tag_kv_cache(self):
        """While on, storages made inside transformers' dynamic KV-cache layers are tagged ``kv_cache``."""
        from transformers import cache_utils

        classes = [getattr(cache_utils, n, None) for n in ("DynamicLayer", "DynamicSlidingWindowLayer")]
        names = ("update", "lazy_initialization", "batch_repeat_interleave")
        saved = []
        for cls in filter(None, classes):
            for name in names:
                original = vars(cls).get(name)
                if original is None:
                    continue
                saved.append((cls, name, original))
                setattr(cls, name, self._tagged(original, "kv_cache"))
        try:
            yield
        finally:
            for cls, name, original in saved:
                setattr(cls, name, original)

    def _tagged(self, fn, tag: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.tag(tag):
                return fn(*args, **kwargs)

        return wrapper


def _mark_graph(root, tag: str) -> None:
    """Set the owner tag on every autograd node reachable from ``root`` that has none yet."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or _OWNER in node.metadata:
            continue
        node.metadata[_OWNER] = tag
        stack.extend(next_node for next_node, _ in node.next_functions)


def storage_ids(tensors) -> set[int]:
    """``id`` of the untyped storage of each tensor (``None`` skipped): the keys of an ``owners()`` map."""
    return {id(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)}
