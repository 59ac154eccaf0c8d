"""One GRPO training step with each group's prompt shared (run once) vs unshared (run G times): tokens, time, memory.

A training step is what the trainer runs per micro-batch (grpo_fast/train/trainer.py ``hidden_and_head`` and
``policy_update``): the policy's decoder forward (under ``torch.autocast`` in the compute dtype, float32 master
weights), ``grpo_loss`` from the completion hidden states and the lm_head weight (the trainer's default loss: DAPO,
beta 0.04 against given reference log-probs, epsilon 0.2, one update per generation), ``loss.backward()``.
The two forwards:

  unshared  ``completion_hidden`` on ``[prompt | completion]`` rows, the prompt repeated G times (G*(P+C) tokens)
  shared    ``shared_prefix_forward``: one ``[prompt | c_1 | ... | c_G]`` row per group (P + G*C tokens)

Configurations: prompt:completion ratios (default 8:1, 1:1, 1:8) of ``--total-len`` tokens per sequence (P + C; 512
gives P=455 C=57, P=C=256, P=57 C=455) times group sizes G (default 4 and 16), ``--groups`` groups per step. Prompts
and completions are full length (no padding), so the tokens through the model are exactly the analytic counts.
Model: a Qwen2 built from a config with random weights (seeded), Qwen2.5-0.5B's proportions scaled to ``--hidden``
(head_dim 64, 2 KV heads, MLP width 4864/896 of the hidden size, q/k/v bias, tied embeddings), ``--layers`` layers,
``--vocab`` rows in the (tied) lm_head.

Correctness guard: before any timing, each configuration's loss and per-token log-probs from the shared and the
unshared forward are computed in float32 (whatever ``--dtype``) and compared with the tolerance rule of
``grpo_fast.testing`` against the unshared forward in float64: ``|shared - fp64| <= 2 |unshared - fp64| + 1e-5``.
(The loss alone would be a weak check: with one update per generation only its KL term depends on the hidden
states.) A configuration that fails is not timed.

Isolation: on CPU the check and each forward are timed in their own fresh process (peak memory is the process's peak
RSS, so it must hold nothing else); on CUDA one fresh process per configuration runs the check and both forwards
(the allocator's statistics separate them), which keeps the GPU run short.

CSV columns (one row per configuration; default ``bench/results/prefix_<device>.csv``, overwritten each run; the PNG
is drawn from it next to it):
  ratio, P, C, G, groups  the configuration (P prompt tokens, C completion tokens per sequence)
  tokens_unshared/_shared tokens through the decoder per step, counted at the decoder's input during the run
  bound                   the analytic speed-up, tokens_unshared / tokens_shared = G(P+C) / (P+GC)
  flop_ratio              the speed-up the step's FLOPs predict: linear layers 6 FLOPs per parameter per token,
                          causal attention 12 * heads * head_dim per (query, key) pair, the loss head 6 * H * V per
                          completion token (the same in both forwards, so this is <= bound)
  unshared_ms, shared_ms  median step time over --reps timed steps after --warmup (harness.measure); *_min_ms the
                          fastest; *_times_ms every timed step
  speedup                 unshared_ms / shared_ms (measured)
  unshared_cpu_ms, shared_cpu_ms, cpu_speedup  the same from the process's CPU time per step (median of the timed
                          steps): on a machine shared with other work, CPU time counts only the time the step ran,
                          so with one thread it is the steadier figure; on CUDA it is host time only
  unshared_peak_mib, shared_peak_mib  peak memory of warm-up and timed steps beyond the model and inputs (CPU: peak
                          RSS of the process, CUDA: the caching allocator's peak), parameter gradients included
  grads_mib               of which the parameter gradients (the same in both)
  mem_ratio               unshared_peak_mib / shared_peak_mib (measured; > 1: sharing needs less)
  loss_fp64, loss_unshared, loss_shared, loss_err, loss_bound, logps_err, logps_bound, check
                          the correctness guard: float32 losses, errors against float64 and the rule's bounds;
                          check is "ok" or "FAIL"
  unshared_loss, shared_loss  the first timed step's loss (in --dtype)
  error                   why a configuration has no numbers (failed check, out of memory, timeout), else empty
  then the harness's columns: device, threads, library versions, commit, src_sha, date, command
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/bench_prefix.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench import harness
from bench.models import get_model
from grpo_fast.dtypes import SHORT_DTYPES

MODES = ("unshared", "shared")
PROPORTIONS = "qwen2.5-0.5b"  # the architecture the benchmark model is a scaled-down copy of
HEAD_DIM, KV_HEADS = 64, 2


# --------------------------------------------------------------------------------------------------------------------
# Shapes and the analytic counts


def split_length(total: int, ratio: str) -> tuple[int, int]:
    """``(P, C)`` with ``P + C = total`` in the ratio ``"p:c"`` (rounded, both at least 1)."""
    p, c = (float(x) for x in ratio.split(":"))
    P = min(max(1, round(total * p / (p + c))), total - 1)
    return P, total - P


def bound(P: int, C: int, G: int) -> float:
    """The analytic speed-up of sharing: tokens through the model unshared over shared, ``G(P+C) / (P+GC)``."""
    return G * (P + C) / (P + G * C)


def model_config(hidden: int, layers: int, vocab: int) -> dict:
    """``Qwen2Config`` keyword arguments: Qwen2.5-0.5B's proportions (bench/models.py) at hidden size ``hidden``."""
    ref = get_model(PROPORTIONS)
    if hidden % HEAD_DIM:
        raise ValueError(f"--hidden must be a multiple of the head size {HEAD_DIM}, got {hidden}")
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=min(KV_HEADS, hidden // HEAD_DIM),
                intermediate_size=32 * round(hidden * ref.intermediate_size / ref.hidden_size / 32),
                tie_word_embeddings=ref.tie_word_embeddings, max_position_embeddings=4096, attention_dropout=0.0)


