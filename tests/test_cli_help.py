"""What a newcomer reads: every option of every command described, --help as plain text, grpo-fast --version, fit's
columns explained, TRL's option names taken or answered, a missing --dataset found before anything heavy, and no
library noise (bitsandbytes' CPU kernel message, TRL's vLLM range warning) where it does not apply."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys

import pytest
from train_helpers import REPO

from grpo_fast import bnb_layout, cli
from grpo_fast.helptext import plain_text
from grpo_fast.memory import fit
from grpo_fast.memory.projection import METHODS
from grpo_fast.train.config import TRL_ALIASES, build_config


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, as ``grpo-fast COMMAND --help`` shows it."""
    from grpo_fast.memory import source_module

    parser = cli.Parser(prog="grpo-fast")
    sub = parser.add_subparsers(dest="command")
    for add in (cli._train_parser, cli._export_parser, cli._eval_parser, cli._convert_parser, cli._elsewhere_parsers,
                cli._doctor_parser, cli._layout_parser):
        add(sub)
    found = {"grpo-fast": parser, **{f"grpo-fast {name}": p for name, p in sub.choices.items()}}
    found["grpo-fast fit"] = fit.build_parser()
    bench_memory = source_module("bench_memory", "bench memory")
    found["grpo-fast bench memory"] = bench_memory.build_parser("grpo-fast bench memory")
    return found


PARSERS = _parsers()


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_option_is_described(command):
    undescribed = []
    for action in PARSERS[command]._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = re.sub(r"\(default:? [^)]*\)", "", action.help or "").strip()
        if len(text) < 8 or action.help == argparse.SUPPRESS:
            undescribed.append(action.option_strings[0])
    assert not undescribed, f"{command}: options without a description: {undescribed}"


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_is_plain_text(command):
    text = PARSERS[command].format_help()
    assert "``" not in text and not re.search(r":(func|class|meth|data|attr|mod):`", text), text
    assert "does not exist" not in text  # bench memory's help named a shipped function as missing


def test_plain_text():
    assert plain_text("``grpo-fast fit``: :func:`shared_prefix_forward`, :class:`~a.B` and ``[N, V]``") == (
        "grpo-fast fit: shared_prefix_forward, a.B and [N, V]")


def test_version(capsys):
    import torch
    import transformers

    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"grpo-fast \S+ \| torch \S+ \| triton \S+( installed)? \| transformers \S+", line), line
    assert f"torch {torch.__version__}" in line and f"transformers {transformers.__version__}" in line


def test_fit_explains_its_columns(capsys):
    assert fit.main(["--model", "qwen2.5-0.5b", "--memory", "24GB", "--lora-r", "16"]) == 0
    out = capsys.readouterr().out
    legend = next(line for line in out.splitlines() if line.startswith("Columns: "))
    for method in METHODS:
        assert f"{method}: " in legend
    assert "0: not even T=1 fits" in legend and "65,536+: at least that" in legend
    assert "Columns: ppo: " in " ".join(PARSERS["grpo-fast fit"].format_help().split())


def _train_overrides(argv: list[str]) -> dict:
    parser = cli.Parser(prog="grpo-fast")
    cli._train_parser(parser.add_subparsers(dest="command"))
    return cli.train_overrides(parser.parse_args(["train", *argv]))


def test_trls_names_of_the_same_options_are_taken():
    config = build_config(overrides=_train_overrides(["--learning-rate", "0.003", "--num-generations", "6",
                                                      "--max-completion-length", "7"]))
    assert (config.lr, config.group_size, config.max_new_tokens) == (0.003, 6, 7)
    config = build_config({"learning_rate": 0.004, "num-generations": 3, "max_completion_length": 5})
    assert (config.lr, config.group_size, config.max_new_tokens) == (0.004, 3, 5)
    assert set(TRL_ALIASES.values()) == {"lr", "group_size", "max_new_tokens", "mu"}
    assert build_config(overrides=_train_overrides(["--num-iterations", "2"])).mu == 2  # TRL's num_iterations


@pytest.mark.parametrize("flag, answer", [("--beta", "did you mean --loss.beta?"),
                                          ("--loss-type", "did you mean --loss.loss_type?"),
                                          ("--logging-steps", "did you mean --log-every?"),
                                          ("--gradient-accumulation-steps", "micro-batches of --micro-batch-size")])
def test_trls_other_names_are_answered(capsys, flag, answer):
    with pytest.raises(SystemExit):
        cli.main(["train", flag, "1"])
    assert answer in capsys.readouterr().err


def test_trls_batch_size_is_answered_with_what_to_use(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["train", "--per-device-train-batch-size", "8"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo-fast train: error: unknown option(s): --per-device-train-batch-size 8; did you mean "
                          "--micro-batch-size? (completions per forward/backward on a device"), err
    assert "--prompts-per-step x --group-size" in err
    with pytest.raises(ValueError, match="unknown option 'per_device_train_batch_size'; did you mean "
                                         "--micro-batch-size"):
        build_config({"per_device_train_batch_size": 8})


def test_a_missing_dataset_is_found_before_anything_heavy(monkeypatch, tmp_path, capsys):
    from grpo_fast.train import distributed, trainer

    def not_yet(*args, **kwargs):
        raise AssertionError("reached before the dataset was checked")

    monkeypatch.setattr(distributed, "init", not_yet)
    monkeypatch.setattr(trainer, "resolve_impl", not_yet)
    monkeypatch.setattr(trainer, "resolve_rollout", not_yet)
    for flag in ("--dataset", "--eval-dataset"):
        assert cli.main(["train", flag, "nothere.jsonl", "--output-dir", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err.strip() == f"grpo-fast train: error: {flag}: no such file 'nothere.jsonl'"


def test_bitsandbytes_cpu_kernel_message_is_filtered(caplog):
    cli._quiet_libraries()
    cli._quiet_libraries()  # every command calls it: one filter, not one per call
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert log.filters.count(bnb_layout._not_cpu_kernel_message) == 1
    with caplog.at_level(logging.INFO):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.")
        log.warning("another bitsandbytes message")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes message"]


def test_importing_the_trl_drop_in_leaves_trls_vllm_range_warning_out():
    pytest.importorskip("trl")
    vllm = pytest.importorskip("vllm")
    code = "import warnings; warnings.simplefilter('always'); import {}"
    run = lambda module: subprocess.run([sys.executable, "-c", code.format(module)], capture_output=True,  # noqa
                                        text=True, cwd=REPO, timeout=300)
    drop_in = run("grpo_fast.integrations.trl")
    assert drop_in.returncode == 0, drop_in.stderr
    assert "TRL currently supports vLLM versions" not in drop_in.stderr
    assert "gemm_4bit_forward" not in drop_in.stderr and "doesn't include CPU backend" not in drop_in.stderr
    from packaging.version import Version

    if not Version("0.22") <= Version(Version(vllm.__version__).base_version) <= Version("0.31"):
        plain = run("trl.generation.vllm_generation")  # TRL itself still says it
        assert "TRL currently supports vLLM versions" in plain.stderr
