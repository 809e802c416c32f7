"""One reader of bench.s3_readers, run once in a fresh process: it reads the checkpoint's
safetensors under s3://<bucket>/<prefix>/ into torch CPU tensors of this process and prints one
JSON line: the seconds from its first S3 call to the last tensor in memory, the bytes, and a digest
per tensor (computed after the clock stops) for the parent to check against the local file.

    python -m bench.s3_read raw-get|ferry-boto3|ferry-stream|runai <bucket> <prefix>

.venv's python runs `raw-get`, `ferry-boto3` and `ferry-stream`; .venv-runai's runs `runai` (it sees .venv's torch,
not Ferry's S3 settings: the parent gives it AWS_ENDPOINT_URL and the other variables runai reads).
Each reader imports what it needs before its clock starts, so no reader is charged for imports.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace


@dataclass
class Read:
    """What one reader did in this process."""

    seconds: float  # first S3 call (the listing) to every tensor in memory
    bytes: int  # bytes of the safetensors files read
    tensors: dict[str, list] | None  # name -> tensor_digest(tensor); None for raw-get (bodies dropped)
    phases: dict[str, float] = field(default_factory=dict)  # where the seconds went, where the reader shows it


def tensor_digest(tensor) -> list:
    """[dtype, shape, sha256 of the tensor's bytes]: equal for equal tensors, whatever the reader."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), hashlib.sha256(data).hexdigest()]


def _weight_keys(client, bucket: str, prefix: str) -> list[tuple[str, int]]:
    """(key, size) of each .safetensors object under the prefix."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    return [(o["Key"], o["Size"]) for page in pages for o in page.get("Contents", [])
            if o["Key"].endswith(".safetensors")]


def _set_range_bytes(s3) -> None:
    """bench.s3_readers' *-64mib readers: the same reader with larger GETs (its RANGE_BYTES, in this process)."""
    if "BENCH_S3_RANGE_BYTES" in os.environ:
        s3.RANGE_BYTES = int(os.environ["BENCH_S3_RANGE_BYTES"])


def read_raw_get(bucket: str, prefix: str) -> Read:
    """bench.cold_start's ranged GETs alone (16 in parallel, 16 MiB each, bodies dropped): the ceiling."""
    from bench.cold_start import BUCKET, raw_get_throughput
    from ferry.worker.common.objectstore import s3_client

    if bucket != BUCKET:
        raise ValueError(f"raw_get_throughput reads the bucket {BUCKET!r}, not {bucket!r}")
    client = s3_client(max_connections=16)
    keys = _weight_keys(client, bucket, prefix)
    total = sum(size for _, size in keys)
    rate = raw_get_throughput(client, [key for key, _ in keys])  # times the GETs alone, not its HEADs
    return Read(total / rate, total, None)


def read_ferry_boto3(bucket: str, prefix: str) -> Read:
    """Ferry's S3 source (list_files, then download: parallel ranged GETs pwritten into a
    directory), then safetensors' safe_open on each file, as the worker's loader reads it."""
    import tempfile
    from pathlib import Path

    from safetensors import safe_open

    from ferry.worker.models.sources import s3
    from ferry.worker.models.sources.progress import TransferProgress
    from ferry.worker.models.sources.refs import parse_ref

    _set_range_bytes(s3)
    with tempfile.TemporaryDirectory(prefix="ferry-s3-read-") as tmp:
        started = time.perf_counter()
        ref = parse_ref(f"s3://{bucket}/{prefix}/")
        listing = s3.list_files(ref)
        # The weights alone: every reader here reads the same bytes (the worker also fetches the
        # config and tokenizer, 3.5 MB, which runai's SafetensorsStreamer never reads).
        weights = replace(listing, files=tuple(f for f in listing.files if f.name.endswith(".safetensors")))
        listed = time.perf_counter()
        s3.download(weights, Path(tmp), TransferProgress(ref.text, weights.total_bytes), lambda file: None)
        downloaded = time.perf_counter()
        tensors = {}
        for file in weights.files:
            with safe_open(str(Path(tmp) / file.name), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        done = time.perf_counter()
        phases = {"list_s": listed - started, "download_s": downloaded - listed, "load_s": done - downloaded}
        return Read(done - started, weights.total_bytes, {name: tensor_digest(t) for name, t in tensors.items()},
                    phases)


def read_ferry_stream(bucket: str, prefix: str) -> Read:
    """What `ferry worker` does: the download into a node cache on its own thread (BackgroundFetch),
    and the loader's `open_weights` reading each tensor as its bytes arrive (sources/arriving.py),
    no second read of the file. It brings the whole checkpoint: the config and tokenizer (3.5 MB,
    not counted in its bytes, but in its seconds) come first, then the weights."""
    import tempfile
    from pathlib import Path

    from ferry.worker.models import loader
    from ferry.worker.models.sources import s3
    from ferry.worker.models.sources.background import BackgroundFetch
    from ferry.worker.models.sources.refs import parse_ref

    _set_range_bytes(s3)
    with tempfile.TemporaryDirectory(prefix="ferry-s3-stream-") as tmp:
        started = time.perf_counter()
        fetch = BackgroundFetch(parse_ref(f"s3://{bucket}/{prefix}/"), Path(tmp))
        entry = fetch.entry()  # the small files are in: the loader starts, the weights are arriving
        entered = time.perf_counter()
        tensors = {}
        for path in loader.weight_files(entry):
            with loader.open_weights(path) as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        fetch.result()
        done = time.perf_counter()
        total = sum(p.stat().st_size for p in entry.glob("*.safetensors"))  # the bytes the others read
        phases = {"small_files_s": entered - started, "weights_s": done - entered}
        return Read(done - started, total, {name: tensor_digest(t) for name, t in tensors.items()}, phases)


def read_runai(bucket: str, prefix: str) -> Read:
    """runai-model-streamer's SafetensorsStreamer on the s3:// files (its own listing, through
    boto3), every tensor taken from get_tensors() and kept (owned, the default)."""
    from runai_model_streamer import SafetensorsStreamer, list_safetensors

    started = time.perf_counter()
    files = list_safetensors(f"s3://{bucket}/{prefix}/")
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        tensors = dict(streamer.get_tensors())
        total = streamer.total_size
    seconds = time.perf_counter() - started
    return Read(seconds, total, {name: tensor_digest(t) for name, t in tensors.items()})


READERS = {"raw-get": read_raw_get, "ferry-boto3": read_ferry_boto3, "ferry-stream": read_ferry_stream,
           "runai": read_runai}


def main(argv: list[str]) -> int:
    reader, bucket, prefix = argv
    read = READERS[reader](bucket, prefix)
    print(json.dumps(asdict(read)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