def step_flops(cfg: dict, P: int, C: int, G: int, groups: int) -> tuple[float, float]:
    """FLOPs of one forward + backward step, (unshared, shared): see ``flop_ratio`` in the module docstring."""
    H, heads, kv, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    linear = 2 * H * heads * HEAD_DIM + 2 * H * kv * HEAD_DIM + 3 * H * inter  # parameters per layer (q, o, k, v, MLP)
    per_pair = 12 * heads * HEAD_DIM  # QK^T and AV, 2 FLOPs per multiply-add, backward twice the forward

    def pairs(n):
        return n * (n + 1) // 2

    layers = cfg["num_hidden_layers"]
    head = 6 * H * cfg["vocab_size"] * groups * G * C
    unshared = groups * G * (P + C) * 6 * linear * layers + groups * G * pairs(P + C) * per_pair * layers
    shared = groups * (P + G * C) * 6 * linear * layers + \
        groups * (pairs(P) + G * (C * P + pairs(C))) * per_pair * layers
    return unshared + head, shared + head


# --------------------------------------------------------------------------------------------------------------------
# Model, inputs and one training step (these run inside the isolated child processes)


def build_model(shape: dict, device: str):
    """The seeded benchmark model: float32 parameters (the trainer's master weights), train mode, SDPA attention."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(shape["seed"])
    config = Qwen2Config(**model_config(shape["hidden"], shape["layers"], shape["vocab"]),
                         attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.float().train()


def make_batch(shape: dict, device: str) -> dict:
    """A micro-batch as a rollout stores it: ``groups * G`` rows, each prompt repeated for its G completions."""
    P, C, G, B, V = shape["P"], shape["C"], shape["G"], shape["groups"], shape["vocab"]
    g = torch.Generator().manual_seed(shape["seed"] + 1)
    prompt_ids = torch.randint(1, V, (B, P), generator=g).repeat_interleave(G, 0)
    completion_ids = torch.randint(1, V, (B * G, C), generator=g)
    ref_logps = -math.log(V) - 0.5 + 0.5 * torch.randn(B * G, C, generator=g)  # near the policy's, moderate KL
    batch = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                 completion_mask=torch.ones_like(completion_ids), advantages=torch.randn(B * G, generator=g),
                 ref_logps=ref_logps)
    return {k: v.to(device) for k, v in batch.items()}


def training_loss(model, batch: dict, mode: str, dtype: torch.dtype, backend: str):
    """The loss of one micro-batch exactly as the trainer computes it (``LossOutput``)."""
    from grpo_fast import grpo_loss
    from grpo_fast.train.config import DEFAULT_LOSS
    from grpo_fast.train.forward import completion_hidden, head_of
    from grpo_fast.train.model import autocast
    from grpo_fast.train.shared_prefix import shared_prefix_forward

    G = batch["G"]
    args = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
    # the float64 oracle runs a float64 copy of the model without autocast (which has no float64 mode)
    with autocast(args[0].device, dtype) if dtype != torch.float64 else contextlib.nullcontext():
        if mode == "shared":  # one prompt row per group, as the trainer slices it
            hidden = shared_prefix_forward(model, args[0][::G], args[1][::G], *args[2:], group_size=G,
                                           backend=backend)
        else:
            hidden = completion_hidden(model, *args)
    weight = head_of(model).weight.to(dtype)
    return grpo_loss(hidden.to(dtype), weight, batch["completion_ids"], batch["advantages"], batch["completion_mask"],
                     ref_logps=batch["ref_logps"], config=DEFAULT_LOSS)


class TokenCounter:
    """Tokens entering the decoder (its ``input_ids``) during the last forward."""

    def __init__(self, model):
        from grpo_fast.train.forward import decoder_of

        self.last = 0
        self.handle = decoder_of(model).register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.last = kwargs["input_ids"].numel() if "input_ids" in kwargs else args[0].numel()


def check(model, batch: dict, backend: str) -> dict:
    """The correctness guard: float32 loss and per-token log-probs, shared and unshared, against float64 unshared."""
    import copy

    from grpo_fast.testing import ATOL, max_abs_err

    model64 = copy.deepcopy(model).double()
    batch64 = dict(batch, advantages=batch["advantages"].double(), ref_logps=batch["ref_logps"].double())
    with torch.no_grad():
        ref = training_loss(model64, batch64, "unshared", torch.float64, backend)
        del model64
        out_pt = training_loss(model, batch, "unshared", torch.float32, backend)
        out = training_loss(model, batch, "shared", torch.float32, backend)
    mask = batch["completion_mask"].bool()
    res = dict(loss_fp64=float(ref.loss), loss_unshared=float(out_pt.loss), loss_shared=float(out.loss))
    for name, got, pt, want in [("loss", out.loss, out_pt.loss, ref.loss),
                                ("logps", out.per_token_logps[mask], out_pt.per_token_logps[mask],
                                 ref.per_token_logps[mask])]:
        res[f"{name}_err"] = max_abs_err(got, want)
        res[f"{name}_bound"] = 2.0 * max_abs_err(pt, want) + ATOL[torch.float32]
    ok = res["loss_err"] <= res["loss_bound"] and res["logps_err"] <= res["logps_bound"]
    res["check"] = "ok" if ok else "FAIL"
    return res


def time_mode(model, batch: dict, mode: str, dtype: torch.dtype, backend: str, warmup: int, reps: int,
              device: str) -> dict:
    """Warm-up and timed training steps of one forward; peak memory over all of them (``harness.measure``)."""
    counter = TokenCounter(model)
    first, cpu_ms = [], []

    def clear_grads():  # each step allocates its own parameter gradients, as after optimizer.zero_grad(None)
        model.zero_grad(set_to_none=True)

    def step():
        t0 = time.process_time()
        out = training_loss(model, batch, mode, dtype, backend)
        out.loss.backward()
        if not first:
            first.append(float(out.loss.detach()))
        cpu_ms.append((time.process_time() - t0) * 1e3)

    m = harness.measure(step, warmup=warmup, reps=reps, device=device, setup=clear_grads)
    counter.handle.remove()
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    return dict(tokens=counter.last, median_ms=m.median_ms, min_ms=m.min_ms, times_ms=list(m.times_ms),
                cpu_ms=statistics.median(cpu_ms[warmup:]),
                peak_extra_bytes=m.peak_extra_bytes, grads_bytes=grads, memory_method=m.memory_method,
                loss=first[0])


def run_config(*, shape: dict, modes: list, check_first: bool, device: str, dtype: str, threads: int,
               warmup: int, reps: int, backend: str) -> dict:
    """Child process: the correctness guard (if asked) and the timing of ``modes`` on one configuration."""
    torch.set_num_threads(threads)
    model = build_model(shape, device)
    batch = dict(make_batch(shape, device), G=shape["G"])
    result = {}
    if check_first:
        result["check"] = check(model, batch, backend)
        if result["check"]["check"] != "ok":
            return result
    # one step of each mode on tiny inputs first: lazy imports, thread pools and kernel selection are one-off costs
    # of a process, not memory a training step needs (harness.measure)
    tiny = dict(make_batch(dict(shape, P=4, C=3, G=2, groups=1), device), G=2)
    for mode in modes:
        training_loss(model, tiny, mode, SHORT_DTYPES[dtype], backend).loss.backward()
    model.zero_grad(set_to_none=True)
    for mode in modes:
        result[mode] = time_mode(model, batch, mode, SHORT_DTYPES[dtype], backend, warmup, reps, device)
        model.zero_grad(set_to_none=True)
    return result


# --------------------------------------------------------------------------------------------------------------------
# The driver (parent process)


def _parse_args(argv=None):
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_prefix", description=doc[0],
        epilog="\n\n".join(doc[1:]) + "\n\nExamples:\n"
               "  OMP_NUM_THREADS=1 python -m bench.bench_prefix               # CPU, bench/results/prefix_cpu.csv\n"
               "  python -m bench.bench_prefix --device cuda --dtype bf16 --hidden 1024 --layers 8 --groups 4\n"
               "  python -m bench.bench_prefix --replot                        # redraw the PNG from the CSV",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["auto", *SHORT_DTYPES], default="auto",
                   help="compute dtype of the timed steps (autocast, float32 master weights); auto: fp32 on CPU, "
                        "bf16 on CUDA. The correctness guard always runs in fp32 against fp64")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H, a multiple of 64 (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary V, the lm_head's rows (default 32768)")
    p.add_argument("--groups", type=int, default=1, help="prompts (groups) per training step (default 1)")
    p.add_argument("--total-len", type=int, default=512, help="P + C tokens per sequence (default 512)")
    p.add_argument("--ratios", nargs="+", default=["8:1", "1:1", "1:8"], metavar="P:C",
                   help="prompt:completion ratios (default 8:1 1:1 1:8)")
    p.add_argument("--group-sizes", nargs="+", type=int, default=[4, 16], metavar="G",
                   help="completions per prompt (default 4 16)")
    p.add_argument("--backend", choices=["sdpa", "flex"], default="sdpa",
                   help="shared_prefix_forward's attention backend (default sdpa; flex needs CUDA for the backward)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per forward (default 1 on CPU, 3 on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per forward (default 3 on CPU, 10 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="model and input seed (default 0)")
    p.add_argument("--csv", type=Path, default=None,
                   help="output CSV, overwritten (default bench/results/prefix_<device>.csv); the PNG goes next to it")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from --csv")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process (default 1800)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="CPU: address-space cap per child process (default 90%% of MemAvailable; 0 = no cap)")
    args = p.parse_args(argv)
    for r in args.ratios:
        parts = r.split(":")
        if len(parts) != 2 or not all(x.replace(".", "", 1).isdigit() and float(x) > 0 for x in parts):
            p.error(f"--ratios: expected P:C with positive numbers, got {r!r}")
    if args.total_len < 2 or min(args.group_sizes) < 1 or args.groups < 1:
        p.error("--total-len must be >= 2, --group-sizes and --groups >= 1")
    if args.hidden % HEAD_DIM:
        p.error(f"--hidden must be a multiple of {HEAD_DIM}")
    return args


def _shapes(args) -> list[dict]:
    shapes = []
    for ratio in args.ratios:
        P, C = split_length(args.total_len, ratio)
        for G in args.group_sizes:
            shapes.append(dict(ratio=ratio, P=P, C=C, G=G, groups=args.groups, hidden=args.hidden,
                               layers=args.layers, vocab=args.vocab, seed=args.seed))
    return shapes


def _children(run: dict) -> list[tuple[bool, list]]:
    """(check first?, modes) per child process of one configuration: see Isolation in the module docstring."""
    if torch.device(run["device"]).type == "cuda":
        return [(True, list(MODES))]
    return [(True, []), (False, ["unshared"]), (False, ["shared"])]


def _measure_config(shape: dict, run: dict) -> dict:
    """One configuration's CSV row; ``error`` says what went wrong, if anything."""
    from grpo_fast.train.shared_prefix import token_counts

    P, C, G, groups = shape["P"], shape["C"], shape["G"], shape["groups"]
    cfg = model_config(shape["hidden"], shape["layers"], shape["vocab"])
    flops = step_flops(cfg, P, C, G, groups)
    tokens = token_counts(P, C, groups, G)
    row = dict(benchmark="grpo_step_shared_prefix", ratio=shape["ratio"], P=P, C=C, G=G, groups=groups,
               H=shape["hidden"], layers=shape["layers"], V=shape["vocab"], dtype=run["dtype"],
               backend=run["backend"], warmup=run["warmup"], reps=run["reps"],
               tokens_unshared=tokens[0], tokens_shared=tokens[1], bound=round(bound(P, C, G), 4),
               flop_ratio=round(flops[0] / flops[1], 4))
    env = harness.env_fields(run["device"])  # per configuration: the code these child processes import
    res, error = {}, ""
    for check_first, modes in _children(run):
        try:
            res.update(harness.run_isolated(
                "bench.bench_prefix:run_config",
                dict(shape=shape, modes=modes, check_first=check_first, device=run["device"], dtype=run["dtype"],
                     threads=run["threads"], warmup=run["warmup"], reps=run["reps"], backend=run["backend"]),
                timeout=run["timeout"], mem_limit_bytes=run["mem_limit"]))
        except harness.IsolatedError as e:
            error = f"{'check' if check_first else ' and '.join(modes)}: {e}"
            break
        if res.get("check", {}).get("check") == "FAIL":
            error = "not timed: the shared forward's loss or log-probs break the tolerance rule"
            break
    if "check" in res:
        row.update({k: v for k, v in res["check"].items() if k != "check"})
    for mode in MODES:
        if mode not in res:
            continue
        r = res[mode]
        if r["tokens"] != row[f"tokens_{mode}"]:
            error = error or f"{mode}: {r['tokens']} tokens entered the decoder, token_counts says " \
                             f"{row[f'tokens_{mode}']}"
        row.update({f"{mode}_ms": round(r["median_ms"], 2), f"{mode}_min_ms": round(r["min_ms"], 2),
                    f"{mode}_cpu_ms": round(r["cpu_ms"], 2),
                    f"{mode}_peak_mib": round(r["peak_extra_bytes"] / harness.MIB, 1),
                    f"{mode}_loss": r["loss"], f"{mode}_times_ms": ";".join(f"{t:.1f}" for t in r["times_ms"])})
        row["grads_mib"] = round(r["grads_bytes"] / harness.MIB, 1)
        row["memory_method"] = r["memory_method"]
    if all(m in res for m in MODES):
        row["speedup"] = round(row["unshared_ms"] / row["shared_ms"], 3)
        row["cpu_speedup"] = round(row["unshared_cpu_ms"] / row["shared_cpu_ms"], 3) if row["shared_cpu_ms"] else ""
        if row["shared_peak_mib"] > 0:
            row["mem_ratio"] = round(row["unshared_peak_mib"] / row["shared_peak_mib"], 3)
    row.update(check=res.get("check", {}).get("check", ""), error=error,
               load_avg_1m=round(os.getloadavg()[0], 2), **env)  # other work on the machine skews CPU timings
    return row


