"""The measurements behind ``grpo-fast fit``: ``grpo-fast fit --calibrate`` runs them on this CPU and writes the
calibration JSON that ``grpo_fast/memory/projection.py`` projects from (the package ships one:
``grpo_fast/memory/calibration.json``). They need the storage tracker of ``bench/memtrack.py`` and the bench's
training step (``bench/bench_memory.py``), so they run from a source checkout only.

  decoder  per architecture of the registry (its real widths, a 512-token vocabulary), compute dtype and training
           mode (full fine-tuning or LoRA, each with and without activation checkpointing): one and two decoder
           layers at three lengths, under the tracker: what a training forward leaves alive, the forward's peak, the
           backward's peak through the decoder beyond that, and a no-grad forward's peak
  step     per method, dtype and mode, one tracked step of a small Qwen2 (``CALIBRATION_SHAPE``): the logits each
           phase holds per N x V and the KV cache's bytes per element; the fused op's working memory in tiles
"""

from __future__ import annotations

import contextlib
import datetime as _dt
from dataclasses import asdict

import torch

from bench import harness
from bench.memtrack import StorageTracker
from bench.models import MODELS, ModelShape, get_model
from grpo_fast.dtypes import DTYPES
from grpo_fast.memory.fit import CALIBRATION_DTYPES
from grpo_fast.memory.projection import (METHODS, MODES, Bytes, DecoderBytes, StepBytes, Training,
                                         fused_tile_bytes)

LENGTHS = (16, 32, 64)  # one row of S tokens per decoder measurement
LORA_R = 16  # the rank LoRA is measured at; projection.py scales the [S, r] terms to other ranks
GEMMA2_WINDOW = 4096
CALIBRATION_SHAPE = dict(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=6000, prompts=1,
                         group_size=4, prompt_len=8, completion_len=24)


def training_of(mode: str, lora_r: int = LORA_R) -> Training:
    return Training(lora_r=lora_r if mode.startswith("lora") else 0, checkpointing=mode.endswith("_ckpt"))


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
    return AutoConfig.for_model(fam, **kw)


# --------------------------------------------------------------------------------------------------------------------
# The decoder


def _solve_quadratic(xs, ys) -> Bytes:
    """``Bytes(token=a, quad=b, const=c)`` with ``a x + b x^2 + c = y`` through three points."""
    A = torch.tensor([[x, x * x, 1.0] for x in xs], dtype=torch.float64)
    a, b, c = torch.linalg.solve(A, torch.tensor(ys, dtype=torch.float64)).tolist()
    return Bytes(token=a, quad=b if abs(b) > 1e-6 else 0.0, const=c)


def _outside(lengths, totals, layer: Bytes) -> Bytes:
    """What one layer's measurement holds beyond ``layer``: linear in S through the shortest and longest length."""
    rest = [t - layer(1, S) for S, t in zip(lengths, totals)]
    slope = (rest[-1] - rest[0]) / (lengths[-1] - lengths[0])
    return Bytes(token=slope, const=rest[0] - slope * lengths[0])


