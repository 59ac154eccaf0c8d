"""The CPU-dependent paths under the vector width of a CPU without AVX-512: torch's kernel dispatch
(``ATEN_CPU_CAPABILITY``, which also switches bitsandbytes' AVX-512-only CPU paths, read from torch) forced to AVX2
and to the scalar default, in a child process, on the tests whose numbers depend on it: the golden training run
(rel 1e-5 across CPUs), the 4-bit model against its dequantized copy, torch's fused AdamW, and the repacked 4-bit
generation (whose other side, the AVX512-BF16 flag, the ``avx512bf16_cpu`` fixture forces on any CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cpu_flags_note

ROOT = Path(__file__).resolve().parent.parent
SUBSET = ["tests/test_golden.py", "tests/test_qlora.py", "-k",
          "golden or 4bit_model_is or adamw or repack or trainer_never"]


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_cpu_dependent_tests_pass_at_another_vector_width(capability):
    pytest.importorskip("bitsandbytes")
    if capability == "avx2" and "avx2: yes" not in cpu_flags_note("avx2"):
        pytest.skip(f"torch's AVX2 kernels need the avx2 CPU flag ({cpu_flags_note('avx2')})")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == {"avx2": "AVX2", "default": "DEFAULT"}[capability], probe.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout.splitlines()[-1] and "failed" not in done.stdout.splitlines()[-1]
