"""A tool-capable chat tokenizer built here (no hub): byte-level, with a Qwen2.5-style template that renders tools,
assistant ``tool_calls`` as Hermes ``<tool_call>`` JSON blocks and the tool role."""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]


def byte_chat_tokenizer(template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE without merges (every byte one token) plus the chat specials; EOS ``<|im_end|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        padding_side="left")
    tokenizer.chat_template = template
    return tokenizer
