"""``grpo-fast fit``: the largest group size x completion length that fits a GPU, per method, from a memory model.

The model adds up, phase by phase, what one training step keeps alive (the phases and components of
``bench/bench_memory.py`` and ``bench/memtrack.py``) and takes the largest phase:

  states      exact from the parameter count: float32 master weights (4 B/param), AdamW (8 B/param), the frozen
              reference in the compute dtype; PPO: the critic's weights and AdamW (12 B/param of decoder + head)
  kv_cache    2 x layers x kv_heads x head_dim x rows x (P + T) x bytes per element, MEASURED (4 in float32; 3
              under bf16 autocast: the keys come out of the rotary embedding in float32); Gemma-2's sliding layers
              keep at most 4096 positions
  activations MEASURED per architecture: one and two decoder layers of the real widths (a reduced vocabulary) run on
              this CPU under the storage tracker at three lengths give bytes per token per layer, an S^2 term
              (eager attention: Gemma-2 on CPU; dropped for CUDA, where flash attention saves no S x S tensor), a
              constant per layer (autocast's bf16 copies of the weights) and bytes per token outside the layers
  logits      MEASURED per method: the most [N, V]-sized bytes alive at once in each phase of a small full step,
              per N x V (e.g. 3 fp32 copies in PPO's backward), times the projected N x V
  gradients   exact: 4 B/param (PPO: the critic's too, which its backward makes first)
  optimizer   AdamW's step temporaries: on CPU measured (two copies of the largest parameter); on CUDA analytic
              (torch's foreach AdamW keeps one fp32 temporary per parameter: 4 B/param) -- not measured
  fused loss  the fused log-prob op's tiles and row buffers: on CPU its own chunk sizes; on CUDA the 64 MiB bound of
              DESIGN.md section 7 -- not measured

What is measured and what projected: the calibration file (``bench/results/memory_calibration.json``, written by
``grpo-fast fit --calibrate``) holds the measured coefficients and says where and how they were measured; every
number in the tables is a projection from them. ``tests/test_memory.py`` checks projections against tracked
measurements of full steps at CPU sizes the calibration did not see (within 5% per phase).

Assumptions (say so when they do not hold): full fine-tuning with the grpo-fast trainer's mixed precision (float32
master weights and AdamW, bfloat16 forward passes, reference stored in bfloat16); one micro-batch = B prompts x G
completions, every completion T tokens long (right padding adds nothing here: the trainer trims to the longest);
no activation checkpointing; a budget also pays for the CUDA context and allocator slack, so ``--headroom`` (default
10%) of it is kept free.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/fit.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.models import MODELS, ModelShape, get_model

CALIBRATION_PATH = harness.RESULTS_DIR / "memory_calibration.json"
METHODS = {  # the bench's configurations, minus ppo_fused (a diagnostic, not a method people run)
    "ppo": dict(ppo=True, fused=False, shared=False),
    "grpo_reference": dict(ppo=False, fused=False, shared=False),
    "grpo_fused": dict(ppo=False, fused=True, shared=False),
    "grpo_shared": dict(ppo=False, fused=True, shared=True),
}
CALIBRATION_DTYPES = ("float32", "bfloat16")
LENGTHS = (16, 32, 64)  # one row of S tokens per decoder measurement
GEMMA2_WINDOW = 4096
GIB = 1024**3


# --------------------------------------------------------------------------------------------------------------------
# Architectures: the registry's shapes as transformers configs


def family(shape: ModelShape) -> str:
    for prefix, name in (("qwen2.5-", "qwen2"), ("llama-", "llama"), ("gemma-2-", "gemma2"), ("qwen3-", "qwen3")):
        if shape.name.startswith(prefix):
            return name
    raise ValueError(f"model: no transformers family known for {shape.name!r}")


def hf_config(shape: ModelShape, layers: int, vocab: int | None = None):
    """The transformers config of ``shape`` with ``layers`` decoder layers (and another vocabulary if given)."""
    from transformers import AutoConfig

    kw = dict(vocab_size=vocab or shape.vocab_size, hidden_size=shape.hidden_size,
              intermediate_size=shape.intermediate_size, num_hidden_layers=layers,
              num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
              head_dim=shape.head_dim, tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=4096,
              pad_token_id=0, bos_token_id=1, eos_token_id=1)
    fam = family(shape)
    if fam == "gemma2":  # softcapped attention: transformers refuses sdpa, CPU runs eager
        kw.update(final_logit_softcapping=shape.final_logit_softcapping, attn_logit_softcapping=50.0,
                  query_pre_attn_scalar=shape.head_dim, sliding_window=GEMMA2_WINDOW, attn_implementation="eager")
    else:
        kw["attn_implementation"] = "sdpa"
    if fam == "llama":
        kw["attention_bias"] = shape.attention_bias
    config = AutoConfig.for_model(fam, **kw)
    return config


# --------------------------------------------------------------------------------------------------------------------
# Calibration: measured coefficients


@dataclass(frozen=True)
class DecoderBytes:
    """Measured activation bytes of one architecture's decoder for one row of S tokens, in one compute dtype:
    per layer ``token * S + quad * S**2 + const``, outside the layers ``base * S + base_const``; a no-grad forward
    (reference and value passes) holds at most ``nograd * S`` beyond its output at its peak."""

    token: float
    quad: float
    const: float
    base: float
    base_const: float
    nograd: float

    def grad_bytes(self, rows: int, length: int, layers: int, flash: bool) -> float:
        quad = 0.0 if flash else self.quad * length**2
        return rows * (layers * (self.token * length + quad) + self.base * length) + layers * self.const \
            + self.base_const


def measure_decoder(config, dtype: torch.dtype, lengths=LENGTHS) -> DecoderBytes:
    """Run one and two layers of ``config`` (built with two) at each length under the storage tracker."""
    from transformers import AutoModelForCausalLM

    from bench.memtrack import StorageTracker
    from grpo_fast.train.model import autocast, disable_dropout

    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    disable_dropout(model)
    decoder, layers = model.model, model.model.layers
    grad = {}
    nograd = {}
    for n in (1, 2):
        decoder.layers = layers[:n]
        decoder.config.num_hidden_layers = n
        for S in lengths:
            ids = torch.randint(2, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
            tracker = StorageTracker(config.vocab_size, config.hidden_size)
            tracker.register([*model.parameters(), *model.buffers(), ids], "weights")
            with tracker:
                before = tracker.live_bytes
                with autocast(ids.device, dtype):
                    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
                grad[n, S] = tracker.live_bytes - before
                del hidden
                with tracker.phase("nograd"), torch.no_grad(), autocast(ids.device, dtype):
                    decoder(input_ids=ids, use_cache=False)
            peak = tracker.peaks["nograd"]
            nograd[n, S] = peak.peak_bytes - peak.start_bytes
    decoder.layers, decoder.config.num_hidden_layers = layers, 2
    per_layer = [grad[2, S] - grad[1, S] for S in lengths]
    token, quad, const = _solve_quadratic(lengths, per_layer)
    base_values = [grad[1, S] - (token * S + quad * S * S + const) for S in lengths]
    (s0, s1), (b0, b1) = (lengths[0], lengths[-1]), (base_values[0], base_values[-1])
    base = (b1 - b0) / (s1 - s0)
    nograd_slope = (nograd[2, lengths[-1]] - nograd[2, lengths[0]]) / (lengths[-1] - lengths[0])
    return DecoderBytes(token=token, quad=quad, const=const, base=base, base_const=b0 - base * s0,
                        nograd=nograd_slope)


def _solve_quadratic(xs, ys):
    """``(a, b, c)`` with ``a x + b x^2 + c = y`` through three points (exact integers in, exact solution out)."""
    A = torch.tensor([[x, x * x, 1.0] for x in xs], dtype=torch.float64)
    a, b, c = torch.linalg.solve(A, torch.tensor(ys, dtype=torch.float64)).tolist()
    return a, (b if abs(b) > 1e-6 else 0.0), c


@dataclass(frozen=True)
class StepBytes:
    """Measured logits of one method's step, in one compute dtype: the most ``[*, V]``-sized bytes alive at once
    in the rollout (per row x V), the prepare, forward and backward phases (per N x V, N = completion tokens), and
    those alive when the backward starts (``saved``, per N x V); the KV cache's bytes per element; for fused
    methods the fused op's tiles."""

    rollout: float
    prepare: float
    forward: float
    saved: float
    backward: float
    kv: float  # bytes per cached key or value element (under autocast the keys stay float32: 3 = (4 + 2) / 2)
    tiles: dict  # fused methods: the fused op's working memory by phase, in fp32 tiles (measure_fused)


