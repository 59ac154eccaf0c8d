"""Shapes of real model architectures, for benchmarks and memory projections.

Every value is the one in the model's published Hugging Face ``config.json`` (the hub id is on each entry). Benchmarks
take the lm_head shape ``(hidden_size, vocab_size)`` from here instead of inventing one (``bench.models`` re-exports
this module); ``grpo-fast fit`` uses the rest (layers, attention heads, MLP width) through
:meth:`ModelShape.num_params`, :meth:`ModelShape.lora_params` and :meth:`ModelShape.linear_shapes`.

    from grpo_fast.memory.models import MODELS, get_model
    m = get_model("qwen2.5-7b");  m.hidden_size, m.vocab_size   # (3584, 152064)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of one decoder-only transformer (field names follow HF ``config.json``).

    ``vocab_size`` is the lm_head's row count (the padded embedding size in the config, not the tokenizer's length):
    that is the ``V`` a log-prob kernel sees. ``head_dim`` is given explicitly because some models do not use
    ``hidden_size // num_attention_heads`` (Gemma-2, Qwen3).
    """

    name: str
    hf_id: str
    hidden_size: int  # H
    vocab_size: int  # V
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    final_logit_softcapping: float | None = None
    attention_bias: bool = False  # bias on q, k, v (Qwen2.5)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    norms_per_layer: int = 2  # RMSNorm weights of size H per layer (Gemma-2 has four)

    def num_params(self) -> int:
        """Parameter count from the shapes (embedding, lm_head unless tied, attention, gated MLP, norms).

        Reproduces the published totals (494,032,768 for Qwen2.5-0.5B, 8,030,261,248 for Llama-3.1-8B); rotary
        tables and other buffers are not parameters.
        """
        h, hd = self.hidden_size, self.head_dim
        q_out = self.num_attention_heads * hd
        kv_out = self.num_key_value_heads * hd
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        layer = attn + mlp + self.norms_per_layer * h
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + lm_head + self.num_hidden_layers * layer + h  # + final norm

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{module name: (in_features, out_features)}`` of one decoder layer's projections (transformers' names)."""
        h, i = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, r: int, targets) -> int:
        """Parameters of rank-``r`` LoRA adapters on the ``targets`` projections of every layer: ``A [r, in]`` and
        ``B [out, r]`` each (2,162,688 for Qwen2.5-0.5B at r = 16 on q, k, v and o)."""
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"LoRA targets: {unknown} are not decoder projections ({', '.join(shapes)})")
        return self.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


_ENTRIES = [
    ModelShape("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", hidden_size=896, vocab_size=151936, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, head_dim=64, intermediate_size=4864,
               tie_word_embeddings=True, attention_bias=True),
    ModelShape("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", hidden_size=1536, vocab_size=151936, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, head_dim=128, intermediate_size=8960,
               tie_word_embeddings=True, attention_bias=True),
    ModelShape("qwen2.5-3b", "Qwen/Qwen2.5-3B", hidden_size=2048, vocab_size=151936, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=11008,
               tie_word_embeddings=True, attention_bias=True),
    ModelShape("qwen2.5-7b", "Qwen/Qwen2.5-7B", hidden_size=3584, vocab_size=152064, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, head_dim=128, intermediate_size=18944,
               tie_word_embeddings=False, attention_bias=True),
    ModelShape("llama-3.2-1b", "meta-llama/Llama-3.2-1B", hidden_size=2048, vocab_size=128256, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
               tie_word_embeddings=True),
    ModelShape("llama-3.1-8b", "meta-llama/Llama-3.1-8B", hidden_size=4096, vocab_size=128256, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
               tie_word_embeddings=False),
    # Gemma-2 also soft-caps attention logits at 50.0 (attn_logit_softcapping); only the final one touches the loss.
    ModelShape("gemma-2-2b", "google/gemma-2-2b", hidden_size=2304, vocab_size=256000, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=9216,
               tie_word_embeddings=True, final_logit_softcapping=30.0, norms_per_layer=4),
    ModelShape("qwen3-0.6b", "Qwen/Qwen3-0.6B", hidden_size=1024, vocab_size=151936, num_hidden_layers=28,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
               tie_word_embeddings=True, qk_norm=True),
]

MODELS: dict[str, ModelShape] = {m.name: m for m in _ENTRIES}


def get_model(name: str) -> ModelShape:
    """Look a model up by registry name (case-insensitive; the HF id also works)."""
    key = name.lower()
    for m in _ENTRIES:
        if key in (m.name, m.hf_id.lower()):
            return m
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
