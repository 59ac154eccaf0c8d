"""Writes tests/golden/train_tiny.json: the per-step metrics of a seeded tiny training run, pinned by
tests/test_golden.py. Run it (one thread, as the tests do) only when a change is meant to alter the numbers:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_golden.py
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from train_helpers import GOLDEN_KEYS, GOLDEN_OVERRIDES, GOLDEN_PATH, small_config  # noqa: E402

from grpo_fast.train import train  # noqa: E402
from grpo_fast.train.metrics import read_steps  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        train(small_config(Path(tmp), **GOLDEN_OVERRIDES))
        steps = read_steps(Path(tmp) / "run" / "metrics.jsonl")
    golden = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python scripts/make_golden.py",
        "torch": torch.__version__,
        "overrides": GOLDEN_OVERRIDES,
        "steps": [{k: s.get(k) for k in ("step", *GOLDEN_KEYS)} for s in steps],
    }
    GOLDEN_PATH.parent.mkdir(exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH}")