CALIBRATION_SHAPE = dict(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=6000, prompts=1,
                         group_size=4, prompt_len=8, completion_len=24)


def measure_step(method: str, dtype: str, shape: dict = CALIBRATION_SHAPE) -> StepBytes:
    """One tracked step of ``method`` on a small Qwen2 (vocabulary wider than the fused op's 4096-column chunks, so
    only real logits count as logits)."""
    from bench.bench_memory import DTYPES, Shape, setup_config, tracked_step

    spec = Shape(**shape)
    name = "ppo" if METHODS[method]["ppo"] else ("grpo_fused" if METHODS[method]["fused"] else "grpo_reference")
    setup = setup_config(name, spec, torch.device("cpu"), DTYPES[dtype], seed=0)
    setup.step(phase=lambda _: contextlib.nullcontext())  # AdamW's states exist from the first step
    peaks = tracked_step(setup)
    nv = spec.rows * spec.completion_len * spec.vocab
    logits = {p: peaks[p].tag_max["logits"] for p in peaks}
    tiles = measure_fused(dtype) if METHODS[method]["fused"] else {}
    # the cache at the rollout's peak: every layer's keys and values for the positions before the last token
    elements = 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * spec.rows * (
        spec.prompt_len + spec.completion_len - 1)
    return StepBytes(rollout=logits["rollout"] / (spec.rows * spec.vocab), prepare=logits["prepare"] / nv,
                     forward=logits["forward"] / nv, saved=peaks["backward"].start_breakdown["logits"] / nv,
                     backward=logits["backward"] / nv, kv=peaks["rollout"].breakdown["kv_cache"] / elements,
                     tiles=tiles)


