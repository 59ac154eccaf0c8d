"""The built-in task and tiny model: what ``grpo-fast train`` runs with no arguments, on a CPU, with nothing
downloaded.

Task ``digits``: ``"max 3 8 1 6="`` -> ``"8"``, ``"min 4 0 7="`` -> ``"0"`` (3 to 5 digits). The answer is checked
by the math reward (math-verify), so the run exercises the same reward path as a real math dataset. ``max`` is its
max-only half. ``median``: ``"3 8 1="`` -> ``"3"``, ``"7 2 9 4 4="`` -> ``"4"`` (3 or 5 digits): the same alphabet,
but an answer no single comparison finds; nothing in the project was tuned on it (the held-out check of the trainer
against TRL's). The held-out split is every prompt whose CRC32 is divisible by 8: no evaluation prompt is ever
trained on.

``calc`` (an agentic task): ``"37*408="`` -> ``"15096"``, two numbers of 2 or 3 digits. A product of that size is
beyond what the tiny model can compute in its head; with the ``calc`` tool (:func:`calc`) it only has to call it with
the prompt's expression: ``37*408<call>`` (the compact tool format of ``grpo_fast.agents.formats``), the tool answers
``15096 ``, and the model ends its turn. The answer is judged on the transcript's last number, the tool's output
included (reward ``last_number``).

Model ``tiny``: a 2-layer Qwen2 (hidden 64) over a character vocabulary, randomly initialised from the run's seed.
It starts at chance (it does not even know to answer with one digit) and has to learn the task from the rewards. For
``calc`` its vocabulary also has ``*``, ``+`` and the ``<call>`` token.
"""

from __future__ import annotations

import ast
import random
import zlib

CHARS = list("0123456789 =maxin")
SPECIAL = ["<pad>", "<eos>", "<unk>"]
TOOL_CHARS = list("*+")  # the calc task's extra characters
CALL_TOKEN = "<call>"  # grpo_fast.agents.formats.CALL_TOKEN: the compact tool format's call
TASKS = ("digits", "max", "median", "calc")
TOOL_TASKS = {"calc": "grpo_fast.train.tasks:calc"}  # task -> the tool its --tools builtin means
TASK_SIZE = 4096  # distinct training prompts
EVAL_SPLIT = 8  # 1 in 8 prompts is held out


def tiny_tokenizer(task: str | None = None):
    """Character-level ``PreTrainedTokenizerFast``: one token per character, ``<eos>`` ends a completion. For a tool
    task (``"calc"``) the vocabulary also holds :data:`TOOL_CHARS` and the ``<call>`` token; the other tasks keep
    the default run's vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tools = task in TOOL_TASKS
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS + (TOOL_CHARS + [CALL_TOKEN] if tools else []))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if tools:  # one token, not six characters
        backend.add_special_tokens([AddedToken(CALL_TOKEN, special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def calc(expression: str) -> str:
    """Evaluate integer arithmetic and return the result.

    Args:
        expression: non-negative integers joined by +, - and *, with parentheses, e.g. "37*408" or "12*(3+4)".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression[:40]!r}") from None
    return str(_arithmetic(tree.body))


_CALC_LIMIT = 10**18  # the largest operand and result calc computes


def _arithmetic(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= _CALC_LIMIT:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        value = left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
        if abs(value) > _CALC_LIMIT:
            raise ValueError(f"a result beyond {_CALC_LIMIT}")
        return value
    raise ValueError(f"calc takes integers with + - * only, got {ast.unparse(node)[:40]!r}")


def calc_demonstration(record: dict, tokenizer, fmt) -> Demonstration:
    """The calc task solved with its tool: ``a*b<call>``, the result the tool gives, ``<eos>``."""
    from grpo_fast.agents.warmup import Demonstration

    encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    expression = record["prompt"].rstrip("=")
    call = encode(expression) + (tokenizer.convert_tokens_to_ids(CALL_TOKEN),)
    result = tuple(fmt.suffix_ids([("calc", calc(expression))]))
    return Demonstration(list(encode(record["prompt"])), ((call, True), (result, False),
                                                          ((tokenizer.eos_token_id,), True)))


def _calc_example(rng: random.Random) -> dict:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


def tiny_model(tokenizer, seed: int):
    """The 2-layer Qwen2 of the default run, initialised from ``seed``. Two query heads of 32 dimensions sharing one
    key/value head: vLLM's CPU attention runs head sizes from 32 up (16 is refused), so the ``vllm`` rollout engine
    runs the default task on a CPU too."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def _digits_example(rng: random.Random, ops=("max", "min")) -> dict:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    op = rng.choice(ops)
    answer = max(digits) if op == "max" else min(digits)
    return {"prompt": f"{op} {' '.join(map(str, digits))}=", "answer": str(answer)}


def _median_example(rng: random.Random) -> dict:
    digits = [rng.randint(0, 9) for _ in range(rng.choice((3, 5)))]
    return {"prompt": f"{' '.join(map(str, digits))}=", "answer": str(sorted(digits)[len(digits) // 2])}


def _held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % EVAL_SPLIT == 0


def builtin_records(name: str, split: str, size: int) -> list[dict]:
    """``size`` distinct records of task ``name`` from ``split`` ("train" or "eval"); the same on every machine."""
    if name not in TASKS:
        raise ValueError(f"dataset: unknown builtin task {name!r}; expected one of {', '.join(TASKS)}")
    rng = random.Random(f"grpo-fast:{name}")
    records, seen = [], set()
    want_eval = split == "eval"
    for _ in range(200 * size):
        if name == "median":
            record = _median_example(rng)
        elif name == "calc":
            record = _calc_example(rng)
        else:
            record = _digits_example(rng, ("max", "min") if name == "digits" else ("max",))
        if record["prompt"] in seen or _held_out(record["prompt"]) != want_eval:
            continue
        seen.add(record["prompt"])
        records.append(record)
        if len(records) == size:
            return records
    raise ValueError(f"builtin task {name!r} has fewer than {size} distinct {split} prompts")
