"""The microbenchmarks in bench/micro cannot rot unnoticed: their module imports and every benchmark's check against
the float64 reference passes at the small size (pytest-benchmark's timing off: each benchmarked call runs once)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_micro_benchmarks_pass_their_reference_checks_at_the_small_size():
    pytest.importorskip("pytest_benchmark")
    # a fresh process: bench/micro is its own pytest session (its rootdir, no tests/conftest.py)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "bench/micro", "--benchmark-disable", "-k", "small", "-q",
         "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"pytest bench/micro: rc {run.returncode}\n{run.stdout[-4000:]}{run.stderr[-2000:]}"
    # what must have run (the rest is skipped with a reason): reference and torch for each of the five benchmarks;
    # Liger's GRPO loss (two variants) when installed; on CUDA also triton (five) and Liger's log-probs (two)
    liger = importlib.util.find_spec("liger_kernel") is not None
    cuda = torch.cuda.is_available()
    expected = 10 + 2 * liger + cuda * (5 + 2 * liger)
    passed = re.search(r"\b(\d+) passed", summary)
    assert passed and int(passed.group(1)) == expected, f"expected {expected} passed: {summary}"
