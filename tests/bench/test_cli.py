"""`ferry bench` argument rules and clean skips (no suite is run here: each takes minutes)."""

from __future__ import annotations

import pytest
import torch

from bench import cli


def test_all_expands_to_every_suite_and_extra_args_need_one_suite():
    args, extra = cli._parse(["--suite", "all", "--quick"])
    assert args.suite == list(cli.SUITES) and args.quick and extra == []
    args, extra = cli._parse(["--suite", "throughput", "--", "--n", "4"])
    assert args.suite == ["throughput"] and extra == ["--n", "4"]
    with pytest.raises(SystemExit):
        cli._parse(["--suite", "throughput", "--suite", "prefix", "--", "--n", "4"])
    with pytest.raises(SystemExit):
        cli._parse([])


def test_missing_module_and_unreachable_redis_are_skip_reasons(monkeypatch):
    assert (
        cli.missing_requirement(cli.Suite("x", "bench.no_such_suite", ()))
        == "bench/no_such_suite.py does not exist yet"
    )
    monkeypatch.setenv("FERRY_REDIS_URL", "redis://127.0.0.1:1/0")
    reason = cli.missing_requirement(cli.Suite("queue", "bench.queue", (), needs="redis"))
    assert reason == "needs Redis at redis://127.0.0.1:1/0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_kernels_suite_is_skipped_without_cuda(capsys):
    assert cli.main(["--suite", "kernels", "--no-plots"]) == 0
    assert "kernels     skipped" in capsys.readouterr().out


def test_a_suite_runs_in_its_own_process_and_its_json_becomes_latest(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "RESULTS_DIR", tmp_path)
    out = tmp_path / "prefix-run.json"
    argv = [
        "--suite",
        "prefix",
        "--quick",
        "--model",
        str(cli.REPO / "models" / "demo"),
        "--no-plots",
        "--",
        "--restore-gib",
        "0.002",
        "--requests",
        "2",
        "--cold-requests",
        "1",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert (tmp_path / "prefix-latest.json").read_bytes() == out.read_bytes()
    summary = capsys.readouterr().out.splitlines()[0].split()
    assert summary[:2] == ["prefix", "ok"] and summary[-1] == str(out)