COLUMN_ORDER = ["benchmark", "ratio", "P", "C", "G", "groups", "H", "layers", "V", "dtype", "backend", "warmup",
                "reps", "tokens_unshared", "tokens_shared", "bound", "flop_ratio", "unshared_ms", "shared_ms",
                "speedup", "unshared_cpu_ms", "shared_cpu_ms", "cpu_speedup", "unshared_peak_mib", "shared_peak_mib",
                "grads_mib", "mem_ratio", "check", "loss_fp64", "loss_unshared", "loss_shared", "loss_err",
                "loss_bound", "logps_err", "logps_bound", "unshared_loss", "shared_loss", "unshared_min_ms",
                "shared_min_ms", "unshared_times_ms", "shared_times_ms", "memory_method", "load_avg_1m", "error"]


def _ordered(row: dict) -> dict:
    return {**{k: row[k] for k in COLUMN_ORDER if k in row}, **row}


def results_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        head = [r["ratio"], r["P"], r["C"], r["G"], r["tokens_unshared"], r["tokens_shared"],
                f"{float(r['bound']):.2f}x", f"{float(r['flop_ratio']):.2f}x"]
        if r.get("speedup", "") == "":
            body.append(head + ["", "", "", "", "", "", "", r.get("check", ""), str(r["error"])[:70]])
            continue
        cpu = f"{float(r['cpu_speedup']):.2f}x" if r.get("cpu_speedup", "") != "" else ""
        body.append(head + [float(r["unshared_ms"]), float(r["shared_ms"]), f"{float(r['speedup']):.2f}x", cpu,
                            float(r["unshared_peak_mib"]), float(r["shared_peak_mib"]),
                            f"{float(r['mem_ratio']):.2f}x" if r.get("mem_ratio", "") != "" else "",
                            r["check"], r["error"]])
    return harness.markdown_table(
        ["P:C", "P", "C", "G", "tokens unshared", "tokens shared", "bound G(P+C)/(P+GC)", "FLOP ratio",
         "unshared ms", "shared ms", "speed-up", "speed-up (CPU time)", "unshared peak MiB", "shared peak MiB",
         "memory ratio", "check", "error"], body)


