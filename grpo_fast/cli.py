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

from grpo_fast.helptext import PLAIN_FORMATTERS

TRAIN_DESCRIPTION = """\
Train a causal LM with GRPO. With no arguments: a tiny Qwen2 learns the built-in 'digits' task
("max 3 8 1 6=" -> "8") on the CPU in 2-5 minutes, with a held-out evaluation before and after.

Options come from (later wins): the defaults below, --config FILE (.toml or .yaml, the loss options in a [loss]
table; or a run's own config.json), then the flags. Lists are comma-separated (--rewards math,format). TRL's
names --learning-rate, --num-generations, --max-completion-length and --num-iterations are taken for --lr,
--group-size, --max-new-tokens and --mu. --resume --output-dir DIR alone continues that run with its own options
(DIR/config.json); a flag given with it must match the run's, but for the few a resume may change. Outputs in --output-dir:
metrics.jsonl, reward_kl.png, config.json, checkpoints/, and model/: the trained model (save_pretrained; see
grpo-fast export and grpo-fast eval).
"""


class Parser(argparse.ArgumentParser):
    """No abbreviated options (``--step 3`` is not ``--steps 3``), an error is one line that says what came and
    what the nearest known option is (or its ``hints`` entry), and --help is plain text
    (``grpo_fast.helptext.plain_text``); the subcommands' parsers are of this class too."""

    hints: dict[str, str] = {}  # an unknown flag -> what to say instead of the nearest known one

    def __init__(self, *args, allow_abbrev: bool = False, formatter_class=None, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev,
                         formatter_class=PLAIN_FORMATTERS.get(formatter_class, formatter_class), **kwargs)

    def error(self, message: str):
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            known = [o for a in self._actions for o in a.option_strings]
            flags = [w for w in unknown.split() if w.startswith("-")]
            first = flags[0].split("=")[0] if flags else ""
            near = difflib.get_close_matches(first, known, n=1, cutoff=0.75) if flags else []
            message = f"unknown option(s): {unknown}" + (f"; {self.hints[first]}" if first in self.hints else
                                                         f"; did you mean {near[0]}?" if near else "")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train_parser(sub) -> argparse.ArgumentParser:
    from grpo_fast.train.config import TRL_ALIASES, TRL_NEAR, field_help

    p = sub.add_parser("train", help="train with GRPO (no arguments: the built-in CPU demo)",
                       usage="grpo-fast train [--config FILE] [--OPTION VALUE ...]",
                       description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="a .toml or .yaml file of options, or a run's config.json")
    p.hints = {f"--{name.replace('_', '-')}": hint for name, hint in TRL_NEAR.items()}
    aliases = {f"--{target.replace('_', '-')}": f"--{name.replace('_', '-')}" for name, target in TRL_ALIASES.items()}
    p.add_argument("--debug", action="store_true",
                   help="with an error (a bad option, a reward function that raised), also print its traceback")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, flag, default, text in field_help():
        group = groups.setdefault(section, p.add_argument_group(section))
        is_bool = default in ("True", "False")
        names = (flag, aliases[flag]) if flag in aliases else (flag,)  # TRL's name of the same option, too
        group.add_argument(*names, dest=flag[2:], metavar="BOOL" if is_bool else "VALUE", default=argparse.SUPPRESS,
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


def _option_names(message: str, overrides: dict, file_values: dict, file_name: str) -> str:
    """The message with each config field named as the user set it: by its flag (``TrainConfig.max_new_tokens`` ->
    ``--max-new-tokens``, ``GRPOLossConfig.beta`` -> ``--loss.beta``; the loss fields the trainer sets, by the
    option they come from: ``GRPOLossConfig.temperature`` -> ``--temperature``), unless its value came from the
    config file and no flag overrode it: then by the file's key as typed (``reward-weights``, ``loss.beta``), the
    message starting with ``file_name`` (``--config c.toml: ...``)."""
    from grpo_fast.train.config import TRAINER_OWNED_FROM, field_help

    flags = {flag[2:].replace("-", "_"): flag for _, flag, _, _ in field_help()}  # max_new_tokens: --max-new-tokens
    typed: dict[str, str] = {}  # option (loss.beta) -> the file's key for it as typed
    for key, value in file_values.items():
        if not isinstance(key, str):
            continue
        if key == "loss" and isinstance(value, dict):  # a [loss] table
            typed.update({f"loss.{k.replace('-', '_')}": f"loss.{k}" for k in value if isinstance(k, str)})
        else:
            typed[key.replace("-", "_")] = key
    overridden = {k.replace("-", "_") for k in overrides}
    from_file = []

    def name(match: re.Match) -> str:
        owner, field = match.groups()
        option = TRAINER_OWNED_FROM.get(field, f"loss.{field}") if owner == "GRPOLossConfig" else field
        if option in typed and option not in overridden:
            from_file.append(option)
            return typed[option]
        return flags.get(option, match.group(0))

    named = re.sub(r"\b(TrainConfig|GRPOLossConfig)\.(\w+(?:\.\w+)?)", name, message)
    if from_file and not named.startswith(f"{file_name}: "):
        named = f"{file_name}: {named}"
    return named


def _error(args: argparse.Namespace, message: str, error: BaseException) -> None:
    """The one line of an error on stderr, after its traceback with ``--debug``."""
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    print(f"grpo-fast {args.command}: error: {message}", file=sys.stderr)


def _reward_failed(args: argparse.Namespace, argv: list[str], e) -> int:
    """A reward function raised (``RewardError``, its message ends with when): one line that says what is saved and
    how to go on; the function's traceback with ``--debug``. Exit status 1 (train and eval alike): the run failed,
    not its options."""
    if e.checkpoint is not None:
        then = f"resume from {e.checkpoint}: fix the function, then run: {resume_command(argv)}"
    elif args.command == "eval":
        then = "nothing was written: fix the function and run the same command again"
    else:
        then = "nothing was trained or saved: fix the function and run the same command again"
    debug = "" if args.debug else " (--debug: the traceback)"
    _error(args, f"{e}; {then}{debug}", e.error)
    return 1


def _log_above_progress_bar():
    """While the progress bar is up, log records go through ``tqdm.write`` (above the bar) instead of onto its line."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def _quiet_libraries() -> None:
    """No transformers progress bars ("Loading weights", "Writing model shards"), no matplotlib INFO lines and not
    bitsandbytes' missing-CPU-kernel message inside grpo-fast's own output; their other warnings still show."""
    from transformers.utils import logging as transformers_logging

    from grpo_fast.bnb_layout import quiet_cpu_kernel_message

    transformers_logging.disable_progress_bar()
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    quiet_cpu_kernel_message()


def train_overrides(args: argparse.Namespace) -> dict:
    """The TrainConfig options a parsed ``train`` command line sets (its own flags, --config and --debug, left out)."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "config", "debug")}


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from grpo_fast.train import fit, prepare
    from grpo_fast.train.config import read_config_file, resumed_config
    from grpo_fast.train.distributed import shutdown
    from grpo_fast.train.rewards import RewardError
    from grpo_fast.train.checkpoint import DiskFull
    from grpo_fast.train.lifecycle import RunComplete, TrainingInterrupted

    overrides = train_overrides(args)
    file_values: dict = {}
    try:
        file_values = read_config_file(args.config) if args.config else {}
        prepared = prepare(resumed_config(file_values, overrides, file_name=f"--config {args.config}"))
    except RewardError as e:  # in the evaluation before the first step
        e.when = e.when or "in the evaluation before training"
        return _reward_failed(args, argv, e)
    except RunComplete as e:  # --resume of a finished run: nothing to do, and a clean exit
        if e.world.is_main:
            print(f"grpo-fast {args.command}: {e}")
        shutdown(e.world)
        return 0
    except _INPUT_ERRORS as e:  # a one-line message that names the option; errors later keep their traceback
        _error(args, _option_names(str(e), overrides, file_values, f"--config {args.config}"), e)
        return 2
    except KeyboardInterrupt:
        print(f"grpo-fast {args.command}: interrupted before the first step; nothing was trained or saved",
              file=sys.stderr)
        return INTERRUPTED
    try:
        with _log_above_progress_bar():
            summary = fit(prepared)
    except RewardError as e:
        return _reward_failed(args, argv, e)
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
    except DiskFull as e:  # the partial file was removed; the message says which checkpoint is intact
        if prepared.run.world.is_main:
            _error(args, str(e), e)
        return 1
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
                                     KV cache) and step time; CSV + PNG in ./grpo_fast_bench/ (--csv
                                     bench/results/memory_cpu.csv rewrites the committed one). --help for the options.
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


