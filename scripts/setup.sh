#!/usr/bin/env bash
# Creates .venv and installs grpo-fast with its test, benchmark, TRL and quant (bitsandbytes) extras. Idempotent;
# safe on a fresh machine.
# On a machine without an NVIDIA driver the CPU build of torch is pinned first (a plain `pip install torch` would
# pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[dev]"
.venv/bin/python -c "import grpo_fast, torch, triton, transformers; print('grpo-fast', grpo_fast.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
