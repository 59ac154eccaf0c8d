"""The names of the floating dtypes, in one table: torch's names and the short aliases, both mapped to torch dtypes.

Two spellings are in use, and each command keeps the one it has always accepted and written into its CSV columns:

- torch's names, ``float32``, ``bfloat16``, ``float16``: ``TrainConfig.dtype`` (``grpo-fast train --dtype``), the
  vLLM engine's ``dtype`` argument, ``bench.bench_memory`` and ``bench.calibrate_memory``;
- the short aliases, ``fp32``, ``bf16``, ``fp16``: ``grpo-fast doctor --dtype``, ``bench.bench_loss``,
  ``bench.bench_prefix``, ``bench.bench_head``, ``bench.cost_model`` and ``bench/micro``.

float64 is in neither table: no command computes in it (it is the reference's oracle dtype); :func:`dtype_name`
names it all the same.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # torch's names
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # short alias -> torch's name
SHORT_DTYPES = {alias: DTYPES[name] for alias, name in ALIASES.items()}  # "bf16" -> torch.bfloat16
NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch.bfloat16 -> "bfloat16"


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of any dtype (``torch.bfloat16`` -> ``"bfloat16"``, ``torch.float64`` -> ``"float64"``)."""
    return str(dtype).removeprefix("torch.")