def calibrate(models=tuple(MODELS), dtypes=CALIBRATION_DTYPES, log=print) -> dict:
    """Measure every coefficient the model uses on this machine (CPU); returns the calibration dict."""
    result = dict(machine=harness.device_name("cpu"), torch=torch.__version__, transformers=harness._version(
        "transformers"), commit=harness.git_commit(), date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        command=harness.command_line(), lengths=list(LENGTHS), decoder={}, step={})
    for dtype in dtypes:
        result["step"][dtype] = {}
        for method in METHODS:
            if METHODS[method]["shared"]:
                continue  # the fused step's logits; its activations follow from its token count
            result["step"][dtype][method] = asdict(measure_step(method, dtype))
            log(f"  step {method} {dtype}: {result['step'][dtype][method]}")
        result["decoder"][dtype] = {}
        for name in models:
            shape = get_model(name)
            coeffs = measure_decoder(hf_config(shape, 2, vocab=512), getattr(torch, dtype))
            result["decoder"][dtype][name] = asdict(coeffs)
            log(f"  decoder {name} {dtype}: {result['decoder'][dtype][name]}")
    return result


def load_calibration(path=CALIBRATION_PATH) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--calibration: {path} does not exist; make it with grpo-fast fit --calibrate")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------------------------------
# The memory model


@dataclass(frozen=True)
class Step:
    """One training step's sizes: B prompts of P tokens, G completions of T tokens each."""

    prompts: int
    group_size: int
    prompt_len: int
    completion_len: int

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size


def adam_temporaries(shape: ModelShape, params: int, device: str) -> float:
    if device == "cuda":
        return 4.0 * params  # foreach AdamW: one fp32 temporary per parameter (analytic)
    largest = shape.vocab_size * shape.hidden_size  # the embedding; single-tensor AdamW: two temporaries of it
    return 2 * 4.0 * max(largest, shape.intermediate_size * shape.hidden_size)