def plot(csv_path) -> Path:
    """The PNG next to ``csv_path``, from the CSV alone: measured speed-up and memory ratio per configuration against
    the analytic bound and the FLOP ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = harness.read_csv(csv_path)
    labels = [f"{r['ratio']}\nG={r['G']}" for r in rows]
    x = range(len(rows))

    def values(col):
        return [float(r[col]) if r.get(col) else 0.0 for r in rows]

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows) + 2), 4.2))
    w = 0.26
    for j, (col, color, label) in enumerate([("speedup", "#1b7837", "speed-up (median wall time)"),
                                             ("cpu_speedup", "#a6dba0", "speed-up (CPU time)"),
                                             ("mem_ratio", "#2166ac", "memory ratio (peak)")]):
        bars = ax.bar([i + (j - 1) * w for i in x], values(col), w, color=color, label=label)
        ax.bar_label(bars, fmt="{:.2f}", fontsize=7, padding=1)
    for col, color, lw, label in [("bound", "black", 2.5, "bound G(P+C)/(P+GC)"),
                                  ("flop_ratio", "#d6604d", 1.5, "FLOP ratio (loss head included)")]:
        for i, v in enumerate(values(col)):
            ax.plot([i - 1.6 * w, i + 1.6 * w], [v, v], color=color, lw=lw, zorder=2.5,
                    label=label if i == 0 else None)
    for i, r in enumerate(rows):
        if r.get("error"):
            ax.text(i, 0.05, "error", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("unshared / shared")
    r0 = rows[0]
    ax.set_title(f"shared-prefix training step: H={r0['H']}, {r0['layers']} layers, V={r0['V']}, P+C="
                 f"{int(r0['P']) + int(r0['C'])}, {r0['groups']} group(s), {r0['dtype']}\n{r0['device']}, "
                 f"{r0['num_threads']} thread(s), torch {r0['torch']}, commit {r0['commit']}", fontsize=8)
    top = max(values("bound") + values("speedup") + values("cpu_speedup") + values("mem_ratio") + [1.0])
    ax.set_ylim(0, 1.3 * top)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png = Path(csv_path).with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(device).type == "cuda"
    csv_path = args.csv or harness.RESULTS_DIR / f"prefix_{torch.device(device).type}.csv"
    if args.replot:
        print(f"plot: {plot(csv_path)}")
        return 0
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # env_fields records it
    run = dict(device=device, threads=threads, backend=args.backend, timeout=args.timeout,
               dtype=args.dtype if args.dtype != "auto" else ("bf16" if on_cuda else "fp32"),
               warmup=args.warmup if args.warmup is not None else (3 if on_cuda else 1),
               reps=args.reps if args.reps is not None else (10 if on_cuda else 3),
               # RLIMIT_AS would also cap CUDA's virtual address reservations
               mem_limit=None if on_cuda else harness.default_mem_limit(args.mem_limit_gib))
    shapes = _shapes(args)
    env = harness.env_fields(device)
    print(f"shared-prefix training step on {env['device']}, {threads} thread(s), {run['dtype']}, torch {env['torch']}, "
          f"commit {env['commit']}: H={args.hidden}, {args.layers} layers, V={args.vocab}, P+C={args.total_len}, "
          f"{args.groups} group(s); {len(shapes)} configurations, warmup {run['warmup']}, reps {run['reps']}",
          flush=True)
    rows, t_start = [], time.perf_counter()
    for k, shape in enumerate(shapes, 1):
        print(f"  [{k}/{len(shapes)}] {shape['ratio']:>4} P={shape['P']} C={shape['C']} G={shape['G']} ... ",
              end="", flush=True)
        t0 = time.perf_counter()
        row = _measure_config(shape, run)
        rows.append(_ordered(row))
        harness.write_csv(csv_path, rows)  # after every configuration: a run stopped by a timeout keeps its rows
        if row.get("speedup", "") != "":
            print(f"check {row['check']}; {row['unshared_ms']:.0f} -> {row['shared_ms']:.0f} ms "
                  f"({row['speedup']:.2f}x, bound {row['bound']:.2f}x), peak {row['unshared_peak_mib']:.0f} -> "
                  f"{row['shared_peak_mib']:.0f} MiB  [{time.perf_counter() - t0:.0f} s]"
                  + (f"  ({row['error']})" if row["error"] else ""), flush=True)
        else:
            print(f"ERROR: {row['error']}", flush=True)
    if len({r.get("src_sha") for r in rows}) > 1:
        print("\nWARNING: the source tree changed during the run; rows measured different code (see the commit and "
              "src_sha columns).", file=sys.stderr)
    try:
        png = plot(csv_path)
    except ImportError as e:  # matplotlib is optional (the GPU machine may lack it): the CSV is the result
        png = f"not drawn ({e})"
    print()
    print(results_table(rows))
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s; CSV: {csv_path}; plot: {png}")
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
