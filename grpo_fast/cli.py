"""``grpo-fast``: the command line. ``grpo-fast train --help`` lists every option with its default."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import shlex
import sys
from pathlib import Path

TRAIN_DESCRIPTION = """\
Train a causal LM with GRPO. With no arguments: a tiny Qwen2 learns the built-in 'digits' task
("max 3 8 1 6=" -> "8") on the CPU in a few minutes, with a held-out evaluation before and after.

Options come from (later wins): the defaults below, --config FILE (.toml or .yaml; the loss options in a [loss]
table), then the flags. Lists are comma-separated (--rewards math,format). Outputs in --output-dir:
metrics.jsonl, reward_kl.png, config.json, checkpoints/.
"""


class Parser(argparse.ArgumentParser):
    """No abbreviated options (``--step 3`` is not ``--steps 3``), and an error is one line that says what came and
    what the nearest known option is; the subcommands' parsers are of this class too."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            known = [o for a in self._actions for o in a.option_strings]
            flags = [w for w in unknown.split() if w.startswith("-")]
            near = difflib.get_close_matches(flags[0].split("=")[0], known, n=1, cutoff=0.75) if flags else []
            message = f"unknown option(s): {unknown}" + (f"; did you mean {near[0]}?" if near else "")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train_parser(sub) -> argparse.ArgumentParser:
    from grpo_fast.train.config import field_help

    p = sub.add_parser("train", help="train with GRPO (no arguments: the built-in CPU demo)",
                       usage="grpo-fast train [--config FILE] [--OPTION VALUE ...]",
                       description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="a .toml or .yaml file of options")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, flag, default, text in field_help():
        group = groups.setdefault(section, p.add_argument_group(section))
        is_bool = default in ("True", "False")
        group.add_argument(flag, dest=flag[2:], metavar="BOOL" if is_bool else "VALUE", default=argparse.SUPPRESS,
                           nargs="?" if is_bool else None, const="true" if is_bool else None,
                           help=f"{text} (default: {default})")
    return p


# what bad input (options, files, model, data, rewards, output directory, checkpoint) raises before the first step
_INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError, AttributeError)
INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: the same options, ``--overwrite`` dropped and ``--resume`` added."""
    ran_as_module = bool(sys.argv) and Path(sys.argv[0]).parts[-2:] == ("grpo_fast", "__main__.py")
    prog = "python -m grpo_fast" if ran_as_module else "grpo-fast"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # its launcher's options are not ours to know
        prog = "torchrun [the same torchrun options] -m grpo_fast"
    args, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=")[0]
        if name in ("--overwrite", "--resume"):
            # a bool flag takes an optional value: --overwrite, --overwrite true, --overwrite=true
            skip = "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("-")
            continue
        args.append(a)
    return f"{prog} {shlex.join([*args, '--resume'])}"


def _flag_names(message: str, overrides: dict) -> str:
    """The message with each config field the user set by a flag named as that flag: ``TrainConfig.max_new_tokens``
    -> ``--max-new-tokens``, ``GRPOLossConfig.beta`` -> ``--loss.beta`` (fields from a file keep their names)."""
    def flag(match: re.Match) -> str:
        owner, field = match.groups()
        dest = f"loss.{field}" if owner == "GRPOLossConfig" else field.replace("_", "-")
        return f"--{dest}" if dest in overrides else match.group(0)

    return re.sub(r"\b(TrainConfig|GRPOLossConfig)\.(\w+)", flag, message)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from grpo_fast.train import build_config, fit, prepare
    from grpo_fast.train.config import read_config_file
    from grpo_fast.train.distributed import shutdown
    from grpo_fast.train.trainer import TrainingInterrupted

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        file_values = read_config_file(args.config) if args.config else {}
        prepared = prepare(build_config(file_values, overrides, file_name=f"--config {args.config}"))
    except _INPUT_ERRORS as e:  # a one-line message that names the option; errors later keep their traceback
        print(f"grpo-fast {args.command}: error: {_flag_names(str(e), overrides)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grpo-fast {args.command}: interrupted before the first step; nothing was trained or saved",
              file=sys.stderr)
        return INTERRUPTED
    try:
        summary = fit(prepared)
    except TrainingInterrupted as e:
        if prepared.run.world.is_main:
            if e.checkpoint is None:  # nothing to resume from: the run starts afresh, over what it left
                again = resume_command(argv).removesuffix(" --resume") + " --overwrite"
                print(f"grpo-fast {args.command}: {e}; nothing to resume: start again with: {again}", file=sys.stderr)
            else:
                print(f"grpo-fast {args.command}: {e}; resume with: {resume_command(argv)}", file=sys.stderr)
        if e.clean:  # every rank stopped at the same step: leave the process group together
            world = prepared.run.world
            del prepared
            shutdown(world)
        return INTERRUPTED
    world = prepared.run.world
    if world.is_main:
        print(summary.line())
    del prepared  # the model and its DDP/FSDP2 wrapper go before the process group they use
    shutdown(world)
    return 0


# ------------------------------------------------------------------------------------------------ bench and fit

BENCH_DESCRIPTION = """\
Benchmarks that run from a source checkout (they live in bench/, which pip does not install).

  grpo-fast bench memory [OPTIONS]   GRPO vs PPO: one training step of each method, each in a fresh process, peak
                                     memory by component (weights, gradients, optimizer, activations, logits, critic,
                                     KV cache) and step time; CSV + PNG in bench/results/. --help for the options.