def _layout_parser(sub) -> None:
    """``grpo-fast layout``: the log-prob launchers' memory plan for a shape (``grpo_fast.kernels.logprob_layout``,
    pure Python: nothing runs)."""
    from grpo_fast.kernels import logprob_layout

    p = sub.add_parser("layout", help="where the log-prob kernels' temporaries and accumulator live for a shape "
                                      "(N H V), planned from sizes alone", description=logprob_layout.DESCRIPTION)
    logprob_layout.add_arguments(p)
    p.set_defaults(run=lambda args: logprob_layout.run(args, p))


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


# ------------------------------------------------------------------------------------------------ export and eval

EXPORT_DESCRIPTION = """\
Turn a training checkpoint into a save_pretrained directory: what output_dir/model/ holds at the end of a run.

CHECKPOINT is a checkpoint-NNNNNN.pt file or, from an FSDP2 run, a checkpoint-NNNNNN.dcp directory (in
output_dir/checkpoints/). The model is rebuilt from the run's config saved in the checkpoint (the built-in tiny
model from its seed, or the --model directory it was trained from, which must still exist) and its weights loaded.
OUT_DIR gets model.safetensors, config.json, generation_config.json and the tokenizer (chat template included);
a LoRA run gets its adapter in PEFT's format instead, or with --merge-lora the merged full weights.
"""

