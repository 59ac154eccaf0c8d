"""bench/gpu_check.sh on the CPU: its time budget, its no-install import route, its benchmark arguments, and the
harness's CSV that keeps every finished row when a run is killed."""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import signal
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import bench_head, bench_loss, bench_memory, bench_prefix, harness
from grpo_fast import doctor
from grpo_fast.cli import _train_parser, train_overrides
from grpo_fast.train import build_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
LIMIT_S = 8 * 60


def _script() -> str:
    return SCRIPT.read_text()


def _steps() -> list[tuple[str, str, list[str]]]:
    """``(name, seconds, argv)`` of every ``step`` call, continuation lines joined, in the script's order."""
    text = _script().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        code = line.split(" #")[0] if not line.lstrip().startswith("#") else ""
        m = re.search(r"(?:^|&& |then |else )\s*step (\S+) (\S+) (.*)$", code.strip())
        if m:
            steps.append((m.group(1), m.group(2), shlex.split(m.group(3))))
    return steps


def test_every_step_has_a_timeout_and_they_sum_to_the_stated_budget():
    text = _script()
    grace = int(re.search(r"^GRACE=(\d+)", text, re.M).group(1))
    setup_s = int(re.search(r"^SETUP_S=(\d+)", text, re.M).group(1))  # the GPU run's value
    steps = _steps()
    names = [name for name, _, _ in steps]
    assert names == ["device", "setup", "doctor", "gpu_tests", "micro_small", "micro_large", "head", "loss",
                     "prefix", "train", "memory"]
    seconds = [setup_s if s == '"$SETUP_S"' else int(s) for _, s, _ in steps]
    total = sum(seconds) + grace * len(steps)
    stated = re.search(r"step timeouts ([\d+]+) = (\d+) s, plus (\d+) s of kill\n# grace for each of the (\d+) steps = "
                       r"(\d+) s", text)
    assert stated, "the budget comment is missing or changed its form"
    assert [int(s) for s in stated.group(1).split("+")] == seconds
    assert int(stated.group(2)) == sum(seconds) and int(stated.group(3)) == grace
    assert int(stated.group(4)) == len(steps) and int(stated.group(5)) == total
    assert total <= LIMIT_S - 10  # what runs outside the steps (the link farm, find_spec probes) takes seconds
    # nothing else waits without a timeout: `timeout` appears only inside step(), python runs only through step()
    body = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    assert sum("timeout -k" in ln for ln in body) == 1
    assert not [ln for ln in body if re.search(r'"\$PY" -(m|c) ', ln) and "step " not in ln and "has()" not in ln
                and "find_spec" not in ln]


def test_gpu_tests_run_right_after_the_doctor():
    steps = {name: argv for name, _, argv in _steps()}
    assert steps["doctor"][1:4] == ["-m", "grpo_fast", "doctor"] and "--json" in steps["doctor"]
    gpu = steps["gpu_tests"]
    assert gpu[1:3] == ["-m", "pytest"] and gpu[gpu.index("-m", 3) + 1] == "gpu" and gpu[-1] == "tests/"
    assert all("--benchmark-json" in steps[f"micro_{size}"] for size in ("small", "large"))
    assert "[ ! -d bench/micro ]" in _script()


@pytest.mark.parametrize("step", ["doctor", "head", "loss", "prefix", "train", "memory"])
def test_each_step_passes_its_command_valid_arguments(step, tmp_path):
    """The arguments a GPU run gives each program parse (and validate) with that program's own parser here."""
    argv = {name: a for name, _, a in _steps()}[step]
    argv = [a.replace("$OUT", str(tmp_path)) for a in argv if a != "$LIGER"]  # liger: absent on the GPU machine
    assert argv[:2] == ["$PY", "-m"]
    module, args = argv[2], argv[3:]
    if step == "doctor":
        p = argparse.ArgumentParser()
        doctor.add_arguments(p)
        ns = p.parse_args(args[1:])
        assert ns.budget + 20 <= int({n: s for n, s, _ in _steps()}["doctor"])  # the self-check fits its step
    elif module == "bench.bench_head":
        ns = bench_head._parse_args([a.replace("$HEAD_MD", str(tmp_path / "head_gpu.md")) for a in args])
        assert ns.shapes == [bench_head.parse_shape(s) for s in bench_head.DEFAULT_SHAPES] and not ns.dry_run
        assert ns.md == tmp_path / "head_gpu.md" and ns.csv == tmp_path / "head_gpu.csv"
        # the budget leaves the step ten seconds for start-up (imports, CUDA) and the last shape's tail
        assert ns.budget_s + 10 <= int({n: s for n, s, _ in _steps()}["head"])
    elif module == "bench.bench_loss":
        ns = bench_loss._parse_args(args)
        assert ns.impls == ["triton", "reference", "matmul"] and ns.device == "cuda"
    elif module == "bench.bench_prefix":
        assert bench_prefix._parse_args(args).device == "cuda"
    elif module == "bench.bench_memory":
        assert bench_memory.build_parser("x").parse_args(args).device == "cuda"
    else:
        assert module == "grpo_fast" and args[0] == "train"
        sub = argparse.ArgumentParser().add_subparsers(dest="command")
        ns = _train_parser(sub).parse_args(args[1:])
        config = build_config({}, train_overrides(ns))
        assert config.device == "cuda" and config.steps == 50


