"""The locks ``scripts/setup.sh`` installs from: one constraints file per platform, every package at its exact version.

    python scripts/lock.py cpu     # locks/cpu.txt: a scratch venv set up from pyproject's ranges (setup.sh with
                                   # GRPO_FAST_LOCK=none), then what it holds (pip freeze --all)
    python scripts/lock.py cuda    # locks/cuda.txt: what pip resolves for a CUDA Linux machine from the same ranges
                                   # (pip install --dry-run --report, torch from PyPI); resolved, not installed here
    python scripts/lock.py verl    # locks/verl-cpu.txt: the verl venv (scripts/setup_verl.sh with
                                   # GRPO_FAST_VERL_LOCK=none) on a CPU machine, then what it holds
    python scripts/lock.py check [--venv .venv] [--lock locks/cpu.txt]
                                   # does the venv hold exactly the lock? (setup.sh runs it last)

A refresh is these commands and a run of the suite on the new lock (bash scripts/setup.sh, which installs from
it, then the README's test command); commit the locks with the date they carry. Only the standard library here: the
script runs before any venv exists.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"
PROJECT = "grpo-fast"
REMOVED = "# removed again by setup.sh"  # installed as a requirement, then uninstalled (setup.sh says why)


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name (``liger_kernel`` and ``Liger-Kernel`` are one package)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines) -> dict[str, str]:
    """``name==version`` lines (``pip freeze``'s, a lock's) -> {canonical name: version}; ``name @ url`` lines map
    to ``"@ url"``; comments, blank lines and editable installs (the project itself) are skipped."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not line or line.startswith("-"):
            continue
        if " @ " in line:
            name, url = line.split(" @ ", 1)
            pins[canonical(name.strip())] = f"@ {url.strip()}"
        elif "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name.strip())] = version.split(";", 1)[0].strip()
    return pins


def same_version(locked: str, installed: str | None) -> bool:
    """``installed`` is what ``locked`` pins; a lock without a local label (``2.13.0``) takes any build of that
    release (``2.13.0+cu128`` from PyTorch's own index), as pip's ``==`` does."""
    if installed is None:
        return False
    return installed == locked or ("+" not in locked and installed.split("+", 1)[0] == locked)


def read_lock(path: Path) -> tuple[dict[str, str], set[str]]:
    """A lock's pins and the names it marks as removed again by setup.sh."""
    text = path.read_text().splitlines()
    removed = {name for line in text if line.rstrip().endswith(REMOVED) for name in parse_pins([line])}
    return parse_pins(text), removed


def freeze(python: str | Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    return {k: v for k, v in parse_pins(out.splitlines()).items() if k != PROJECT}


def write_lock(path: Path, platform_line: str, how: str, pins: dict[str, str], removed: set[str] = frozenset(),
               notes: tuple[str, ...] = (), script: str = "scripts/setup.sh",
               refresh: str = "python scripts/lock.py cpu && python scripts/lock.py cuda"):
    header = [
        f"# grpo-fast's lock for {platform_line}: every package {script} installs there, at its exact version.",
        f"# Made {datetime.date.today().isoformat()} with Python {platform.python_version()} by: {how}",
        f"# Refresh: {refresh} (scripts/lock.py's docstring).",
        f"# {script.rsplit('/', 1)[-1]} installs with pip's -c (constraints): pyproject's ranges choose what, this "
        "file which version.",
        *(f"# {note}" for note in notes),
    ]
    body = [f"{name}=={pins[name]}" + (f"  {REMOVED}" if name in removed else "") for name in sorted(pins)]
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(header + body) + "\n")
    print(f"wrote {path.relative_to(ROOT)}: {len(pins)} packages")