def fused_tile_bytes(tokens: int, shape: ModelShape) -> int:
    """One fp32 ``[token_chunk, vocab_chunk]`` tile of the fused log-prob op's torch path (its own chunk sizes)."""
    from grpo_fast.logprobs_torch import LogprobParams, _chunk_sizes

    t, c = _chunk_sizes(tokens, shape.vocab_size, shape.hidden_size, LogprobParams())
    return t * c * 4


def measure_fused(dtype: str, rows: int = 4, tokens: int = 75, hidden: int = 64, vocab: int = 9000) -> dict:
    """The fused path's working memory beyond its inputs, outputs and gradients, in fp32 tiles: the reference's
    no-grad ``fused_logprobs`` (``prepare``), then ``grpo_loss`` as the bench's GRPO step calls it (``forward``) and
    its backward (``backward``)."""
    from bench.memtrack import StorageTracker
    from grpo_fast import GRPOLossConfig, fused_logprobs, grpo_loss

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, tokens, hidden, generator=gen).to(dt).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dt).requires_grad_(True)
    y = torch.randint(0, vocab, (rows, tokens), generator=gen)
    mask, adv = torch.ones(rows, tokens, dtype=torch.long), torch.randn(rows, generator=gen)
    tracker = StorageTracker(vocab, hidden)
    tracker.register([h, w, y, mask, adv])
    with tracker:
        with tracker.phase("prepare"), torch.no_grad():
            ref = fused_logprobs(h, w, y, impl="torch").float()
        with tracker.phase("forward"):
            out = grpo_loss(h, w, y, adv, mask, ref_logps=ref, config=GRPOLossConfig(loss_type="dapo", beta=0.04),
                            impl="torch")
        with tracker.phase("backward"):
            out.loss.backward()
    tile = fused_tile_bytes(rows * tokens, ModelShape("fused", "", hidden, vocab, 1, 1, 1, hidden, hidden, True))
    grads = h.numel() * h.element_size() + w.numel() * w.element_size()
    return {p: (tracker.peaks[p].peak_bytes - tracker.peaks[p].start_bytes - (grads if p == "backward" else 0)) / tile
            for p in ("prepare", "forward", "backward")}


def fused_workspace(tiles: dict, phase: str, tokens: int, shape: ModelShape, device: str) -> float:
    """The fused log-prob op's working memory: measured tiles on CPU; on CUDA the 64 MiB bound of DESIGN.md."""
    if device == "cuda":
        return 64 * 2**20
    return tiles[phase] * fused_tile_bytes(tokens, shape)


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, element_bytes: float) -> float:
    per_position = 2 * shape.num_key_value_heads * shape.head_dim * element_bytes * rows
    if shape.name.startswith("gemma-2-"):  # every other layer is a sliding window
        full, sliding = math.ceil(shape.num_hidden_layers / 2), shape.num_hidden_layers // 2
        return per_position * (full * length + sliding * min(length, GEMMA2_WINDOW))
    return per_position * shape.num_hidden_layers * length


