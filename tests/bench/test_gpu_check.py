"""The one-shot GPU check starts and writes what it should: its dry run on the CPU, every step at tiny
sizes, and a step that runs past its limit is stopped without stopping the others."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_a_file_per_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([*(f"{step}.json" for step in gpu_check.STEPS), "summary.json", "gpu_check.log"])
    assert len(names) <= 8  # what the device tool brings back from $OUT

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["ok"] is True
    assert [summary["steps"][s]["status"] for s in gpu_check.STEPS] == ["ok"] * len(gpu_check.STEPS)

    tests = json.loads((tmp_path / "kernel_tests.json").read_text())
    assert tests["tests"] > 0 and tests["failures"] == 0 and tests["errors"] == 0
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["headline"]["float32_all_identical"] is True
    assert {row["dtype"] for row in parity["rows"]} == {"float32", "bfloat16"}
    bench = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert bench["dry_run"] is True and bench["decode"] and bench["prefill"] and bench["fused_kernels"]
    assert all(row["rel_error_vs_sdpa"] < 1e-4 for row in bench["decode"] + bench["prefill"])
    serving = json.loads((tmp_path / "serving.json").read_text())
    assert [level["concurrency"] for level in serving["levels"]] == [1, 4]
    assert all(level["tokens_per_s"] > 0 and level["ttft_ms_p50"] > 0 for level in serving["levels"])


def test_a_step_past_its_limit_is_killed_and_reported_as_timeout(tmp_path):
    start = time.monotonic()
    with (tmp_path / "log").open("w") as log:
        record = gpu_check._run_step("serving", tmp_path, dry_run=True, limit=2.0, log=log)
    assert record["status"] == "timeout" and record["rc"] is None
    assert time.monotonic() - start < 20


def test_unknown_steps_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--steps", "environment,warp_drive"])
    assert "warp_drive" in capsys.readouterr().err
