"""Prompt data: loading record files, rendering prompts with and without a chat template, the resumable sampler."""

from __future__ import annotations

import json
import re

import pytest

from grpo_fast.train.data import (
    PromptSampler,
    batches,
    check_prompts,
    load_located_records,
    load_records,
    render_prompt,
)

RECORDS = [
    {"prompt": "What is 6 times 7?", "answer": "42", "meta": {"source": "gsm", "level": 1}},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1/2 as a decimal?"}],
     "answer": "0.5", "meta": {"source": "math", "level": 2}},
    {"prompt": "Name a prime.", "answer": None, "meta": {"source": "misc", "level": 3}},
]


def _write_jsonl(path, rows, blank_lines=False):
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(json.dumps(r) for r in rows) + "\n")
    return path


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------------------------------------------- load_records


def test_load_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", RECORDS, blank_lines=True)
    assert load_records(path, required=("answer",)) == RECORDS
    assert load_records(str(path), limit=2) == RECORDS[:2]


def test_load_json_list(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS, indent=2))
    assert load_records(path, required=("answer",)) == RECORDS
    assert load_records(path, limit=1) == RECORDS[:1]


def test_load_parquet(tmp_path):
    rows = [RECORDS[0], RECORDS[2]]  # string prompts: a parquet column holds one type
    path = _write_parquet(tmp_path / "data.parquet", rows)
    loaded = load_records(path, required=("answer", "meta"))
    assert loaded == rows and all(type(r) is dict and type(r["meta"]) is dict for r in loaded)
    assert load_records(path, limit=1) == rows[:1]


def test_load_parquet_chat_messages(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}]
    path = _write_parquet(tmp_path / "chat.parquet", rows)
    assert load_records(path) == rows


def test_load_parquet_missing_column(tmp_path):
    path = _write_parquet(tmp_path / "data.parquet", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=r"data\.parquet: missing column 'prompt' in every row "
                                         r"\(columns: 'question', 'answer'\)"):
        load_records(path)


def test_load_parquet_null_prompt(tmp_path):
    path = _write_parquet(tmp_path / "data.parquet", [{"prompt": "q"}, {"prompt": None}])
    with pytest.raises(ValueError, match=r"data\.parquet, row 1: column 'prompt' must be a string"):
        load_records(path)


def test_load_missing_required_column_names_the_line(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}]
    path = _write_jsonl(tmp_path / "data.jsonl", rows, blank_lines=True)
    with pytest.raises(ValueError, match=r"data\.jsonl, line 3: missing column 'answer' \(columns: 'prompt', "
                                         r"'solution'\)"):
        load_records(path, required=("answer",))


def test_load_custom_prompt_column(tmp_path):
    path = _write_jsonl(tmp_path / "data.jsonl", [{"question": "q", "answer": "1"}])
    assert load_records(path, prompt_column="question") == [{"question": "q", "answer": "1"}]
    with pytest.raises(ValueError, match=r"line 1: missing column 'prompt' \(columns: 'question', 'answer'\)"):
        load_records(path)


@pytest.mark.parametrize(
    "prompt", [7, [], [{"role": "user"}], [{"role": "user", "content": "x"}, "loose string"]],
)
def test_load_bad_prompt(tmp_path, prompt):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "ok"}, {"prompt": prompt}]))
    with pytest.raises(ValueError, match=r"data\.json, item 1: column 'prompt' must be a string or a non-empty "
                                         r"list of chat messages"):
        load_records(path)


def test_load_tests_column_parses_json_strings(tmp_path):
    tests = ["assert f(1) == 2", "assert f(2) == 4"]
    rows = [{"prompt": "a", "tests": json.dumps(tests)}, {"prompt": "b", "tests": tests},
            {"prompt": "c", "tests": None}]
    path = _write_parquet(tmp_path / "data.parquet", rows[:1] + rows[2:])  # parquet: a column of JSON strings
    assert [r["tests"] for r in load_records(path, required=("tests",))] == [tests, None]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    assert [r["tests"] for r in load_records(path, required=("tests",))] == [tests, tests, None]
    # a column the code reward does not use is left as it is
    assert load_records(path)[0]["tests"] == json.dumps(tests)


@pytest.mark.parametrize(
    ("tests", "got"),
    [
        ("['assert True']", "the string \"['assert True']\""),  # a Python literal: would run as one passing test
        ("assert f(1) == 2", "the string 'assert f(1) == 2'"),
        ('["assert True", 3]', "the string '[\"assert True\", 3]'"),
        ('{"a": "assert True"}', "the string '{\"a\": \"assert True\"}'"),
        (["assert True", 3], "['assert True', 3] (list)"),
        (7, "7 (int)"),
    ],
)
def test_load_tests_column_refuses_anything_else_with_the_row(tmp_path, tests, got):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"prompt": "ok", "tests": ["assert True"]}, {"prompt": "p", "tests": tests}]))
    message = (f"data.json, item 1: column 'tests' must be a list of test snippets (strings), or a string holding "
               f"a JSON list of them, got {got}")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_records(path, required=("tests",))


