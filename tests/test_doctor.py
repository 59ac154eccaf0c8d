"""``grpo-fast doctor`` on the CPU: the report, the self-check table, and a non-zero exit naming a broken path."""

from __future__ import annotations

import json

import pytest
import torch

import grpo_fast.dispatch
import grpo_fast.logprobs
from grpo_fast import doctor
from grpo_fast.cli import main

DTYPE_NAMES = ["float32", "bfloat16", "float16", "float64"]


def _run(argv, capsys):
    code = main(["doctor", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report")
def test_doctor_runs_on_cpu_and_checks_the_torch_path(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    code, out, _ = _run(["--json", str(path)], capsys)
    assert code == 0, out
    report = json.loads(path.read_text())
    assert report["ok"] is True
    assert report["versions"]["torch"] == torch.__version__
    assert {"python", "triton", "transformers", "grpo-fast", "liger-kernel", "NVIDIA driver"} <= set(report["versions"])
    rows = report["self_check"]["rows"]
    impls = {r["impl"] for r in rows}
    assert {"torch", "reference"} <= impls and "triton" not in impls
    assert [r["shape"] for r in rows if r["impl"] == "torch"] == ["small", "medium", "large"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["peak_mib"] is None  # no allocator statistics on CPU
        expected = set(doctor.QUANTITIES) - ({"logps"} if r["impl"] == "liger" else set())
        assert set(r["errors"]) == expected
        for q, e in r["errors"].items():
            assert 0 <= e["err"] <= e["bound"] < 1e-3, (r["impl"], q, e)
        line = next(ln for ln in out.splitlines() if ln.split()[:3] == [r["shape"], r["size"], r["impl"]])
        assert f"{r['median_ms']:.2f}" in line and " ok " in line
    assert "The Triton path needs a CUDA GPU" in out and "TRITON_INTERPRET=1" in out
    assert out.rstrip().splitlines()[-2].startswith(f"OK: {len(rows)} of {len(rows)} rows passed")


def test_auto_table_shows_what_resolve_impl_answers(monkeypatch, capsys, tmp_path):
    real = grpo_fast.dispatch.resolve_impl

    def marked(impl, device, op, dtype=None):  # one answer no real resolver gives, to see it reach the table
        return "MARK" if (op, dtype) == ("group_advantages", torch.float16) else real(impl, device, op, dtype)

    monkeypatch.setattr(grpo_fast.dispatch, "resolve_impl", marked)
    path = tmp_path / "doctor.json"
    code, out, _ = _run(["--no-check", "--json", str(path)], capsys)
    assert code == 0
    auto = json.loads(path.read_text())["auto"]
    assert {(r["device"], r["op"]) for r in auto} >= {("cpu", op) for op in doctor.OPS}
    for r in auto:
        for name in DTYPE_NAMES:
            expected = marked("auto", torch.device(r["device"]), r["op"], getattr(torch, name))
            assert r[name] == expected
        line = next(ln for ln in out.splitlines() if ln.split()[:2] == [r["device"], r["op"]])
        assert line.split()[2:] == [r[name] for name in DTYPE_NAMES]
    assert "MARK" in out and "allow_tf32" in out


def test_a_wrong_torch_path_exits_non_zero_and_names_it(monkeypatch, capsys, tmp_path):
    real = grpo_fast.logprobs.logprobs_op

    def off_by_a_little(h, w, y, b, params, impl):
        logps, entropy = real(h, w, y, b, params, impl)
        return (logps + 1e-3 if impl == "torch" else logps), entropy

    monkeypatch.setattr(grpo_fast.logprobs, "logprobs_op", off_by_a_little)
    path = tmp_path / "doctor.json"
    code, out, _ = _run(["--device", "cpu", "--shapes", "small", "--json", str(path)], capsys)
    assert code == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL:")]
    assert len(fails) == 1 and fails[0].startswith("FAIL: torch at shape small")
    assert "logps error 1.0" in fails[0] and "loss error" in fails[0]
    rows = {r["impl"]: r for r in json.loads(path.read_text())["self_check"]["rows"]}
    assert rows["torch"]["status"] == "FAIL" and rows["reference"]["status"] == "ok"
    assert not rows["torch"]["errors"]["logps"]["ok"]
    assert "FAILED" in out.splitlines()[-2]


def test_an_implementation_that_raises_is_a_failure(monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(grpo_fast.logprobs, "logprobs_op", broken)
    code, out, _ = _run(["--device", "cpu", "--shapes", "small"], capsys)
    assert code == 1
    assert "FAIL: torch at shape small (2x37x64x515, float32): raised RuntimeError: kernel exploded" in out


def test_rows_past_the_budget_are_skipped_not_failed(capsys):
    code, out, _ = _run(["--device", "cpu", "--budget", "1e-9"], capsys)
    assert code == 0
    assert out.count(" skipped ") >= 6 and "budget was spent" in out and "FAIL" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bad_arguments_name_the_option(capsys):
    code, _, err = _run(["--device", "cuda"], capsys)
    assert code == 2 and "--device" in err and "no CUDA device" in err
    code, _, err = _run(["--device", "cpu", "--reps", "0"], capsys)
    assert code == 2 and "--reps" in err


def test_help_explains_the_check(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "float64 reference" in out and "TRITON_INTERPRET=1" in out and "--json FILE" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "doctor" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["directory", "below a file", "empty"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_check(where, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    path = {"directory": tmp_path, "below a file": tmp_path / "a-file" / "doctor.json", "empty": ""}[where]
    code, out, err = _run(["--device", "cpu", "--shapes", "small", "--json", str(path)], capsys)
    expected = {"directory": f"--json: expected a file path, got the directory '{tmp_path}'",
                "below a file": f"--json: cannot create '{path}': '{tmp_path / 'a-file'}' is a file, not a directory",
                "empty": "--json: expected a file path, got an empty path ''"}
    assert code == 2 and err.strip() == f"grpo-fast doctor: error: {expected[where]}"
    assert out == ""  # refused before anything ran


def test_a_json_file_that_fails_at_the_end_is_printed_and_named(monkeypatch, tmp_path, capsys):
    """The path was fine at the start and is not by the end (here its directory became a file during the run): the
    results are printed, JSON included, and one line on stderr says where they could not go (exit 2, not 1)."""
    real = doctor.auto_paths
    target = tmp_path / "out" / "doctor.json"

    def and_break_the_path(names):
        (tmp_path / "out").write_text("")  # the directory --json names is a file now
        return real(names)

    monkeypatch.setattr(doctor, "auto_paths", and_break_the_path)
    code, out, err = _run(["--no-check", "--json", str(target)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"grpo-fast doctor: error: --json: could not write '{target}' (File exists); "
                                        "the results are printed above"]
    printed = json.loads(out.split(f"JSON (not written to {target}):\n", 1)[1])
    assert printed["ok"] is True and printed["versions"]["torch"] == torch.__version__
    assert {r["op"] for r in printed["auto"]} == set(doctor.OPS)
