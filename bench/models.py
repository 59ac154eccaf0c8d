"""The model registry for benchmarks: ``grpo_fast.memory.models`` (installed with the package, where ``grpo-fast fit``
uses it), re-exported so that benchmarks keep importing ``bench.models``.

    from bench.models import MODELS, get_model
    m = get_model("qwen2.5-7b");  m.hidden_size, m.vocab_size   # (3584, 152064)
"""

from grpo_fast.memory.models import MODELS, ModelShape, get_model

__all__ = ["MODELS", "ModelShape", "get_model"]