def test_load_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the file holds no records"):
        load_records(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: invalid JSON"):
        load_records(tmp_path / "bad.jsonl")
    (tmp_path / "list.jsonl").write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match=r"list\.jsonl, item 0: expected a JSON object \(one record\), got str"):
        load_records(tmp_path / "list.jsonl")
    (tmp_path / "data.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv' \(supported: \.jsonl, \.json, \.parquet\)"):
        load_records(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="limit must be a positive number"):
        load_records(tmp_path / "list.jsonl", limit=0)


# ---------------------------------------------------------------------------------------------------- render_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def tokenizer():
    """A tiny word-level fast tokenizer, without a chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_render_with_chat_template(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    assert render_prompt(tokenizer, "hi") == "<|user|>hi\n<|assistant|>"
    assert render_prompt(tokenizer, "hi", system_prompt="Think.") == "<|system|>Think.\n<|user|>hi\n<|assistant|>"
    messages = RECORDS[1]["prompt"]
    expected = "<|system|>Be brief.\n<|user|>1/2 as a decimal?\n<|assistant|>"
    assert render_prompt(tokenizer, messages) == expected
    assert render_prompt(tokenizer, messages, system_prompt="Ignored: the messages have one.") == expected
    assert render_prompt(tokenizer, messages[1:], system_prompt="Think.") == (
        "<|system|>Think.\n<|user|>1/2 as a decimal?\n<|assistant|>"
    )
    assert messages[0]["content"] == "Be brief."  # the caller's list is left alone


def test_render_without_chat_template(tokenizer):
    assert render_prompt(tokenizer, "What is 2+2?") == "What is 2+2?"
    assert render_prompt(tokenizer, "What is 2+2?", system_prompt="Think.") == "Think.\nWhat is 2+2?"
    with pytest.raises(ValueError, match="list of chat messages but the tokenizer .* has no chat template"):
        render_prompt(tokenizer, [{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------------------------- check_prompts


def _located(tmp_path, prompts):
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts], blank_lines=True)
    return load_located_records(path)


def test_located_records_say_where_each_record_is(tmp_path):
    located = _located(tmp_path, ["hi", "hi hi"])  # a blank line between records: lines 1 and 3
    assert [(w.split(", ")[1], r["prompt"]) for w, r in located] == [("line 1", "hi"), ("line 3", "hi hi")]


@pytest.mark.parametrize("prompt", ["", " \n\t", [{"role": "user", "content": ""}, {"role": "user", "content": " "}]])
def test_check_prompts_refuses_an_empty_prompt_with_its_line(tmp_path, tokenizer, prompt):
    located = _located(tmp_path, ["hi", "hi", prompt])
    with pytest.raises(ValueError, match=rf"data.jsonl, line 5: column 'prompt' is an empty prompt, got "
                                         rf"{re.escape(repr(prompt))}$"):
        check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=8)


def test_check_prompts_counts_the_rendered_tokens(tmp_path, tokenizer):
    located = _located(tmp_path, ["hi hi", "hi hi hi", "hi", "hi hi hi hi"])
    check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=4)
    with pytest.raises(ValueError, match=r"data.jsonl, line 3: the prompt is 3 tokens long once rendered, more than "
                                         r"TrainConfig.max_prompt_length 2 \(1 more prompt is too long\); raise "
                                         r"--max-prompt-length or drop the long prompts"):
        check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=2, batch=3)  # across batches
    # the system prompt counts ("Think", ".", then the prompt's words)
    with pytest.raises(ValueError, match=r"line 1: the prompt is 4 tokens .*max_prompt_length 3 \(2 more prompts"):
        check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=3, system_prompt="Think.")
    # and so does the chat template: "<|user|>hi\n<|assistant|>" is 7 words and symbols
    tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"line 5: the prompt is 7 tokens .*max_prompt_length 6 \(4 more prompts"):
        check_prompts(located[2:3] + located, tokenizer, prompt_column="prompt", max_prompt_length=6)


def test_check_prompts_names_a_message_list_without_a_chat_template(tmp_path, tokenizer):
    located = _located(tmp_path, ["hi", [{"role": "user", "content": "hi"}]])
    with pytest.raises(ValueError, match=r"data.jsonl, line 3: prompt is a list of chat messages but the tokenizer"):
        check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=8)


def test_the_tiny_tokenizer_is_one_token_per_character():
    """The trainer counts the built-in model's prompt tokens with ``len`` (check_prompts' ``count_tokens``)."""
    from grpo_fast.train.tasks import builtin_records, tiny_tokenizer

    tok = tiny_tokenizer()
    texts = [render_prompt(tok, r["prompt"], system_prompt="Answer: x\n?") for r in builtin_records("digits", "eval",
                                                                                                       64)]
    assert [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]] == [len(t) for t in texts]


# ---------------------------------------------------------------------------------------------------- PromptSampler


def _ids(batch):
    return [r["id"] for r in batch]


RECS = [{"id": i} for i in range(10)]


def test_sampler_epochs_are_permutations_and_batches_cross_epochs():
    sampler = batches(RECS, 4, seed=0)
    drawn = [i for _ in range(5) for i in _ids(sampler.next_batch())]  # 20 records = exactly two epochs
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] != drawn[10:]  # reshuffled each epoch
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["index"] == 0


def test_sampler_is_deterministic_and_seeded():
    def run(seed, shuffle=True):
        sampler = PromptSampler(RECS, 3, seed=seed, epoch_shuffle=shuffle)
        return [_ids(next(sampler)) for _ in range(8)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert [i for b in run(5, shuffle=False) for i in b][:12] == list(range(10)) + [0, 1]


def test_sampler_resume_continues_the_same_sequence():
    uninterrupted = PromptSampler(RECS, 3, seed=7)
    expected = [_ids(uninterrupted.next_batch()) for _ in range(9)]

    first = PromptSampler(RECS, 3, seed=7)
    seen = [_ids(first.next_batch()) for _ in range(4)]  # stops mid-epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    assert (state["epoch"], state["index"]) == (1, 2)

    resumed = PromptSampler(RECS, 3, seed=7)
    resumed.load_state_dict(state)
    assert seen + [_ids(resumed.next_batch()) for _ in range(5)] == expected


def test_sampler_rejects_mismatched_state():
    state = PromptSampler(RECS, 3, seed=7).state_dict()
    with pytest.raises(ValueError, match="saved state has seed=7 but this sampler has seed=8"):
        PromptSampler(RECS, 3, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_records=10 but this sampler has num_records=9"):
        PromptSampler(RECS[:9], 3, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid position epoch=0, index=10"):
        PromptSampler(RECS, 3, seed=7).load_state_dict({**state, "index": 10})
    with pytest.raises(ValueError, match="batch_size must be positive"):
        PromptSampler(RECS, 0, seed=7)


def test_the_loader_checks_every_row_and_counts_the_bad_ones_after_the_first(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": 7, "answer": "2"}, {"prompt": "c"}, {"prompt": "d"},
            {"prompt": "e", "answer": "5"}]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(ValueError, match=r"^.*data\.jsonl, line 2: column 'prompt' must be a string or a non-empty "
                                         r"list of chat messages .*, got 7 \(2 more records have a problem\)$"):
        load_records(path, required=("answer",))
    path = _write_jsonl(tmp_path / "data.jsonl", rows[:3])
    with pytest.raises(ValueError, match=r"line 2: .* \(1 more record has a problem\)$"):
        load_records(path, required=("answer",))


def test_check_prompts_counts_the_empty_prompts_after_the_first(tmp_path, tokenizer):
    located = _located(tmp_path, ["hi", " ", "hi", "", "\n"])
    with pytest.raises(ValueError, match=r"data.jsonl, line 3: column 'prompt' is an empty prompt, got ' ' \(2 more "
                                         r"prompts are empty\)$"):
        check_prompts(located, tokenizer, prompt_column="prompt", max_prompt_length=8)


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_jsonl_lines_end_at_newline_only(tmp_path, char):
    """A JSON string may hold the characters str.splitlines also breaks on, written as they are
    (ensure_ascii=False): the row loads whole, and the line numbers count newlines."""
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": f"a{char}b=", "answer": f"c{char}"},
            {"prompt": "x", "answer": "y"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_records(path, required=("answer",)) == rows
    path.write_text(path.read_text(encoding="utf-8") + '{"prompt": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.jsonl, line 4: invalid JSON"):
        load_records(path, required=("answer",))


def test_jsonl_with_crlf_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "answer": "2"}\r\n{"prompt": "2+2=", "answer": "4"}\r\n')
    assert load_records(path, required=("answer",)) == [{"prompt": "1+1=", "answer": "2"},
                                                          {"prompt": "2+2=", "answer": "4"}]


@pytest.mark.parametrize("name", ["data.jsonl", "data.json"])
def test_a_file_that_is_not_utf8_names_the_line(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9=", "answer": "x"}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}, line 2: not UTF-8 \(byte 0xe9 at column 16\); "
                                         "save the file as UTF-8$"):
        load_records(path, required=("answer",))


@pytest.mark.parametrize(("text", "why"), [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than Python's recursion limit"),
    ('{"prompt": "a", "x": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),
])
@pytest.mark.parametrize("layout", ["jsonl", "json"])
def test_json_past_pythons_limits_is_one_line_naming_the_place(tmp_path, text, why, layout):
    path = tmp_path / f"data.{layout}"
    path.write_text(text + "\n" if layout == "jsonl" else f"[{text}]")
    where = f"{path}, line 1" if layout == "jsonl" else f"{path}"
    with pytest.raises(ValueError, match=re.escape(f"{where}: JSON this reader refuses ({why}")):
        load_records(str(path))