"""

FIT_DESCRIPTION = ("the largest group size x completion length that fits a GPU, per method, for full fine-tuning, "
                   "LoRA and activation checkpointing (--help for more)")


def _parsed_elsewhere(argv: list[str]) -> int | None:
    """``grpo-fast fit ...`` (grpo_fast.memory.fit) and ``grpo-fast bench memory ...`` (bench/bench_memory.py, from
    a source checkout): handed to those modules' own parsers (their --help is the full one); None for every other
    command."""
    if argv[:1] == ["fit"]:
        command, rest = "fit", argv[1:]
    elif argv[:2] == ["bench", "memory"]:
        command, rest = "bench memory", argv[2:]
    else:
        return None
    try:
        if command == "fit":
            from grpo_fast.memory import fit

            return fit.main(rest, prog="grpo-fast fit")
        from grpo_fast.memory import source_module

        mod = source_module("bench_memory", command)
        return mod.main(rest, prog=f"grpo-fast {command}", command=mod.cli_command(rest))
    except _INPUT_ERRORS as e:
        print(f"grpo-fast {command}: error: {e}", file=sys.stderr)
        return 2


def _elsewhere_parsers(sub) -> None:
    """Entries for the top-level --help; the commands themselves are parsed by their modules."""
    sub.add_parser("bench", help="benchmarks from a source checkout: bench memory (GRPO vs PPO memory)",
                   description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_parser("fit", help=FIT_DESCRIPTION, description=FIT_DESCRIPTION)


# ------------------------------------------------------------------------------------------------ doctor


def _doctor_parser(sub) -> None:
    """``grpo-fast doctor``: its options and description live in grpo_fast/doctor.py (run there by ``_doctor``)."""
    from grpo_fast import doctor

    p = sub.add_parser("doctor", help="versions, devices, the path impl='auto' picks, and a one-minute self-check "
                                      "of grpo_loss against the float64 reference on this machine",
                       description=doctor.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_arguments(p)
    p.set_defaults(run=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from grpo_fast import doctor

    return doctor.run(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    code = _parsed_elsewhere(argv)
    if code is not None:
        return code
    parser = Parser(prog="grpo-fast", description="GRPO with fused Triton kernels: no logits.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _elsewhere_parsers(sub)
    _doctor_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's parser says it: its prog, and the nearest of its own options
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 logs below warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s" if "RANK" not in os.environ
                        else f"%(asctime)s [rank {rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    if hasattr(args, "run"):  # a subcommand that names its own function
        return args.run(args)
    if args.command != "train":  # "grpo-fast bench" without a benchmark name
        parser.parse_args([args.command, "--help"])
    return _train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
