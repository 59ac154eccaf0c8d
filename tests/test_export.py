"""Trained models leave the trainer: ``output_dir/model`` and ``grpo-fast export`` (grpo_fast/train/export.py).

Each directory is loaded the way a user would (``AutoModelForCausalLM.from_pretrained``, ``PeftModel.from_pretrained``)
and compared with the model the run trained, still in memory: log-probs under the tolerance rule of
``grpo_fast/testing.py`` (float64 reference: the trained model in float64) and greedy completions token for token.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import small_config, unwritable_path

from grpo_fast.cli import main
from grpo_fast.testing import assert_close_rule
from grpo_fast.train import fit, prepare
from grpo_fast.train.model import load_tokenizer
from grpo_fast.train.tasks import builtin_records, tiny_model, tiny_tokenizer

FULL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
LORA = dict(lora_r=4, lora_target_modules=["q_proj", "v_proj"], lr=0.02, steps=2)  # lr: adapters that matter


def _batch(tokenizer, n=12):
    texts = [r["prompt"] for r in builtin_records("digits", "eval", n)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


@torch.no_grad()
def _logprobs(model, ids, mask, dtype=torch.float32):
    """Log-probs of every next prompt token, ``[B, T-1]``, with the model's own forward (logits)."""
    model = copy.deepcopy(model).to(dtype).eval()
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]
    return logits.log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0] * mask[:, 1:]


@torch.no_grad()
def _greedy(model, tokenizer, ids, mask):
    model = model.eval()
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def _assert_same_model(loaded, trained, tokenizer):
    """``loaded`` reproduces ``trained``: log-probs under the tolerance rule, greedy completions exactly."""
    ids, mask = _batch(tokenizer)
    assert_close_rule(_logprobs(loaded, ids, mask), _logprobs(trained, ids, mask),
                      _logprobs(trained, ids, mask, torch.float64), torch.float32, "log-probs")
    assert torch.equal(_greedy(loaded, tokenizer, ids, mask), _greedy(trained, tokenizer, ids, mask))


def _assert_moved(trained, initial, tokenizer):
    """The run trained: the comparisons are not between two untouched models."""
    ids, mask = _batch(tokenizer)
    assert float((_logprobs(trained, ids, mask) - _logprobs(initial, ids, mask)).abs().max()) > 1e-3


def _final_checkpoint(run_dir):
    return sorted((run_dir / "checkpoints").glob("checkpoint-*.pt"))[-1]


# --------------------------------------------------------------------------------------------- full fine-tuning


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    prepared = prepare(small_config(tmp, steps=3))
    summary = fit(prepared)
    return prepared.run, summary, tmp / "run"


def test_run_leaves_a_save_pretrained_directory(full_run):
    from transformers import AutoModelForCausalLM

    run, _, run_dir = full_run
    model_dir = run_dir / "model"
    assert {p.name for p in model_dir.iterdir()} == FULL_FILES
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert loaded.dtype == torch.float32 and type(loaded) is type(run.model)
    _assert_moved(run.model, tiny_model(tiny_tokenizer(), run.config.seed), run.tokenizer)
    _assert_same_model(loaded, run.model, run.tokenizer)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == run.tokenizer.eos_token_id and generation["max_new_tokens"] == 3


def test_saved_tokenizer_round_trips(full_run):
    from transformers import PreTrainedTokenizerFast

    run, _, run_dir = full_run
    text = [r["prompt"] for r in builtin_records("digits", "eval", 5)]
    for loaded in (load_tokenizer(run_dir / "model"), PreTrainedTokenizerFast.from_pretrained(run_dir / "model")):
        assert loaded(text, padding=True).input_ids == run.tokenizer(text, padding=True).input_ids
        assert loaded.get_vocab() == run.tokenizer.get_vocab()
        assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "left")