EVAL_DESCRIPTION = """\
Evaluate a saved model (output_dir/model of a run, or grpo-fast export's OUT_DIR) the way a run evaluates before
and after training: the same prompt rendering (chat template, --system-prompt), generation and reward functions.
Greedy decoding by default: on a builtin task's held-out split this reproduces the run's eval_after. --samples K
samples K completions per prompt at --temperature (default 1.0) and reports mean@K (mean reward over all
completions) and pass@K (share of prompts with a completion scoring >= --pass-threshold). Prints a table and writes
every prompt's rewards to --output (JSON; default: eval.json inside the --model directory).

  grpo-fast eval --model runs/grpo-fast/model --dataset builtin:digits
  grpo-fast eval --model out/model --dataset test.jsonl --rewards math --samples 8 --temperature 0.7
"""


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="a checkpoint -> a save_pretrained model directory",
                       usage="grpo-fast export CHECKPOINT OUT_DIR [--merge-lora]", description=EXPORT_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint-*.pt file or checkpoint-*.dcp directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (new or empty)")
    p.add_argument("--merge-lora", action="store_true", help="LoRA runs: merged full weights instead of the adapter")


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a saved model on a dataset with the run's evaluation",
                       usage="grpo-fast eval --model DIR --dataset FILE [--rewards R,...] [--samples K] [...]",
                       description=EVAL_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    # strings, converted and checked by _eval (one-line errors that name the flag)
    add = p.add_argument
    add("--model", metavar="DIR", help="saved model directory (full weights or a LoRA adapter)")
    add("--dataset", metavar="FILE", help="builtin:NAME (its held-out split) or a .jsonl/.json/.parquet file")
    add("--rewards", metavar="R,...", default=None, help="reward functions: math, exact, format, code, "
        "module:function or path.py:function; none: the --environment's get_reward() alone (default: the run's "
        "--rewards when --model is a run's model/ directory, read from the run's config.json; else math)")
    add("--reward-weights", metavar="W,...", default=None, help="one weight per reward (default: the run's, with "
        "the run's rewards; else all 1)")
    add("--samples", metavar="K", default="1", help="completions per prompt (default 1: greedy)")
    add("--temperature", metavar="T", default=None, help="sampling temperature (default: 0, greedy, for one "
        "sample; 1.0 for --samples > 1)")
    add("--top-p", metavar="P", default="1.0", help="nucleus sampling (default 1.0: off)")
    add("--max-new-tokens", metavar="N", default=None, help="longest completion (default: the model's "
        "generation_config.json max_new_tokens, which a run sets to its own; else 256)")
    add("--limit", metavar="N", default=None, help="evaluate the first N prompts (default: all of a file; "
        "256 of a builtin task, as a run)")
    add("--batch-size", metavar="N", default="64", help="completions per generation call (default 64)")
    add("--prompt-column", metavar="NAME", default="prompt", help="column holding the prompt (default: prompt)")
    add("--system-prompt", metavar="TEXT", default=None, help="system message before each prompt (chat models)")
    add("--max-prompt-length", metavar="N", default="512", help="longer prompts are refused (default 512)")
    add("--pass-threshold", metavar="X", default="1.0", help="reward that counts as solved for pass@K (default 1.0)")
    add("--base-model", metavar="DIR", default=None, help="base model of a LoRA adapter (default: the adapter's "
        "base_model_name_or_path)")
    add("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    add("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    add("--seed", metavar="N", default="0", help="sampling seed (default 0)")
    add("--tools", metavar="T,...", default="", help="tools the model may call, as the run's --tools (built-in "
        "calc, python, module:function or path.py:function; default: none)")
    add("--environment", metavar="SPEC", default=None, help="the run's --environment (module:Class or "
        "path.py:Class; its get_reward() is a reward of weight 1)")
    add("--max-tool-calling-iterations", metavar="N", default=None, help="rounds of tool calls per completion "
        "(default: no limit but --max-new-tokens)")
    add("--max-tool-response-length", metavar="N", default=None, help="tool results cut to this many tokens "
        "(default: no limit)")
    add("--output", metavar="FILE", default=None, help="JSON result file, replaced (default: eval.json inside the "
        "--model directory)")
    add("--debug", action="store_true", help="with an error (a bad option, a reward function that raised), also "
        "print its traceback")


def _run_rewards(model: str) -> tuple[str, str | None]:
    """``grpo-fast eval``'s rewards when ``--rewards`` is not given: those of the run whose ``model/`` directory
    ``model`` is (its ``config.json`` one level up, as every run writes it), with their weights; else ``math`` (the
    train default). Logged, so the scores say what scored them."""
    from grpo_fast.train.config import run_options

    path = Path(model).parent / "config.json"
    if Path(model).name == "model":
        try:
            values = run_options(path.parent)  # {} without the file
        except ValueError:  # unreadable: not a run's options, so the train default
            values = {}
        rewards = values.get("rewards")
        if isinstance(rewards, list) and rewards and all(isinstance(r, str) for r in rewards):
            weights = values.get("reward_weights") or []
            logging.getLogger("grpo_fast.eval").info("scoring with the run's rewards %s (from %s; --rewards "
                                                     "chooses others)", ",".join(rewards), path)
            return ",".join(rewards), ",".join(str(w) for w in weights) if isinstance(weights, list) else None
    return "math", None


def _eval_options(args: argparse.Namespace):
    """``EvalOptions`` from the parsed strings; a ValueError names the flag of a value that does not convert, or
    that no run could take (a temperature below 0.01 but for 0, greedy; a seed beyond 32 bits)."""
    from grpo_fast.checks import temperature_value
    from grpo_fast.train.config import check_seed
    from grpo_fast.train.evaluation import EvalOptions

    def convert(flag, kind, value):
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{flag}: expected {'an int' if kind is int else 'a number'}, got {value!r}") from None

    if not args.model or not args.dataset:
        raise ValueError(f"{'--model' if not args.model else '--dataset'} is required (grpo-fast eval --help)")
    temperature = convert("--temperature", float, args.temperature)
    if temperature is not None and temperature > 0:  # 0 is greedy; below 0 and NaN: EvalOptions.check
        temperature_value("--temperature", temperature)
    seed = check_seed("--seed", convert("--seed", int, args.seed))
    rewards, weights = args.rewards, args.reward_weights
    if rewards is None:
        rewards, run_weights = _run_rewards(args.model)
        weights = run_weights if weights is None else weights
    return EvalOptions(
        model=args.model, dataset=args.dataset, rewards=[r.strip() for r in rewards.split(",") if r.strip()],
        reward_weights=[convert("--reward-weights", float, w) for w in (weights or "").split(",") if w.strip()],
        samples=convert("--samples", int, args.samples), temperature=temperature,
        top_p=convert("--top-p", float, args.top_p),
        max_new_tokens=convert("--max-new-tokens", int, args.max_new_tokens),
        limit=convert("--limit", int, args.limit), batch_size=convert("--batch-size", int, args.batch_size),
        prompt_column=args.prompt_column, system_prompt=args.system_prompt,
        max_prompt_length=convert("--max-prompt-length", int, args.max_prompt_length),
        pass_threshold=convert("--pass-threshold", float, args.pass_threshold), base_model=args.base_model,
        device=args.device, dtype=args.dtype, seed=seed, tools=[t.strip() for t in args.tools.split(",") if t.strip()],
        environment=args.environment,
        max_tool_calling_iterations=convert("--max-tool-calling-iterations", int, args.max_tool_calling_iterations),
        max_tool_response_length=convert("--max-tool-response-length", int, args.max_tool_response_length),
    )


def _model_command(args: argparse.Namespace, argv: list[str]) -> int:
    """``grpo-fast export`` and ``grpo-fast eval``: bad input is one line naming the argument, exit code 2; a reward
    function that raised in eval is one line naming it, exit code 1 (as in train). ``--debug``: the traceback too."""
    import json

    from grpo_fast.train.rewards import RewardError

    try:
        if args.command == "export":
            from grpo_fast.train.export import export_checkpoint

            out = export_checkpoint(args.checkpoint, args.out_dir, merge_lora=args.merge_lora)
            print(f"grpo-fast export: {args.checkpoint} -> {out}")
            return 0
        from grpo_fast.train.checkpoint import check_writable
        from grpo_fast.train.evaluation import RESULT_FILE, evaluate_model, result_table

        options = _eval_options(args)
        options.check()  # --model first: the default --output is inside it
        output = Path(args.output) if args.output else Path(options.model) / RESULT_FILE
        if output.is_dir():
            raise ValueError(f"--output: expected a file path, got the directory {str(output)!r}")
        check_writable(output.parent, "--output" if args.output else "--output (default: inside --model)")
        result = evaluate_model(options)
    except RewardError as e:
        e.when = e.when or "in the evaluation"
        return _reward_failed(args, argv, e)
    except _INPUT_ERRORS as e:
        _error(args, str(e), e)
        return 2
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(result_table(result))
    print(f"results: {output}")
    return 0


CONVERT_DESCRIPTION = """\
Re-save a checkpoint of an older grpo-fast in the current format, which holds tensors and plain values only.

Checkpoints are read without unpickling anything else (a pickle can run code), so --resume and grpo-fast export
refuse a checkpoint of an older grpo-fast, whose numpy RNG state is pickled as a numpy array. Converting unpickles
OLD in full, running any code it holds: --trust says OLD is a checkpoint you made or otherwise trust. NEW may be
OLD (converted in place, atomically); an FSDP2 checkpoint-*.dcp directory is converted whole.
"""


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert-checkpoint", help="re-save an older grpo-fast checkpoint in the current format "
                                                  "(unpickles it in full: --trust)",
                       usage="grpo-fast convert-checkpoint OLD NEW --trust", description=CONVERT_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", metavar="OLD", help="checkpoint-*.pt file or checkpoint-*.dcp directory")
    p.add_argument("new", metavar="NEW", help="the converted checkpoint to write (OLD again: in place)")
    p.add_argument("--trust", action="store_true", help="unpickle OLD in full: it runs any code OLD holds")
    p.set_defaults(run=_convert)


def _convert(args: argparse.Namespace) -> int:
    from grpo_fast.train.checkpoint import convert

    try:
        if not args.trust:
            raise ValueError("--trust is required: converting unpickles OLD in full, which runs any code it holds; "
                             "pass --trust for a checkpoint you made or otherwise trust")
        new = convert(args.old, args.new)
    except _INPUT_ERRORS as e:
        print(f"grpo-fast {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(f"grpo-fast {args.command}: {args.old} -> {new}")
    return 0


class _Version(argparse.Action):
    """``grpo-fast --version``: one line, the versions read when asked (torch's import takes a second)."""

    def __call__(self, parser, namespace, values, option_string=None):
        import grpo_fast
        import torch

        from grpo_fast.benchmarking import dist_version

        triton = dist_version("triton") or dist_version("pytorch-triton-rocm") or "not installed"
        print(f"grpo-fast {grpo_fast.__version__} | torch {torch.__version__} | triton {triton} | transformers "
              f"{dist_version('transformers') or 'not installed'}")
        parser.exit()


class _LevelFormatter(logging.Formatter):
    """``%(level)s``: nothing for the run's INFO lines, the level name for warnings and errors (``WARNING ...``), so
    a log in a file tells them apart without a column of INFO."""

    def format(self, record: logging.LogRecord) -> str:
        record.level = f"{record.levelname} " if record.levelno >= logging.WARNING else ""
        return super().format(record)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    code = _parsed_elsewhere(argv)
    if code is not None:
        return code
    parser = Parser(prog="grpo-fast", description="GRPO with fused Triton kernels: no logits.")
    parser.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                        help="print the versions of grpo-fast, torch, triton and transformers, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    _eval_parser(sub)
    _convert_parser(sub)
    _elsewhere_parsers(sub)
    _doctor_parser(sub)
    _layout_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's parser says it: its prog, and the nearest of its own options
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 logs below warnings
    handler = logging.StreamHandler()
    handler.setFormatter(_LevelFormatter("%(asctime)s %(level)s%(name)s: %(message)s" if "RANK" not in os.environ
                                         else f"%(asctime)s [rank {rank}] %(level)s%(name)s: %(message)s",
                                         datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, handlers=[handler])
    if args.command in ("train", "export", "eval"):
        _quiet_libraries()
    if hasattr(args, "run"):  # a subcommand that names its own function
        return args.run(args)
    if args.command in ("export", "eval"):
        return _model_command(args, argv)
    if args.command != "train":  # "grpo-fast bench" without a benchmark name
        parser.parse_args([args.command, "--help"])
    return _train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
