"""What every benchmark shares: the machine description, percentiles, the JSON writer, and moto's
S3 server for the suites that read from S3."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def percentiles(values: list[float], points=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles, in the values' unit; None for an empty list."""
    if not values:
        return {f"p{p}": None for p in points}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] for p in points}


def ferry_beside(ferry_runs: list[float], baseline_index: int) -> float:
    """Ferry's tokens/s set against the `baseline_index`-th baseline of a bracketed run: the mean
    of the Ferry runs just before and after it (`ferry_runs` in run order, one more than the
    baselines; bench.throughput)."""
    return statistics.mean(ferry_runs[baseline_index : baseline_index + 2])


def write_result(suite: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    payload = {"suite": suite, "created": stamp, "machine": machine(), **payload}
    path = out_dir / f"{suite}-{stamp}.json"
    text = to_json(payload)
    path.write_text(text)
    (out_dir / f"{suite}-latest.json").write_text(text)
    return path


_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]")


def to_json(payload: dict) -> str:
    """Indented JSON with lists of numbers (raw latency samples) on one line each."""
    return _NUMBER_LIST.sub(
        lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]", json.dumps(payload, indent=2)
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class MotoS3:
    """moto's S3 server on this machine, as `moto_s3` started it."""

    endpoint_url: str  # http://127.0.0.1:<port>
    env: dict[str, str]  # what Ferry (this process or a worker subprocess) needs to reach it: endpoint, credentials


@contextmanager
def moto_s3(*buckets: str) -> Iterator[MotoS3]:
    """moto's S3 server on a free local port with `buckets` created, for the block. Its `env`
    (FERRY_S3_ENDPOINT_URL, fake credentials, region) is set in os.environ for the block, so
    `s3_client()` here reaches it, and given to pass on to subprocesses; werkzeug's line per
    request is silenced (it would bury the progress bars)."""
    from moto.server import ThreadedMotoServer

    from ferry.worker.common.objectstore import s3_client

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = MotoS3(f"http://127.0.0.1:{port}", {
        "FERRY_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    before = {key: os.environ.get(key) for key in moto.env}
    os.environ.update(moto.env)
    server.start()
    try:
        client = s3_client()
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield moto
    finally:
        server.stop()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
