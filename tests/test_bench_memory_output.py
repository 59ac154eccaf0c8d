"""``grpo-fast bench memory`` writes its CSV outside the committed ``bench/results/`` unless ``--csv`` names a file."""

from __future__ import annotations

import csv

from bench import bench_memory, harness


def test_the_default_csv_is_not_the_committed_one(tmp_path, monkeypatch):
    committed = harness.RESULTS_DIR / "memory_cpu.csv"
    before = committed.read_bytes()
    # each configuration's isolated process, answered at once: the driver's rows and files are what is tested
    monkeypatch.setattr(harness, "run_isolated", lambda *a, **k: {"error": "not run in this test"})
    monkeypatch.chdir(tmp_path)
    assert bench_memory.main(["--configs", "grpo_fused"]) == 1  # the configuration's error is the run's failure
    written = tmp_path / bench_memory.DEFAULT_DIR / "memory_cpu.csv"
    rows = list(csv.DictReader(written.open()))
    assert [(r["config"], r["phase"], r["error"]) for r in rows] == [("grpo_fused", "step", "not run in this test")]
    assert committed.read_bytes() == before
    assert bench_memory.main(["--configs", "grpo_fused", "--csv", str(tmp_path / "x.csv")]) == 1
    assert (tmp_path / "x.csv").is_file()
