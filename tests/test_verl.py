"""The verl drop-in's suite (tests/in_verl/), run in verl's own venv: verl 0.9.1 needs transformers < 5.11 and cannot
share .venv (scripts/setup_verl.sh, which scripts/setup.sh runs on CPU Linux x86-64 machines)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERL_PYTHON = ROOT / os.environ.get("VERL_VENV", ".venv-verl") / "bin" / "python"
SETUP_BUILDS_IT = (sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("nvidia-smi") is None
                   and os.environ.get("GRPO_FAST_VERL", "1") != "0")


@pytest.mark.slow
def test_the_verl_suite_passes_in_the_verl_venv(tmp_path):
    if not VERL_PYTHON.exists():
        if SETUP_BUILDS_IT:
            pytest.fail(f"{VERL_PYTHON} is missing: scripts/setup.sh builds it on this machine (bash "
                        "scripts/setup_verl.sh makes it alone)")
        pytest.skip(f"no verl venv ({VERL_PYTHON}): bash scripts/setup_verl.sh makes one")
    report = tmp_path / "verl.xml"
    proc = subprocess.run([str(VERL_PYTHON), "-m", "pytest", "tests/in_verl", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert report.exists(), f"tests/in_verl did not run (rc {proc.returncode}):\n{tail}"
    cases = ET.parse(report).getroot().iter("testcase")
    bad_tags = ("failure", "error", "skipped")
    outcome = {f"{c.get('classname')}::{c.get('name')}": next((x.tag for x in c if x.tag in bad_tags), "passed")
               for c in cases}
    bad = {name: what for name, what in outcome.items() if what != "passed"}
    assert not bad, f"tests/in_verl: {len(bad)} of {len(outcome)} did not pass (none may skip): {bad}\n{tail}"
    assert proc.returncode == 0 and len(outcome) >= 300, tail  # the suite ran whole (it has more than 300 cases)
