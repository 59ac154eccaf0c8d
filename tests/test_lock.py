"""The locks setup.sh installs from (``scripts/lock.py``): the check that a venv holds exactly its lock, the locks'
form, and pyproject's ranges against them (lower bounds are versions the suite has passed on: the CPU lock's)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402


def _fake_venv(tmp_path, freeze_output: str) -> Path:
    """A venv whose ``python -m pip freeze --all --exclude-editable`` prints ``freeze_output``."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f"#!/bin/sh\ncat <<'EOF'\n{freeze_output}EOF\n")
    python.chmod(0o755)
    return tmp_path / "venv"


LOCK = """# grpo-fast's lock for tests
# Made 2026-12-04 with Python 3.11.7 by: python scripts/lock.py cpu
liger-kernel==0.8.5
torch==2.13.0+cpu
torchvision==0.28.0  # removed again by setup.sh
"""


@pytest.mark.parametrize("freeze, problems", [
    ("Liger_Kernel==0.8.5\ntorch==2.13.0+cpu\n", []),  # names compared in PEP 503's form
    ("liger-kernel==0.8.4\ntorch==2.13.0+cpu\n", ["liger-kernel: locked 0.8.5, installed 0.8.4"]),
    ("torch==2.13.0+cpu\n", ["liger-kernel: locked 0.8.5, installed nothing"]),
    ("liger-kernel==0.8.5\ntorch==2.13.0+cpu\nrich==14.0.0\n", ["rich: installed 14.0.0, not in the lock"]),
    ("liger-kernel==0.8.5\ntorch==2.13.0+cpu\ntorchvision==0.28.0\n",
     ["torchvision: installed 0.28.0, which setup.sh removes"]),
    ("liger-kernel==0.8.5\ntorch==2.13.0+cu128\n", ["torch: locked 2.13.0+cpu, installed 2.13.0+cu128"]),
    ("liger-kernel @ file:///tmp/liger\ntorch==2.13.0+cpu\n",
     ["liger-kernel: locked 0.8.5, installed @ file:///tmp/liger"]),
])
def test_check_names_every_difference(tmp_path, capsys, freeze, problems):
    path = tmp_path / "lock.txt"
    path.write_text(LOCK)
    rc = lock.check(_fake_venv(tmp_path, freeze), path)
    err = capsys.readouterr().err
    assert rc == (1 if problems else 0)
    assert [line.strip() for line in err.splitlines()[1:1 + len(problems)]] == problems
    if "not in the lock" in err or "setup.sh removes" in err:
        assert "python -m pip uninstall -y " in err.splitlines()[-1]


def test_a_lock_without_a_local_label_takes_any_build_of_the_release():
    assert lock.same_version("2.13.0", "2.13.0+cu128") and lock.same_version("2.13.0", "2.13.0")
    assert not lock.same_version("2.13.0+cpu", "2.13.0") and not lock.same_version("2.13.0", "2.13.1")
    assert not lock.same_version("2.13.0", None)


@pytest.mark.parametrize("name, refresh", [("cpu.txt", "cpu && python scripts/lock.py cuda"),
                                           ("cuda.txt", "cpu && python scripts/lock.py cuda"),
                                           ("verl-cpu.txt", "verl")])
def test_the_locks_are_dated_exact_and_say_how_to_refresh(name, refresh):
    text = (ROOT / "locks" / name).read_text()
    assert re.search(r"^# Made \d{4}-\d{2}-\d{2} with Python 3\.\d+\.\d+ by: python scripts/lock\.py "
                     + name.removesuffix(".txt").removesuffix("-cpu"), text, re.M), name
    assert f"# Refresh: python scripts/lock.py {refresh} (" in text
    pins, _ = lock.read_lock(ROOT / "locks" / name)
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(body) == len(pins) > 100 and all(re.match(r"^[a-z0-9-]+==\S+( |$)", line) for line in body)
    assert "grpo-fast" not in pins and "pip" in pins


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        out += [r for r in reqs if not r.startswith("grpo-fast[")]
    return out


def test_pyproject_lower_bounds_are_locked_versions():
    """Every lower bound in pyproject is the oldest version a lock holds: the CPU lock's (the suite passes on it),
    the CUDA lock's where the CUDA build of torch pins an older one (triton), the verl venv's where verl pins an older
    one (transformers: tests/in_verl/ passes on it); and every lock satisfies every range."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    cpu, _ = lock.read_lock(ROOT / "locks" / "cpu.txt")
    cuda, _ = lock.read_lock(ROOT / "locks" / "cuda.txt")
    verl, _ = lock.read_lock(ROOT / "locks" / "verl-cpu.txt")
    for text in _requirements():
        req = Requirement(text)
        name = lock.canonical(req.name)
        lower = [s.version for s in req.specifier if s.operator in (">=", "==")]
        for pins, where in ((cpu, "cpu"), (cuda, "cuda"), (verl, "verl-cpu")):
            if name in pins and (req.marker is None or req.marker.evaluate()):
                assert req.specifier.contains(Version(pins[name]), prereleases=True), (text, where, pins[name])
        if name not in cpu and name not in verl:
            continue  # flash-attn (GPU only, optional), vllm (the CUDA extra)
        assert lower, f"{text}: no lower bound"
        locked = [Version(pins[name]) for pins in (cpu, cuda, verl) if name in pins]
        assert Version(lower[0]) == min(Version(v.public) for v in locked), (text, cpu.get(name), cuda.get(name),
                                                                             verl.get(name))