def measure_decoder(config, dtype: torch.dtype, training: Training = Training(), lengths=LENGTHS) -> DecoderBytes:
    """Run one and two layers of ``config`` (built with two, as ``grpo-fast train`` sets the policy up for
    ``training``) at each length under the storage tracker.

    Per length: a training forward (its peak, and what is alive after it: ``layer``, ``outside``), the backward
    through the decoder to its first differentiable input (the embedding's output; LoRA without checkpointing: the
    first layer's adapters), so no weight gradients are made (the step counts those exactly), and a no-grad
    forward."""
    from bench.bench_memory import build_policy
    from grpo_fast.train.forward import decoder_of
    from grpo_fast.train.model import autocast

    config.num_hidden_layers = 2
    torch.manual_seed(0)
    model = build_policy(config, torch.device("cpu"), dtype, training)
    decoder = decoder_of(model)
    layers = decoder.layers
    embedded = {}
    hook = decoder.embed_tokens.register_forward_hook(lambda _m, _a, out: embedded.__setitem__("x", out))
    end, forward, backward, nograd = {}, {}, {}, {}
    try:
        for n in (1, 2):
            decoder.layers = layers[:n]
            decoder.config.num_hidden_layers = n
            for S in lengths:
                ids = torch.randint(2, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
                upstream = torch.randn(1, S, config.hidden_size, generator=torch.Generator().manual_seed(S))
                tracker = StorageTracker(config.vocab_size, config.hidden_size)
                tracker.register([*model.parameters(), *model.buffers(), ids, upstream], "weights")
                with tracker:
                    with tracker.phase("forward", "activations"), autocast(ids.device, dtype):
                        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
                    end[n, S] = tracker.live_bytes - tracker.peaks["forward"].start_bytes
                    x = embedded.pop("x")
                    inputs = [x] if x.requires_grad else [p for p in layers[0].parameters() if p.requires_grad]
                    grad = upstream.to(hidden.dtype)
                    with tracker.phase("backward", "activations"):
                        torch.autograd.grad(hidden, inputs, grad)
                    del hidden, x, inputs, grad
                    with tracker.phase("nograd"), torch.no_grad(), autocast(ids.device, dtype):
                        decoder(input_ids=ids, use_cache=False)
                f, b, g = tracker.peaks["forward"], tracker.peaks["backward"], tracker.peaks["nograd"]
                forward[n, S] = f.peak_bytes - f.start_bytes
                backward[n, S] = b.peak_bytes - b.start_bytes
                nograd[n, S] = g.peak_bytes - g.start_bytes
    finally:
        hook.remove()
        decoder.layers, decoder.config.num_hidden_layers = layers, 2
    layer = _solve_quadratic(lengths, [end[2, S] - end[1, S] for S in lengths])
    forward_layer = _solve_quadratic(lengths, [forward[2, S] - forward[1, S] for S in lengths])
    return DecoderBytes(
        layer=layer, outside=_outside(lengths, [end[1, S] for S in lengths], layer),
        forward_layer=forward_layer, forward_outside=_outside(lengths, [forward[1, S] for S in lengths], forward_layer),
        backward=_solve_quadratic(lengths, [backward[2, S] for S in lengths]),
        nograd=(nograd[2, lengths[-1]] - nograd[2, lengths[0]]) / (lengths[-1] - lengths[0]))


# --------------------------------------------------------------------------------------------------------------------
# The step's logits and KV cache, the fused op's tiles


def measure_step(method: str, dtype: str, training: Training = Training(),
                 shape: dict = CALIBRATION_SHAPE) -> StepBytes:
    """One tracked step of ``method`` on a small Qwen2 (vocabulary wider than the fused op's 4096-column chunks, so
    only real logits count as logits)."""
    from bench.bench_memory import Shape, setup_config, tracked_step

    spec = Shape(**shape)
    name = "ppo" if METHODS[method]["ppo"] else ("grpo_fused" if METHODS[method]["fused"] else "grpo_reference")
    setup = setup_config(name, spec, torch.device("cpu"), DTYPES[dtype], seed=0, training=training)
    setup.step(phase=lambda _: contextlib.nullcontext())  # AdamW's states exist from the first step
    peaks = tracked_step(setup)
    nv = spec.rows * spec.completion_len * spec.vocab
    logits = {p: peaks[p].tag_max["logits"] for p in peaks}
    tiles = measure_fused(dtype, train_head=not training.lora_r) if METHODS[method]["fused"] else {}
    # the cache at the rollout's peak: every layer's keys and values for the positions before the last token
    elements = 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * spec.rows * (
        spec.prompt_len + spec.completion_len - 1)
    return StepBytes(rollout=logits["rollout"] / (spec.rows * spec.vocab), prepare=logits["prepare"] / nv,
                     forward=logits["forward"] / nv, saved=peaks["backward"].start_breakdown["logits"] / nv,
                     backward=logits["backward"] / nv, kv=peaks["rollout"].breakdown["kv_cache"] / elements,
                     tiles=tiles)


def measure_fused(dtype: str, train_head: bool = True, rows: int = 4, tokens: int = 75, hidden: int = 64,
                  vocab: int = 9000) -> dict:
    """The fused path's working memory beyond its inputs, outputs and gradients, in fp32 tiles: the reference's
    no-grad ``fused_logprobs`` (``prepare``), then ``grpo_loss`` as the bench's GRPO step calls it (``forward``) and
    its backward (``backward``); ``train_head`` False: the lm_head is frozen (LoRA), no weight gradient."""
    from grpo_fast import GRPOLossConfig, fused_logprobs, grpo_loss

    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, tokens, hidden, generator=gen).to(dt).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dt).requires_grad_(train_head)
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
    grads = sum(t.numel() * t.element_size() for t in (h, w) if t.requires_grad)
    return {p: (tracker.peaks[p].peak_bytes - tracker.peaks[p].start_bytes - (grads if p == "backward" else 0)) / tile
            for p in ("prepare", "forward", "backward")}


# --------------------------------------------------------------------------------------------------------------------
# The calibration file


def calibrate(models=tuple(MODELS), dtypes=CALIBRATION_DTYPES, modes=MODES, log=print) -> dict:
    """Measure every coefficient the projection uses on this machine (CPU); returns the calibration dict."""
    result = dict(machine=harness.device_name("cpu"), torch=torch.__version__, transformers=harness._version(
        "transformers"), commit=harness.git_commit(), date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        command=harness.command_line(), lengths=list(LENGTHS), lora_r=LORA_R, decoder={}, step={})
    for dtype in dtypes:
        result["step"][dtype], result["decoder"][dtype] = {}, {}
        for mode in modes:
            training = training_of(mode)
            steps = result["step"][dtype][mode] = {}
            for method in training.methods():
                if METHODS[method]["shared"]:
                    continue  # the fused step's logits; its activations follow from its token count
                steps[method] = asdict(measure_step(method, dtype, training))
                log(f"  step {dtype} {mode} {method}: {steps[method]}")
            decoders = result["decoder"][dtype][mode] = {}
            for name in models:
                coeffs = measure_decoder(hf_config(get_model(name), 2, vocab=512), DTYPES[dtype], training)
                decoders[name] = asdict(coeffs)
                log(f"  decoder {dtype} {mode} {name}: {decoders[name]}")
    return result


def merge(new: dict, old: dict, names) -> dict:
    """``new`` plus ``old``'s decoder measurements of the models not in ``names`` (a ``--calibrate --model`` run)."""
    for dtype, modes in old.get("decoder", {}).items():
        for mode, models in modes.items():
            kept = {k: v for k, v in models.items() if k not in names}
            new["decoder"].setdefault(dtype, {}).setdefault(mode, {}).update(kept)
    return new