def test_chat_template_round_trips(tmp_path):
    """A tokenizer with a chat template (a model directory's) keeps it through save_model / load_tokenizer."""
    from grpo_fast.train.export import save_model

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }}={% endfor %}"
    save_model(tiny_model(tokenizer, 0), tokenizer, tmp_path / "model")
    loaded = load_tokenizer(tmp_path / "model")
    assert loaded.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": "max 3 8 1"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "u max 3 8 1="
    assert loaded.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_export_of_the_final_checkpoint_equals_the_run_model(full_run, tmp_path):
    _, _, run_dir = full_run
    out = tmp_path / "exported"
    assert main(["export", str(_final_checkpoint(run_dir)), str(out)]) == 0
    assert {p.name for p in out.iterdir()} == FULL_FILES
    got, want = load_file(out / "model.safetensors"), load_file(run_dir / "model" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for name in FULL_FILES - {"model.safetensors"}:
        got, want = (json.loads((d / name).read_text()) for d in (out, run_dir / "model"))
        if name == "tokenizer.json":  # the backend's padding state, which a batch call set in the run's tokenizer
            got.pop("padding"), want.pop("padding")
        assert got == want, name


@pytest.mark.parametrize("case", ["missing", "not_a_checkpoint", "out_not_empty", "merge_without_lora"])
def test_export_bad_input_is_one_line(full_run, tmp_path, capsys, case):
    _, _, run_dir = full_run
    checkpoint, out = str(_final_checkpoint(run_dir)), tmp_path / "out"
    extra = []
    if case == "missing":
        checkpoint = str(tmp_path / "nothing.pt")
    elif case == "not_a_checkpoint":
        checkpoint = str(run_dir / "config.json")
    elif case == "out_not_empty":
        out.mkdir()
        (out / "x").write_text("x")
    else:
        extra = ["--merge-lora"]
    assert main(["export", checkpoint, str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("grpo-fast export: error: ")
    assert {"missing": "CHECKPOINT", "not_a_checkpoint": "CHECKPOINT", "out_not_empty": "OUT_DIR",
            "merge_without_lora": "--merge-lora"}[case] in err


@pytest.mark.parametrize("case", ["empty", "under_a_file", "unwritable"])
def test_out_dir_errors_name_out_dir_as_typed(full_run, tmp_path, capsys, case):
    """OUT_DIR that is "", under a file, or where nothing can be created: one line naming OUT_DIR as typed and why
    (not the temporary directory the export writes first), before the model is loaded; nothing is created."""
    _, _, run_dir = full_run
    (tmp_path / "afile").write_text("x")
    under, unwritable = str(tmp_path / "afile" / "sub"), unwritable_path(tmp_path)
    out, why = {
        "empty": ("", "OUT_DIR: expected the directory to write, got ''"),
        "under_a_file": (under, f"OUT_DIR: cannot create or write in {under} ({tmp_path / 'afile'} is a file, not a "
                                "directory)"),
        "unwritable": (unwritable, f"OUT_DIR: cannot create or write in {unwritable} ("),
    }[case]
    assert main(["export", str(_final_checkpoint(run_dir)), out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"grpo-fast export: error: {why}") and "\n" not in err and ".tmp" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"afile", *(["read-only"] if "read-only" in out
                                                                            else [])})


# --------------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    pytest.importorskip("peft")
    tmp = tmp_path_factory.mktemp("lora")
    prepared = prepare(small_config(tmp, **LORA))
    fit(prepared)
    return prepared.run, tmp / "run"


def test_lora_run_writes_a_peft_adapter(lora_run):
    from peft import PeftModel

    run, run_dir = lora_run
    model_dir = run_dir / "model"
    names = {p.name for p in model_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names
    config = json.loads((model_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj"}
    base = tiny_model(tiny_tokenizer(), run.config.seed)  # the tiny model's base is rebuilt from its seed
    _assert_moved(run.model, base, run.tokenizer)
    loaded = PeftModel.from_pretrained(tiny_model(tiny_tokenizer(), run.config.seed), model_dir)
    _assert_same_model(loaded, run.model, run.tokenizer)


def test_lora_export_merged_equals_the_adapter_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, run_dir = lora_run
    out = tmp_path / "merged"
    assert main(["export", str(_final_checkpoint(run_dir)), str(out), "--merge-lora"]) == 0
    assert "adapter_config.json" not in {p.name for p in out.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    _assert_same_model(merged, run.model, run.tokenizer)


def test_merge_lora_at_the_end_of_a_run(lora_run, tmp_path):
    """--merge-lora: the run's model/ holds the merged full weights, the same as exporting its checkpoint merged."""
    _, run_dir = lora_run
    prepared = prepare(small_config(tmp_path, merge_lora=True, **LORA))
    fit(prepared)
    model_dir = tmp_path / "run" / "model"
    assert {p.name for p in model_dir.iterdir()} == FULL_FILES
    exported = tmp_path / "exported"
    assert main(["export", str(_final_checkpoint(run_dir)), str(exported), "--merge-lora"]) == 0
    got, want = load_file(model_dir / "model.safetensors"), load_file(exported / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_lora_needs_lora(tmp_path):
    with pytest.raises(ValueError, match="merge_lora needs a LoRA run"):
        small_config(tmp_path, merge_lora=True)