def project(method: str, shape: ModelShape, step: Step, decoder: DecoderBytes, logits: StepBytes, *,
            compute_bytes: int, device: str) -> dict[str, dict[str, float]]:
    """Bytes by phase and component (the tracker's categories) of one step of ``method``."""
    m = METHODS[method]
    H, V, L = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers
    psi = shape.num_params()
    psi_critic = psi - (0 if shape.tie_word_embeddings else V * H) + H  # decoder + value head, no lm_head
    R, P, T = step.rows, step.prompt_len, step.completion_len
    S, N = P + T, R * T
    flash = device == "cuda"
    bf16 = compute_bytes != 4
    states = dict(weights=4.0 * psi + compute_bytes * psi, optimizer=8.0 * psi,
                  critic=12.0 * psi_critic if m["ppo"] else 0.0)
    if m["shared"]:  # one row per group: [prompt | c_1 .. c_G]; linear terms count tokens, the S^2 term per row
        act = decoder.grad_bytes(step.prompts, P + step.group_size * T, L, flash)
        tokens = step.prompts * P + R * T
        # the SDPA backend's per-completion copies of the prompt's keys and values and of the completions'
        # queries (float32 after the rotary embedding; FlexAttention would need none: an upper bound there)
        q_dim, kv_dim = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
        act += L * (2 * kv_dim * R * S + 2 * q_dim * N) * 4
    else:
        act = decoder.grad_bytes(R, S, L, flash)
        tokens = R * S
    head_copy = V * H * compute_bytes if bf16 else 0.0  # the loss's lm_head weight in the compute dtype
    autocast_copies = compute_bytes * psi if bf16 else 0.0  # generate runs under one autocast region
    ws = {p: fused_workspace(logits.tiles, p, N, shape, device) if m["fused"] else 0.0
          for p in ("prepare", "forward", "backward")}
    hidden = tokens * H * compute_bytes  # a no-grad decoder's output, alive while the loss head runs
    prepare = [dict(states, activations=decoder.nograd * tokens),  # inside the reference's decoder
               dict(states, activations=hidden + ws["prepare"], logits=logits.prepare * N * V)]  # its log-probs
    if m["ppo"]:  # the value pass: the critic's float32 weights are cast for it under autocast
        prepare.append(dict(states, activations=decoder.nograd * tokens + (compute_bytes * psi_critic if bf16 else 0)))
    phases = {
        "rollout": dict(states, kv_cache=kv_cache_bytes(shape, R, S - 1, logits.kv),
                        logits=logits.rollout * R * V, activations=autocast_copies),
        "prepare": max(prepare, key=lambda d: sum(d.values())),
    }
    largest = lambda *moments: max(moments, key=lambda d: sum(d.values()))  # noqa: E731
    # the end of the forward: what the backward will use (PPO: the critic's forward came after the actor's loss, so
    # its activations meet the saved logits only)
    forward_end = dict(states, activations=act + ws["forward"], logits=logits.saved * N * V)
    if m["ppo"]:
        forward_end["critic"] += act
    phases["forward"] = largest(forward_end, dict(states, activations=act + head_copy + ws["forward"],
                                                  logits=logits.forward * N * V))
    # the fused backward also holds the lm_head's gradient [V, H] fp32 and d hidden [N, H] while it runs; PPO: the
    # critic's backward runs first, its gradients exist when the actor's starts
    fused_grads = V * H * 4.0 + N * H * compute_bytes if m["fused"] else 0.0
    backward = dict(states, activations=act + head_copy + ws["backward"] + fused_grads, logits=logits.backward * N * V)
    if m["ppo"]:
        backward["critic"] += 4.0 * psi_critic
    phases["backward"] = largest(forward_end, backward)
    phases["optimizer"] = dict(states, gradients=4.0 * psi,
                               optimizer=states["optimizer"] + adam_temporaries(shape, psi + psi_critic * m["ppo"],
                                                                                device))
    if m["ppo"]:
        phases["optimizer"]["critic"] += 4.0 * psi_critic
    return phases


def peak(phases: dict) -> tuple[float, str]:
    totals = {p: sum(c.values()) for p, c in phases.items()}
    top = max(totals, key=totals.get)
    return totals[top], top


def coefficients(calibration: dict, model: str, method: str, dtype: str) -> tuple[DecoderBytes, StepBytes]:
    try:
        decoder = DecoderBytes(**calibration["decoder"][dtype][model])
    except KeyError:
        raise KeyError(f"the calibration has no {dtype} decoder measurement of {model!r}; run grpo-fast fit "
                       f"--calibrate --model {model}") from None
    base = "grpo_fused" if method == "grpo_shared" else method
    return decoder, StepBytes(**calibration["step"][dtype][base])


