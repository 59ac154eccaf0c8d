"""Test-session set-up: without CUDA, Triton kernels run through the interpreter (must be set before triton loads)."""

import os
import shutil

if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# tests/in_verl/ runs in verl's own venv (.venv-verl; tests/test_verl.py starts it there from the main suite)
collect_ignore = [] if importlib.util.find_spec("verl") else ["in_verl"]

# Tests check values, never speed: one intra-op thread keeps small-tensor runs fast and steady on a 2-core machine
# (two threads that do not each get a core stall waiting for each other).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
