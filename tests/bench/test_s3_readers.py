"""bench.s3_readers' pure parts: the medians and ratios, the check that fails a reader returning
other bytes, and a runai that cannot run being left out with its reason (no S3 server, no reader
subprocess and no install here: those are replaced by fakes)."""

from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager

import pytest
import torch

from bench import report, s3_readers
from bench.common import MotoS3
from bench.plots import plot_s3_readers
from bench.s3_read import tensor_digest


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: tensor_digest(t) for name, t in tensors.items()}


TENSORS = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16), "b": torch.ones(5)}


def _measured(seconds: dict[str, list[float]]) -> s3_readers.Measured:
    return s3_readers.Measured({name: [s3_readers.Run(x, 17, {"load_s": x / 2}) for x in runs]
                                for name, runs in seconds.items()}, {}, {})


def test_summary_gives_medians_and_bytes_per_s_ratios_to_raw_get_and_ferry():
    runs = {"raw-get": [1.0, 3.0, 2.0], "ferry-boto3": [2.0, 4.0, 3.0], "runai": [6.0, 6.0, 7.0], "runai-c16": []}
    out = s3_readers.summarize(_measured(runs), model_bytes=600)
    assert set(out) == {"raw-get", "ferry-boto3", "runai"}  # no runs, no row
    assert out["raw-get"]["bytes_per_s"] == 300 and out["raw-get"]["vs_raw_get"] == 1.0
    assert out["ferry-boto3"]["seconds"] == 3.0 and out["ferry-boto3"]["vs_raw_get"] == pytest.approx(2 / 3)
    assert out["runai"]["vs_ferry_boto3"] == pytest.approx(0.5) and out["runai"]["vs_raw_get"] == pytest.approx(1 / 3)
    assert out["runai"]["runs_s"] == [6.0, 6.0, 7.0] and out["runai"]["ranged_gets"] == 17
    assert out["runai"]["phases_s"] == {"load_s": 3.0}


def test_ratios_are_none_without_the_reader_they_compare_to():
    out = s3_readers.summarize(_measured({"ferry-boto3": [2.0]}), model_bytes=100)
    assert out["ferry-boto3"]["vs_raw_get"] is None and out["ferry-boto3"]["vs_ferry_boto3"] == 1.0


def test_equal_tensors_pass_the_check():
    same = {name: t.clone() for name, t in TENSORS.items()}
    s3_readers.check_tensors("runai", _digests(TENSORS), _digests(same))


@pytest.mark.parametrize("change", ["one bit", "missing", "extra", "dtype", "shape"])
def test_a_reader_returning_other_tensors_fails_the_run(change):
    got = {name: t.clone() for name, t in TENSORS.items()}
    if change == "one bit":
        got["a"].view(torch.int16)[1, 2] ^= 1
    elif change == "missing":
        del got["b"]
    elif change == "extra":
        got["c"] = torch.zeros(1)
    elif change == "dtype":
        got["a"] = got["a"].view(torch.int16)  # the same bytes read as another type
    else:
        got["b"] = got["b"].reshape(5, 1)
    with pytest.raises(s3_readers.WrongBytesError, match="runai"):
        s3_readers.check_tensors("runai", _digests(TENSORS), _digests(got))
    with pytest.raises(s3_readers.WrongBytesError, match="no tensors"):
        s3_readers.check_tensors("runai", _digests(TENSORS), None)


def test_a_failure_is_told_by_its_error_lines_and_final_exception():
    stderr = ("noise\n\x1b[0;31m[2026-12-06] [ERROR  ] [s3/client/client.cc:364] Failed to download s3 object: "
              "AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE\x1b[m\nTraceback (most recent call last):\n"
              "ValueError: Could not receive response from libstreamer due to: b'File access error'\n")
    assert s3_readers.failure(stderr) == (
        "[2026-12-06] [ERROR  ] [s3/client/client.cc:364] Failed to download s3 object: "
        "AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE | "
        "ValueError: Could not receive response from libstreamer due to: b'File access error'")


def test_ranged_gets_are_counted_and_no_request_line_is_printed():
    gets = s3_readers.RangedGets()
    lines = ['127.0.0.1 - - "GET /bench/smollm2/model.safetensors HTTP/1.1" 206 -',
             '127.0.0.1 - - "GET /bench?list-type=2 HTTP/1.1" 200 -']
    assert not any(gets.filter(logging.makeLogRecord({"msg": line})) for line in lines)
    assert gets.count == 1


def test_the_digest_reads_a_non_contiguous_tensor_by_its_values():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())


@pytest.fixture(autouse=True)
def no_s3_server(monkeypatch):
    @contextmanager
    def fake_moto(*buckets):
        yield MotoS3("http://127.0.0.1:9", {"FERRY_S3_ENDPOINT_URL": "http://127.0.0.1:9"})

    monkeypatch.setattr(s3_readers, "moto_s3", fake_moto)
    monkeypatch.setattr(s3_readers, "upload", lambda weights: None)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"runs": 2, "no_runai": False, "runai_python": "unused", **kw})