def largest_completion(method: str, shape: ModelShape, budget: float, prompts: int, group_size: int,
                       prompt_len: int, decoder: DecoderBytes, logits: StepBytes, *, compute_bytes: int, device: str,
                       limit: int = 65536) -> int:
    """The largest T (0: none) whose projected peak fits ``budget`` bytes; memory grows with T."""

    def fits(T: int) -> bool:
        step = Step(prompts, group_size, prompt_len, T)
        return peak(project(method, shape, step, decoder, logits, compute_bytes=compute_bytes, device=device))[0] \
            <= budget

    if not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------------------------------------------------
# The command


def parse_memory(text: str) -> int:
    """``"24GB"``, ``"80GiB"``, ``"24576MiB"``, ``"24G"`` -> bytes. GB and GiB both mean 2**30 bytes: GPU memory is
    sold in GiB under the name GB (an "80GB" H100 has 80 GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(g|gb|gib|m|mb|mib|t|tb|tib)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--memory: expected a size such as 24GB, 80GiB or 24576MiB, got {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()[0]
    return int(value * {"m": 2**20, "g": 2**30, "t": 2**40}[unit])


GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64)


def fit_table(model: str, memory: int, *, prompts: int = 1, prompt_len: int = 512, headroom: float = 0.1,
              dtype: str = "bfloat16", device: str = "cuda", calibration: dict | None = None,
              group_sizes=GROUP_SIZES) -> dict:
    """``{method: {G: largest T}}`` plus what the table assumed (states in bytes, the usable budget)."""
    calibration = calibration or load_calibration()
    shape = get_model(model)
    budget = memory * (1.0 - headroom)
    compute_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    table = {}
    for method in METHODS:
        decoder, logits = coefficients(calibration, shape.name, method, dtype)
        table[method] = {G: largest_completion(method, shape, budget, prompts, G, prompt_len, decoder, logits,
                                               compute_bytes=compute_bytes, device=device) for G in group_sizes}
    return dict(model=shape.name, table=table, budget=budget, compute_bytes=compute_bytes)


def states_bytes(method: str, shape: ModelShape, compute_bytes: int) -> float:
    psi = shape.num_params()
    psi_critic = psi - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size) + shape.hidden_size
    return (12.0 + compute_bytes) * psi + (12.0 * psi_critic if METHODS[method]["ppo"] else 0.0)


def format_fit(result: dict, memory: int, args) -> str:
    shape = get_model(result["model"])
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    lines = [f"grpo-fast fit: {shape.name} ({shape.hf_id}, {shape.num_params() / 1e9:.2f}B parameters, "
             f"V={shape.vocab_size:,}) in {gib(memory)} GiB, {args.headroom:.0%} kept free -> {gib(result['budget'])} "
             f"GiB usable",
             f"one micro-batch: {args.prompts} prompt(s) of {args.prompt_len} tokens x G completions of T tokens; "
             f"full fine-tuning, float32 master weights + AdamW, {args.dtype} forward passes, on {args.device}",
             "", "PROJECTED largest completion length T for each group size G (0: not even T=1 fits):", ""]
    methods = list(METHODS)
    lines.append("| G | " + " | ".join(methods) + " |")
    lines.append("|---:|" + "---:|" * len(methods))
    for G in next(iter(result["table"].values())):
        lines.append(f"| {G} | " + " | ".join(f"{result['table'][m][G]:,}" for m in methods) + " |")
    lines.append("")
    lines.append("states alone (weights, AdamW, reference; PPO: critic): " + ", ".join(
        f"{m} {gib(states_bytes(m, shape, result['compute_bytes']))} GiB" for m in methods))
    lines.append(f"MEASURED (calibration {args.calibration}, {args.calibration_info}): activation bytes per token of "
                 "this architecture's decoder layers, and the logits each method keeps per N x V; exact: parameter "
                 "counts, KV cache; analytic, not measured: CUDA's AdamW temporaries and fused-loss workspace.")
    return "\n".join(lines)


def summary(memory: int, group_size: int, args, calibration: dict) -> str:
    """One row per calibrated registry model: the largest T at ``group_size`` for each method."""
    methods = list(METHODS)
    lines = [f"PROJECTED largest completion length T at G={group_size} in {memory / GIB:.0f} GiB ({args.headroom:.0%} "
             f"kept free), {args.prompts} prompt(s) of {args.prompt_len} tokens, {args.dtype} on {args.device}:", "",
             "| model | params | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    for name in MODELS:
        if name not in calibration["decoder"].get(args.dtype, {}):
            continue
        shape = get_model(name)
        result = fit_table(name, memory, prompts=args.prompts, prompt_len=args.prompt_len, headroom=args.headroom,
                           dtype=args.dtype, device=args.device, calibration=calibration, group_sizes=(group_size,))
        cells = []
        for m in methods:
            T = result["table"][m][group_size]
            if not T:  # what even the shortest step needs
                decoder, logits = coefficients(calibration, name, m, args.dtype)
                need = peak(project(m, shape, Step(args.prompts, group_size, args.prompt_len, 1), decoder, logits,
                                    compute_bytes=result["compute_bytes"], device=args.device))[0]
            cells.append(f"{T:,}" if T else f"no ({need / GIB:.0f} GiB at T=1)")
        lines.append(f"| {name} | {shape.num_params() / 1e9:.2f}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser(prog: str = "python -m bench.fit") -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=prog, description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"registry name: {', '.join(MODELS)}")
    p.add_argument("--memory", help="GPU memory, e.g. 24GB, 80GB, 24576MiB (GB = GiB = 2**30 bytes)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per micro-batch (default 1)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of the memory kept free for the CUDA context and allocator slack (default 0.1)")
    p.add_argument("--dtype", choices=CALIBRATION_DTYPES, default="bfloat16", help="compute dtype (default bfloat16)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: flash attention, foreach AdamW, Triton loss bounds (default); cpu: as measured here")
    p.add_argument("--calibration", type=Path, default=CALIBRATION_PATH, help="the calibration JSON")
    p.add_argument("--summary", type=int, metavar="G", default=None,
                   help="instead of one model's table: every calibrated model's largest T at group size G")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the coefficients on this CPU and write --calibration (all registry models, or "
                        "--model's; a few minutes)")
    return p


def main(argv=None, prog: str = "python -m bench.fit") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.model is not None and args.model.lower() not in {n for m in MODELS.values() for n in (m.name,
                                                                                                     m.hf_id.lower())}:
        raise ValueError(f"--model: expected one of {', '.join(MODELS)}, got {args.model!r}")
    if args.calibrate:
        torch.set_num_threads(1)
        names = (get_model(args.model).name,) if args.model else tuple(MODELS)
        print(f"calibrating on {harness.device_name('cpu')}: {', '.join(names)}", flush=True)
        result = calibrate(names)
        if args.model and Path(args.calibration).exists():  # keep the other models' measurements
            old = json.loads(Path(args.calibration).read_text())
            for dtype, models in old.get("decoder", {}).items():
                result["decoder"].setdefault(dtype, {}).update({k: v for k, v in models.items() if k not in names})
        Path(args.calibration).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.calibration}")
        return 0
    if args.memory is None or (args.model is None and args.summary is None):
        raise ValueError("--memory and --model (or --summary G) are needed, or --calibrate")
    if not 0.0 <= args.headroom < 1.0:
        raise ValueError(f"--headroom: expected a fraction in [0, 1), got {args.headroom}")
    for name in ("prompts", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    memory = parse_memory(args.memory)
    calibration = load_calibration(args.calibration)
    args.calibration_info = f"{calibration['machine']}, {calibration['date']}"
    if Path(args.calibration).resolve().is_relative_to(harness.REPO_ROOT):
        args.calibration = Path(args.calibration).resolve().relative_to(harness.REPO_ROOT)
    if args.summary is not None:
        if args.summary < 1:
            raise ValueError(f"--summary: expected a group size >= 1, got {args.summary}")
        print(summary(memory, args.summary, args, calibration))
        return 0
    result = fit_table(args.model, memory, prompts=args.prompts, prompt_len=args.prompt_len, headroom=args.headroom,
                       dtype=args.dtype, device=args.device, calibration=calibration)
    print(format_fit(result, memory, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
