"""The tiny model's character tokenizer: its vocabulary as docs/train.md lists it, one warning (with counts) for the
characters of a dataset it reads as <unk>, and the same tokenizer files, loadable as trained, in a run's model/ and
in an export of its checkpoint."""

from __future__ import annotations

import json
import logging

import pytest
from train_helpers import REPO, small_config

from grpo_fast.train import prepare
from grpo_fast.train.data import unknown_characters
from grpo_fast.train.export import _save_tokenizer, export_checkpoint
from grpo_fast.train.lifecycle import fit
from grpo_fast.train.tasks import tiny_tokenizer

VOCAB = ["<pad>", "<eos>", "<unk>", *"0123456789", " ", "=", "m", "a", "x", "i", "n"]


def test_the_vocabulary_is_the_documented_one():
    assert [tok for tok, _ in sorted(tiny_tokenizer().get_vocab().items(), key=lambda kv: kv[1])] == VOCAB
    assert len(tiny_tokenizer("calc")) == len(VOCAB) + 3  # *, + and <call>
    docs = (REPO / "docs" / "train.md").read_text()
    table = docs[docs.index("### The tiny model's tokenizer"):]
    table = table[: table.index("\n\n", table.index("| ids | tokens |"))]
    for row in ("| 0-2 | `<pad>`, `<eos>`, `<unk>` |", "| 3-12 | `0` `1` `2` `3` `4` `5` `6` `7` `8` `9` |",
                "| 13-19 | space, `=`, `m`, `a`, `x`, `i`, `n` |"):
        assert row in table, row


def test_unknown_characters_counts_per_column():
    located = [("a, line 1", {"prompt": "3+4-1=", "answer": "-6"}),
               ("a, line 2", {"prompt": [{"role": "user", "content": "2*2+1="}], "answer": 5}),
               ("a, line 3", {"prompt": "max 3 8=", "answer": "8"})]
    found = unknown_characters(located, tiny_tokenizer(), ["prompt", "answer"], system_prompt="Be\nbrief")
    # the system prompt counts once per record: its B, e (twice), newline, b, r, f, not its i (a vocabulary letter)
    assert found["prompt"] == {"+": 2, "-": 1, "*": 1, "B": 3, "e": 6, "\n": 3, "b": 3, "r": 3, "f": 3}
    assert found["answer"] == {"-": 1}
    assert unknown_characters(located, tiny_tokenizer("calc"), ["prompt"])["prompt"] == {"-": 1}  # + and * known
    assert unknown_characters(located[2:], tiny_tokenizer(), ["prompt", "answer"]) == {}


class _NoUnknown:
    unk_token_id = None


def test_a_tokenizer_without_an_unknown_token_reads_everything():
    assert unknown_characters([("x", {"prompt": "+-*"})], _NoUnknown(), ["prompt"]) == {}


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_one_warning_before_training_names_the_characters(tmp_path, caplog):
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in [("3+4=", "7"), ("9-2=", "7"), ("5-8=", "-3"), ("2*3=", "6")]))
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        prepared = prepare(small_config(tmp_path, dataset=str(data), steps=1, prompts_per_step=2))
    warned = _warnings(caplog, "reads these characters of the dataset as <unk>")
    assert len(warned) == 1
    message = warned[0].getMessage()
    assert "3 in column 'prompt' ('-' x2, '+' x1, '*' x1)" in message and "1 in column 'answer' ('-' x1)" in message
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model tiny:")]
    assert len(started) == 1 and "(1 CPU thread)" in started[0]  # one thread, not "1 CPU threads"
    assert caplog.records.index(warned[0]) < min(i for i, r in enumerate(caplog.records)
                                                 if r.getMessage().startswith("model tiny:"))
    del prepared


def test_the_builtin_task_gets_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
        prepare(small_config(tmp_path, steps=1))
    assert not _warnings(caplog, "<unk>")


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizer")
    prepared = prepare(small_config(tmp, steps=1, prompts_per_step=2))
    fit(prepared)
    out = tmp / "run"
    exported = export_checkpoint(out / "checkpoints" / "checkpoint-000001.pt", tmp / "export")
    return out / "model", exported


def test_model_dir_and_export_hold_the_same_tokenizer_files(run_and_export):
    model_dir, exported = run_and_export
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                 "model.safetensors"):
        assert (model_dir / name).read_bytes() == (exported / name).read_bytes(), name
    assert json.loads((model_dir / "tokenizer.json").read_text())["padding"] is None
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["padding_side"] == "left"


def test_the_saved_tokenizer_loads_as_trained(run_and_export, caplog):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir, _ = run_and_export
    text = "max 3 8 1 6="
    trained = tiny_tokenizer()
    loaded = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert loaded(text)["input_ids"] == trained(text)["input_ids"] and loaded.padding_side == "left"
    auto = AutoTokenizer.from_pretrained(model_dir)
    if auto(text)["input_ids"] != trained(text)["input_ids"]:  # transformers 5: Qwen2Tokenizer; the log says so
        tmp = model_dir.parent.parent / "again"
        with caplog.at_level(logging.INFO, logger="grpo_fast.train"):
            export_checkpoint(model_dir.parent / "checkpoints" / "checkpoint-000001.pt", tmp)
        said = f"AutoTokenizer.from_pretrained({str(tmp)!r}) gives a {type(auto).__name__}"
        warned = [r for r in caplog.records if said in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.INFO  # transformers' known remapping
        assert f"PreTrainedTokenizerFast.from_pretrained({str(tmp)!r}, padding_side='left')" in warned[0].getMessage()


def test_saving_leaves_the_live_tokenizer_padding_as_it_was(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer(["max 3=", "min 4 0 7="], padding=True)  # what a run's batches leave on the backend
    before = tokenizer.backend_tokenizer.padding
    assert before is not None
    _save_tokenizer(tokenizer, tmp_path)
    assert tokenizer.backend_tokenizer.padding == before
    assert json.loads((tmp_path / "tokenizer.json").read_text())["padding"] is None
