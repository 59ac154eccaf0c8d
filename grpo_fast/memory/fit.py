"""``grpo-fast fit``: the largest group size x completion length that fits a GPU, per method, from a memory model.

The memory model (grpo_fast/memory/projection.py) adds up, phase by phase, what one training step keeps alive:
weights, AdamW states, the reference and gradients exactly from the parameter count; activations, logits and the KV
cache from coefficients MEASURED on CPU under a storage tracker (grpo_fast/memory/calibration.json, shipped with the
package; grpo-fast fit --calibrate re-measures them from a source checkout). Every number in the tables is a
PROJECTION from them; tests/test_memory.py holds the projections to 5% of tracked measurements of full steps at a CPU
size the calibration did not see, in every training mode.

Training: full fine-tuning (float32 master weights and AdamW, a frozen reference in the compute dtype), or with
--lora-r R the trainer's LoRA (adapters on the attention projections; the frozen base in the compute dtype; the
reference is the base with the adapters disabled, no copy; gradients and optimizer states for the adapters only),
with --load-in-4bit over a 4-bit base (QLoRA: the decoder's projections in bitsandbytes' NF4 layout with double
quantization, the rest in the compute dtype; r=16 unless --lora-r says otherwise), with or without
--gradient-checkpointing (each decoder layer's input kept, its activations recomputed in the backward). --optim is
the trainer's optimizer (default adamw_torch_fused; adamw_8bit: 8-bit AdamW states; the paged ones are counted as
if their states stayed on the GPU). Without --lora-r, --gradient-checkpointing or --load-in-4bit the tables of the
three usual set-ups are printed: full fine-tuning, full + checkpointing, and LoRA r=16 + checkpointing; with
--load-in-4bit alone, QLoRA r=16 with and without checkpointing. PPO (actor, critic, reference) is modelled for full
fine-tuning with the default optimizer only, as the baseline.

Assumptions: the grpo-fast trainer's mixed precision (bf16 forward passes under autocast); one micro-batch = B
prompts x G completions, every completion T tokens long; flash attention on CUDA; --headroom (default 10%) of the
memory kept free for the CUDA context and allocator slack. Not modelled: micro-batches smaller than the group,
sharding over several GPUs, paged optimizers' eviction to CPU memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import textwrap
from pathlib import Path

import torch

from grpo_fast.dtypes import DTYPES
from grpo_fast.helptext import PlainHelpFormatter
from grpo_fast.memory.models import MODELS, get_model
from grpo_fast.memory.projection import (DEFAULT_OPTIM, MAX_COMPLETION, Step, Training, calibration_path,
                                         coefficients, largest_completion, load_calibration, optimizers, peak,
                                         project, states_bytes, trained_params)

CALIBRATION_DTYPES = ("float32", "bfloat16")
GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64)
GIB = 1024**3
# what --summary and --model print when no --lora-r or --gradient-checkpointing is given
USUAL_TRAININGS = (Training(), Training(checkpointing=True), Training(lora_r=16, checkpointing=True))
QLORA_TRAININGS = (Training(lora_r=16, load_in_4bit=True), Training(lora_r=16, checkpointing=True, load_in_4bit=True))


def parse_memory(text: str) -> int:
    """``"24GB"``, ``"80GiB"``, ``"24576MiB"``, ``"24G"`` -> bytes. GB and GiB both mean 2**30 bytes: GPU memory is
    sold in GiB under the name GB (an "80GB" H100 has 80 GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(g|gb|gib|m|mb|mib|t|tb|tib)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--memory: expected a size such as 24GB, 80GiB or 24576MiB, got {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()[0]
    size = int(value * {"m": 2**20, "g": 2**30, "t": 2**40}[unit])
    if size < 1:
        raise ValueError(f"--memory: expected a size such as 24GB, 80GiB or 24576MiB, got {text!r} (no memory)")
    return size


def fit_table(model: str, memory: int, *, prompts: int = 1, prompt_len: int = 512, headroom: float = 0.1,
              dtype: str = "bfloat16", device: str = "cuda", training: Training = Training(),
              calibration: dict | None = None, group_sizes=GROUP_SIZES) -> dict:
    """``{method: {G: largest T}}`` for ``training`` plus what the table assumed (the usable budget, bytes per
    compute element)."""
    calibration = calibration or load_calibration()
    shape = get_model(model)
    budget = memory * (1.0 - headroom)
    compute_bytes = torch.empty((), dtype=DTYPES[dtype]).element_size()
    table = {}
    for method in training.methods():
        decoder, logits = coefficients(calibration, shape.name, method, dtype, training)
        table[method] = {G: largest_completion(method, shape, budget, prompts, G, prompt_len, decoder, logits,
                                               compute_bytes=compute_bytes, device=device, training=training,
                                               calibrated_lora_r=calibration["lora_r"]) for G in group_sizes}
    return dict(model=shape.name, training=training, table=table, budget=budget, compute_bytes=compute_bytes)


# the tables' columns, one per method (grpo_fast.memory.projection.METHODS)
COLUMNS = {
    "ppo": "PPO as TRL's PPOTrainer runs it (actor, critic, frozen reference; log-probs through the [N, V] logits): "
           "the baseline",
    "grpo_reference": "GRPO with its loss on the materialised [N, V] logits, as TRL's GRPOTrainer computes it",
    "grpo_fused": "GRPO with grpo-fast's fused loss, no [N, V] tensor: what grpo-fast train does",
    "grpo_shared": "grpo_fused with each group's prompt run once per forward (grpo-fast train --shared-prefix, on "
                   "by default where it saves tokens)",
}


def legend(cells: bool = True) -> str:
    """What the columns (and with ``cells``, the cells of a G x T table) mean: under the tables and in --help."""
    methods = "; ".join(f"{name}: {text}" for name, text in COLUMNS.items())
    return f"Columns: {methods}." + (f" A cell: the longest completion T (tokens) whose training step fits at that "
                                     f"group size G; 0: not even T=1 fits; {MAX_COMPLETION:,}+: at least that (the "
                                     "search stops there)." if cells else "")


def cell(T: int) -> str:
    return f"{T:,}+" if T >= MAX_COMPLETION else f"{T:,}"  # the search stops there


def need_at_one_token(calibration: dict, model: str, method: str, group_size: int, args, training: Training) -> float:
    """The projected peak of the shortest step (T = 1): what a cell that does not fit would need."""
    decoder, logits = coefficients(calibration, model, method, args.dtype, training)
    compute_bytes = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    phases = project(method, get_model(model), Step(args.prompts, group_size, args.prompt_len, 1), decoder, logits,
                     compute_bytes=compute_bytes, device=args.device, training=training,
                     calibrated_lora_r=calibration["lora_r"])
    return peak(phases)[0]


def _states_line(shape, training: Training, compute_bytes: int) -> str:
    parts = []
    for m in training.methods():
        parts.append(f"{m} {sum(states_bytes(m, shape, compute_bytes, training).values()) / GIB:.1f} GiB")
    optimizer = "8-bit AdamW" if training.optim in ("adamw_8bit", "paged_adamw_8bit") else "AdamW"
    what = (f"4-bit base with its compute-dtype embeddings, adapters, their {optimizer}" if training.load_in_4bit
            else f"frozen base, adapters, their {optimizer}" if training.lora_r else f"weights, {optimizer}, reference")
    ppo = "; PPO: critic" if "ppo" in training.methods() else ""
    return (f"states alone ({what}{ppo}), {trained_params(shape, training) / 1e6:,.1f}M trained parameters: "
            + ", ".join(parts))


def format_fit(results: list[dict], memory: int, args, calibration: dict) -> str:
    """One model's G x T table for each training set-up in ``results``."""
    shape = get_model(results[0]["model"])
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    lines = [f"grpo-fast fit: {shape.name} ({shape.hf_id}, {shape.num_params() / 1e9:.2f}B parameters, "
             f"V={shape.vocab_size:,}) in {gib(memory)} GiB, {args.headroom:.0%} kept free -> "
             f"{gib(results[0]['budget'])} GiB usable",
             f"one micro-batch: {args.prompts} prompt(s) of {args.prompt_len} tokens x G completions of T tokens; "
             f"{args.dtype} forward passes, on {args.device}"]
    for result in results:
        training, methods = result["training"], list(result["table"])
        lines += ["", f"PROJECTED largest completion length T for each group size G, {training.describe()} "
                      "(0: not even T=1 fits):", "",
                  "| G | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
        for G in result["table"][methods[0]]:
            lines.append(f"| {G} | " + " | ".join(cell(result["table"][m][G]) for m in methods) + " |")
        lines += ["", _states_line(shape, training, result["compute_bytes"])]
    lines += ["", legend(), "", _measured_line(args, calibration)]
    return "\n".join(lines)


def _measured_line(args, calibration: dict) -> str:
    return (f"MEASURED (calibration {args.calibration_name}: {calibration['machine']}, {calibration['date']}, LoRA at "
            f"r={calibration['lora_r']}): activation bytes of this architecture's decoder layers per training mode, "
            "the logits each method keeps per N x V, the KV cache's bytes per element; exact: parameter counts, the "
            "4-bit layout and 8-bit optimizer states; analytic, not measured: CUDA's optimizer temporaries and "
            "fused-loss workspace, other LoRA ranks' [S, r] terms, the 4-bit matmul's dequantized weight.")


def nothing_fits(args, calibration: dict, cases) -> ValueError:
    """The error for a ``--memory`` that holds not even the shortest step of any ``(model, training, method, G)`` in
    ``cases``: it names the smallest of them and the memory that one needs."""
    need, name, training, method, G = min(
        ((need_at_one_token(calibration, name, method, G, args, training), name, training, method, G)
         for name, training, method, G in cases), key=lambda case: case[0])
    return ValueError(
        f"--memory: {args.memory} holds nothing: the smallest step it was asked about ({name}, {method}, "
        f"{training.describe()}, G={G}, T=1) needs {need / GIB:.1f} GiB, so at least "
        f"{need / (1 - args.headroom) / GIB:.1f} GiB with {args.headroom:.0%} kept free (--headroom)")


def summary(memory: int, group_size: int, args, calibration: dict, trainings) -> str:
    """One table per training set-up, one row per calibrated registry model: the largest T at ``group_size``."""
    cases, fitted = [], False
    lines = [f"PROJECTED largest completion length T at G={group_size} in {memory / GIB:.0f} GiB ({args.headroom:.0%} "
             f"kept free), {args.prompts} prompt(s) of {args.prompt_len} tokens, {args.dtype} on {args.device}; "
             "no (X GiB at T=1): even the shortest step needs X GiB; 65,536+: at least that (the search stops "
             "there)."]
    for training in trainings:
        methods = training.methods()
        lines += ["", f"{training.describe()}:", "",
                  "| model | params | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
        calibrated = calibration["decoder"].get(args.dtype, {}).get(training.mode, {})
        for name in (n for n in MODELS if n in calibrated):
            result = fit_table(name, memory, prompts=args.prompts, prompt_len=args.prompt_len,
                               headroom=args.headroom, dtype=args.dtype, device=args.device, training=training,
                               calibration=calibration, group_sizes=(group_size,))
            cells = []
            for m in methods:
                T = result["table"][m][group_size]
                cases.append((name, training, m, group_size))
                fitted |= T > 0
                cells.append(cell(T) if T else
                             f"no ({need_at_one_token(calibration, name, m, group_size, args, training) / GIB:.0f} "
                             "GiB at T=1)")
            lines.append(f"| {name} | {get_model(name).num_params() / 1e9:.2f}B | " + " | ".join(cells) + " |")
    if cases and not fitted:
        raise nothing_fits(args, calibration, cases)
    lines += ["", legend(cells=False), "", _measured_line(args, calibration)]
    return "\n".join(lines)


def build_parser(prog: str = "grpo-fast fit") -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    epilog = "\n\n".join([*doc[1:], textwrap.fill(legend(), 116)])
    p = argparse.ArgumentParser(prog=prog, description=doc[0], epilog=epilog, allow_abbrev=False,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--model", help=f"registry name: {', '.join(MODELS)}")
    p.add_argument("--memory", help="GPU memory, e.g. 24GB, 80GB, 24576MiB (GB = GiB = 2**30 bytes)")
    p.add_argument("--lora-r", type=int, default=None, metavar="R",
                   help="LoRA rank, as grpo-fast train --lora-r (0: full fine-tuning)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing, as grpo-fast train --gradient-checkpointing")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="QLoRA, as grpo-fast train --load-in-4bit: the base's projections in 4 bits (LoRA r=16 unless "
                        "--lora-r)")
    p.add_argument("--optim", choices=optimizers(), default=DEFAULT_OPTIM,
                   help=f"the optimizer, as grpo-fast train --optim (default {DEFAULT_OPTIM})")
    p.add_argument("--prompts", type=int, default=1, help="prompts per micro-batch (default 1)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of the memory kept free for the CUDA context and allocator slack (default 0.1)")
    p.add_argument("--dtype", choices=CALIBRATION_DTYPES, default="bfloat16", help="compute dtype (default bfloat16)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: flash attention, foreach AdamW, Triton loss bounds (default); cpu: as measured here")
    p.add_argument("--calibration", type=Path, default=None,
                   help="the calibration JSON (default: the one shipped with the package)")
    p.add_argument("--summary", type=int, metavar="G", default=None,
                   help="instead of one model's table: every calibrated model's largest T at group size G")
    p.add_argument("--calibrate", action="store_true",
                   help="from a source checkout: measure the coefficients on this CPU and write --calibration (all "
                        "registry models, or --model's; about 10 minutes on 2 cores)")
    return p


def trainings_of(args) -> tuple[Training, ...]:
    optim = getattr(args, "optim", DEFAULT_OPTIM)
    if getattr(args, "load_in_4bit", False):
        if args.lora_r is None:
            trainings = QLORA_TRAININGS[1:] if args.gradient_checkpointing else QLORA_TRAININGS
        else:
            trainings = (Training(lora_r=args.lora_r, checkpointing=args.gradient_checkpointing, load_in_4bit=True),)
    elif args.lora_r is None and not args.gradient_checkpointing:
        trainings = USUAL_TRAININGS
    else:
        trainings = (Training(lora_r=args.lora_r or 0, checkpointing=args.gradient_checkpointing),)
    return tuple(dataclasses.replace(t, optim=optim) for t in trainings)


def calibrate(args) -> int:
    from grpo_fast.memory import source_module

    bench = source_module("calibrate_memory", "fit --calibrate")
    torch.set_num_threads(1)
    names = (get_model(args.model).name,) if args.model else tuple(MODELS)
    path = Path(args.calibration or calibration_path())
    print(f"calibrating on {bench.harness.device_name('cpu')}: {', '.join(names)}", flush=True)
    result = bench.calibrate(names)
    if args.model and path.exists():  # keep the other models' measurements
        result = bench.merge(result, json.loads(path.read_text()), names)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def _joined_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``--memory -5GB`` as ``--memory=-5GB``: argparse takes a value that starts with '-' for an option and answers
    with the usage text; joined, the value's own check names what is wrong with it."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv=None, prog: str = "grpo-fast fit") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(prog).parse_args(_joined_values(argv, ("--memory",)))
    if args.model is not None and args.model.lower() not in {n for m in MODELS.values() for n in (m.name,
                                                                                                     m.hf_id.lower())}:
        raise ValueError(f"--model: expected one of {', '.join(MODELS)}, got {args.model!r}")
    if args.calibrate:
        return calibrate(args)
    if args.memory is None or (args.model is None and args.summary is None):
        raise ValueError("--memory and --model (or --summary G) are needed, or --calibrate")
    if not 0.0 <= args.headroom < 1.0:
        raise ValueError(f"--headroom: expected a fraction in [0, 1), got {args.headroom}")
    for name in ("prompts", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    trainings = trainings_of(args)
    memory = parse_memory(args.memory)
    calibration = load_calibration(args.calibration)
    args.calibration_name = args.calibration or "grpo_fast/memory/calibration.json"
    if args.summary is not None:
        if args.summary < 1:
            raise ValueError(f"--summary: expected a group size >= 1, got {args.summary}")
        print(summary(memory, args.summary, args, calibration, trainings))
        return 0
    results = [fit_table(args.model, memory, prompts=args.prompts, prompt_len=args.prompt_len,
                         headroom=args.headroom, dtype=args.dtype, device=args.device, training=training,
                         calibration=calibration) for training in trainings]
    if not any(T for result in results for column in result["table"].values() for T in column.values()):
        raise nothing_fits(args, calibration, [(args.model, result["training"], method, min(GROUP_SIZES))
                                               for result in results for method in result["table"]])
    print(format_fit(results, memory, args, calibration))
    return 0