def lock_cpu() -> None:
    """Sets up a scratch venv with setup.sh from pyproject's ranges, then locks what it holds, including what setup
    removes again (so that the requirement that pulled it in resolves to the same version next time)."""
    scratch = Path(tempfile.mkdtemp(prefix="grpo_fast_lock_"))
    try:
        before = scratch / "before-cleanup.txt"
        env = {**os.environ, "VENV": str(scratch / "venv"), "GRPO_FAST_LOCK": "none",
               "GRPO_FAST_FREEZE": str(before), "GRPO_FAST_VERL": "0"}
        subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], check=True, env=env)
        after = freeze(scratch / "venv" / "bin" / "python")
        installed = {k: v for k, v in parse_pins(before.read_text().splitlines()).items() if k != PROJECT}
        pins = {**installed, **after}
        write_lock(LOCKS / "cpu.txt", "CPU machines (Linux x86-64, no NVIDIA driver)",
                   "python scripts/lock.py cpu", pins, removed=set(installed) - set(after),
                   notes=(f"torch=={pins.get('torch')} is PyTorch's CPU build, not on PyPI: pip takes it from the "
                          "machine's own wheels (this project's machines) or from PyTorch's CPU wheel index "
                          "(PIP_EXTRA_INDEX_URL).",))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def lock_verl() -> None:
    """Sets up a scratch verl venv with setup_verl.sh from pyproject's ranges (its ``verl`` and ``test`` extras), then
    locks what it holds."""
    scratch = Path(tempfile.mkdtemp(prefix="grpo_fast_lock_"))
    try:
        env = {**os.environ, "VERL_VENV": str(scratch / "venv"), "GRPO_FAST_VERL_LOCK": "none"}
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_verl.sh")], check=True, env=env)
        pins = freeze(scratch / "venv" / "bin" / "python")
        write_lock(LOCKS / "verl-cpu.txt", "the verl venv on CPU machines (Linux x86-64, no NVIDIA driver)",
                   "python scripts/lock.py verl", pins, script="scripts/setup_verl.sh",
                   refresh="python scripts/lock.py verl",
                   notes=(f"torch=={pins.get('torch')} is PyTorch's CPU build, as in cpu.txt.",))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def lock_cuda() -> None:
    """What pip resolves for ``.[dev,vllm]`` on a CUDA Linux machine: torch from PyPI (its CUDA build), without this
    machine's local wheels (PIP_FIND_LINKS) or pip configuration (PIP_CONFIG_FILE). The resolver is the CPU lock's
    pip, in a scratch venv (an old pip mis-resolves torch's ``cuda-toolkit==13.0.3`` requirement)."""
    with tempfile.TemporaryDirectory(prefix="grpo_fast_lock_") as tmp:
        report = Path(tmp) / "report.json"
        env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
        env["PIP_CONFIG_FILE"] = os.devnull
        subprocess.run([sys.executable, "-m", "venv", str(Path(tmp) / "venv")], check=True)
        python = str(Path(tmp) / "venv" / "bin" / "python")
        pip_version = read_lock(LOCKS / "cpu.txt")[0]["pip"]
        subprocess.run([python, "-m", "pip", "install", "-q", f"pip=={pip_version}"], check=True, env=env)
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), f"{ROOT}[dev,vllm]"], check=True, env=env)
        installs = json.loads(report.read_text())["install"]
    pins = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    pins.pop(PROJECT, None)
    pins["pip"] = pip_version  # setup.sh upgrades pip first, to this
    write_lock(LOCKS / "cuda.txt", "CUDA machines (Linux x86-64 with an NVIDIA driver)",
               "python scripts/lock.py cuda (pip's resolution, not an install: no GPU where it was made)", pins)


def check(venv: Path, lock: Path) -> int:
    """0 when the venv holds exactly the lock (less what the lock marks as removed by setup.sh), else 1 and what
    differs, with the way out."""
    pins, removed = read_lock(lock)
    held = freeze(venv / "bin" / "python")
    want = {k: v for k, v in pins.items() if k not in removed}
    problems = [f"{name}: locked {want[name]}, installed {held.get(name, 'nothing')}"
                for name in sorted(want) if not same_version(want[name], held.get(name))]
    extra = sorted(set(held) - set(pins)) + sorted(removed & set(held))
    problems += [f"{name}: installed {held[name]}, " + ("which setup.sh removes" if name in removed else
                                                          "not in the lock") for name in extra]
    if problems:
        print(f"{venv} does not hold {lock.name}:\n  " + "\n  ".join(problems), file=sys.stderr)
        if extra:
            print(f"packages installed by hand stay in a venv: {venv}/bin/python -m pip uninstall -y "
                  + " ".join(extra) + f" (or remove {venv} and run setup.sh again)", file=sys.stderr)
        return 1
    print(f"{venv} holds {lock.relative_to(ROOT) if lock.is_relative_to(ROOT) else lock} exactly ({len(held)} "
          "packages)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cpu", help="lock the CPU environment (builds a scratch venv; a few minutes)")
    sub.add_parser("cuda", help="lock the CUDA environment (pip's resolution; about a minute)")
    sub.add_parser("verl", help="lock the verl venv on CPU (builds a scratch venv; several minutes)")
    c = sub.add_parser("check", help="does a venv hold exactly a lock?")
    c.add_argument("--venv", type=Path, default=ROOT / ".venv")
    c.add_argument("--lock", type=Path, default=LOCKS / "cpu.txt")
    args = parser.parse_args(argv)
    if args.command == "cpu":
        lock_cpu()
    elif args.command == "cuda":
        lock_cuda()
    elif args.command == "verl":
        lock_verl()
    else:
        return check(args.venv.resolve(), args.lock.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
