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


def test_replot_without_a_csv_names_the_default_and_redraws_a_named_one(tmp_path, monkeypatch, capsys):
    """--replot (the docstring's example) redraws the default CSV when a run wrote one; without it, one line saying
    where it looked; --csv names any other."""
    from grpo_fast.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["bench", "memory", "--replot"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"grpo-fast bench memory: error: --replot: no CSV to redraw at {bench_memory.DEFAULT_DIR}/memory_cpu.csv "
        "(the default: where a run without --csv writes it); run the benchmark first, or name a CSV with --csv "
        "(e.g. --csv bench/results/memory_cpu.csv)")
    csv_path = tmp_path / "memory.csv"
    csv_path.write_bytes((harness.RESULTS_DIR / "memory_cpu.csv").read_bytes())
    assert main(["bench", "memory", "--replot", "--csv", str(csv_path)]) == 0
    assert (tmp_path / "memory.png").stat().st_size > 0
    default = tmp_path / bench_memory.DEFAULT_DIR / "memory_cpu.csv"
    default.parent.mkdir()
    default.write_bytes(csv_path.read_bytes())
    assert main(["bench", "memory", "--replot"]) == 0
    assert default.with_suffix(".png").stat().st_size > 0