def test_the_summary_ends_with_the_heads_measured_vs_projected_table(tmp_path):
    """The table the head step writes (``--md "$HEAD_MD"``) is what the summary prints last; a run in which the
    head step did not write one prints none (the script removes a table left by an earlier run before any step)."""
    text = _script()
    assert re.search(r'^HEAD_MD=\$OUT/head_gpu\.md\b.*\nrm -f "\$HEAD_MD"$', text, re.M)
    head = {name: argv for name, _, argv in _steps()}["head"]
    assert head[head.index("--md") + 1] == "$HEAD_MD"
    func = re.search(r"^summary\(\) \{\n.*?^\}\n", text, re.M | re.S).group(0)
    table = bench_head.results_table([{
        "N": 16384, "H": 4096, "V": 151936, "measured_ms": 120.0, "measured_gemm_ms": 80.0, "measured_ratio": 1.5,
        "measured_extra_mib": 300.0, "check": "ok", "projected_ms": 115.0, "projected_gemm_ms": 82.5,
        "projected_ratio": 1.39, "projected_extra_mib": 320.0, "profile": "h200"}])
    (tmp_path / "head_gpu.md").write_text(table + "\n")
    run = f"{func}\nstart=$(date +%s); SUMMARY=('device     rc=0'); OUT={tmp_path}; HEAD_MD=$OUT/$1; summary"
    shown = subprocess.run(["bash", "-c", run, "bash", "head_gpu.md"], capture_output=True, text=True, check=True)
    assert shown.stdout.rstrip().endswith(table) and "measured vs projected" in shown.stdout
    assert "| 16384 x 4096 x 151936 | 120.00 | 80.00 | 1.50x | 115.00 | 82.50 | 1.39x |" in shown.stdout
    none = subprocess.run(["bash", "-c", run, "bash", "absent.md"], capture_output=True, text=True, check=True)
    assert "device     rc=0" in none.stdout and "|" not in none.stdout


def test_setup_imports_grpo_fast_kernels_without_an_install(tmp_path):
    """The script's set-up alone, run by a Python that cannot see the editable install (``-S``: no .pth files) but
    has torch, triton, transformers and pytest on PYTHONPATH: grpo_fast.kernels comes from the link farm, here and in
    a harness child process."""
    site_packages = site.getsitepackages()[0]
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=site_packages, PYTHON=str(py), OUT=str(tmp_path / "out"))
    plain = subprocess.run([str(py), "-c", "import grpo_fast.kernels"], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(env, PYTHONPATH=f"{ROOT}:{site_packages}"))
    assert plain.returncode != 0 and "No module named 'grpo_fast.kernels'" in plain.stderr  # the problem solved
    res = subprocess.run(["bash", str(SCRIPT), "--setup-only"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    farm = re.search(r"grpo_fast.kernels here: (\S+)/grpo_fast/kernels/__init__.py", res.stdout).group(1)
    assert f"grpo_fast.kernels in a benchmark child: {farm}/grpo_fast/kernels/__init__.py" in res.stdout
    assert not Path(farm).exists()  # removed on exit
    assert re.search(r"^setup\s+rc=0\s", res.stdout, re.M)
    assert (tmp_path / "out" / "setup.log").exists()


def test_a_killed_run_keeps_the_rows_it_finished(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("stale,rows\n1,2\n")
    code = textwrap.dedent(f"""
        import sys, time
        from bench import harness
        rows = harness.CsvRows({str(path)!r})
        rows.add({{"impl": "a", "median_ms": 1.5}})
        rows.add({{"impl": "b", "median_ms": 2.5, "error": ""}})
        print("two rows", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "two rows"
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], r["median_ms"], r["error"]) for r in rows] == [("a", "1.5", ""), ("b", "2.5", "")]


@pytest.mark.slow
def test_bench_loss_killed_mid_run_keeps_its_finished_rows(tmp_path):
    path = tmp_path / "loss.csv"
    cmd = [sys.executable, "-m", "bench.bench_loss", "--device", "cpu", "--n", "16", "--batch", "2", "--h", "16",
           "--vocab", "64", "96", "128", "--impls", "torch", "reference", "--no-check", "--warmup", "0", "--reps", "1",
           "--threads", "1", "--csv", str(path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(harness.read_csv(path)) >= 1:
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its configuration's child process, as `timeout` does
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it was killed"
    rows = harness.read_csv(path)
    assert 1 <= len(rows) < 6
    assert rows[0]["impl"] == "torch" and rows[0]["V"] == "64" and float(rows[0]["median_ms"]) > 0
    assert rows[0]["error"] == "" and rows[0]["torch"]