def test_runai_that_cannot_be_installed_is_left_out_with_the_reason(monkeypatch, tmp_path):
    ran = []

    def fake_run(python, reader, env):
        ran.append(reader.name)
        tensors = None if reader.name == "raw-get" else _digests(TENSORS)
        return {"seconds": 1.0, "bytes": 10, "tensors": tensors, "phases": {}}, ""

    monkeypatch.setattr(s3_readers, "runai_python", lambda path: (None, "pip install failed: no network"))
    monkeypatch.setattr(s3_readers, "run_reader", fake_run)
    out = s3_readers.measure(_args(), tmp_path, _digests(TENSORS))
    not_runai = [r.name for r in s3_readers.READERS if not r.runai]
    assert sorted(ran) == sorted(not_runai * 2)
    assert out.runs == {name: [s3_readers.Run(1.0, 0, {})] * 2 for name in not_runai}
    assert out.left_out == {r.name: "pip install failed: no network" for r in s3_readers.READERS if r.runai}


LOG_LINE = "2026-12-06 [INFO] [RunAI Streamer] Overall time to stream 48.0 MiB of all files to cpu: 1.1s"


def test_a_runai_run_that_fails_drops_the_reader_and_keeps_why(monkeypatch, tmp_path):

    def fake_run(python, reader, env):
        if reader.runai:
            assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
            assert env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] == "0"
            if reader.name == "runai":
                return None, "exit code 1: connection refused"
            return {"seconds": 2.0, "bytes": 10, "tensors": _digests(TENSORS), "phases": {}}, f"noise\n{LOG_LINE}\n"
        tensors = None if reader.name == "raw-get" else _digests(TENSORS)
        return {"seconds": 1.0, "bytes": 10, "tensors": tensors, "phases": {}}, ""

    monkeypatch.setattr(s3_readers, "runai_python", lambda path: (tmp_path / "python", None))
    monkeypatch.setattr(s3_readers, "run_reader", fake_run)
    out = s3_readers.measure(_args(), tmp_path, _digests(TENSORS))
    assert out.runs["runai"] == [] and out.runs["runai-c16"] == [s3_readers.Run(2.0, 0, {})] * 2  # no server: 0 GETs
    assert out.left_out == {"runai": "the read failed: exit code 1: connection refused"}
    assert out.runai_log == {r.name: [LOG_LINE] for r in s3_readers.READERS if r.runai and r.name != "runai"}
    payload = {"model": "m", "model_bytes": 20, "tensors": 2, "left_out": out.left_out,
               "readers": s3_readers.summarize(out, 20)}
    assert "runai              left out: the read failed: exit code 1" in s3_readers.table(payload)


def test_wrong_bytes_from_ferry_fail_the_run(monkeypatch, tmp_path):
    wrong = _digests({**TENSORS, "b": torch.zeros(5)})
    monkeypatch.setattr(s3_readers, "run_reader", lambda python, reader, env: (
        {"seconds": 1.0, "bytes": 10, "tensors": None if reader.name == "raw-get" else wrong, "phases": {}}, ""))
    with pytest.raises(s3_readers.WrongBytesError, match=r"ferry-boto3: other bytes in \['b'\]"):
        s3_readers.measure(_args(no_runai=True), tmp_path, _digests(TENSORS))


def test_report_row_and_plot(tmp_path):
    data = {"model": "m", "model_bytes": 269e6, "readers": s3_readers.summarize(_measured(
        {"raw-get": [2.0], "ferry-boto3": [4.0], "ferry-boto3-64mib": [2.0], "runai-c16": [5.0],
         "runai-c16-64mib": [1.0]}), model_bytes=269_000_000)}
    rows = report.rows_for("s3_readers", data)
    assert [(r.metric.rsplit(", ", 1)[1], r.baseline_name, r.factor) for r in rows] == [
        ("ferry-boto3", "runai-model-streamer (runai-c16)", 1.25),
        ("ferry-boto3-64mib", "runai-model-streamer (runai-c16-64mib)", 0.5)]
    assert plot_s3_readers(data, tmp_path)[0].is_file()
    # with the worker's own reader in the run, the rows are its
    data["readers"] = s3_readers.summarize(_measured(
        {"ferry-boto3": [4.0], "ferry-stream": [2.0], "ferry-stream-64mib": [0.5], "runai-c16": [5.0],
         "runai-c16-64mib": [1.0]}), model_bytes=269_000_000)
    rows = report.rows_for("s3_readers", data)
    assert [(r.metric.rsplit(", ", 1)[1], r.baseline_name, r.factor) for r in rows] == [
        ("ferry-stream", "runai-model-streamer (runai-c16)", 2.5),
        ("ferry-stream-64mib", "runai-model-streamer (runai-c16-64mib)", 2.0)]
