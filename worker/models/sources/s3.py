"""Models in S3 (any S3 API: AWS, MinIO, R2; `FERRY_S3_ENDPOINT_URL` as for snapshots).

The listing names the serving files under the prefix with their sizes and ETags; the download
splits every file into ranges of `RANGE_BYTES` and fetches them with `PARALLEL_GETS` concurrent
ranged GETs, in the listing's order (the node cache puts the small files first), each written in
place (pwrite) into the cache's temporary directory; a file is reported once its last range is in. Every GET sends
`If-Match: <etag>`, so an object replaced mid-download fails the download instead of mixing two
versions, and each range must come back whole. The raw GET throughput is logged and kept in the
entry's source.json.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ferry.worker.common.objectstore import s3_client
from ferry.worker.models.errors import ModelSourceError, SourceUnreachableError
from ferry.worker.models.sources.listing import Listing, RemoteFile, serving_files
from ferry.worker.models.sources.node_cache import Arrived, Written
from ferry.worker.models.sources.progress import TransferProgress
from ferry.worker.models.sources.refs import ModelRef

log = logging.getLogger("ferry.worker.models")

RANGE_BYTES = 16 << 20  # one ranged GET
PARALLEL_GETS = 16  # GETs in flight at once


def list_files(ref: ModelRef) -> Listing:
    """The serving files under `ref` (one object for a .gguf key), ModelSourceError when there are none."""
    client = s3_client()
    if ref.gguf:
        head = _call(ref, client.head_object, Bucket=ref.repo, Key=ref.path)
        files = [RemoteFile(ref.path.rsplit("/", 1)[-1], ref.path, head["ContentLength"], etag=head["ETag"])]
    else:
        prefix = ref.path if not ref.path or ref.path.endswith("/") else ref.path + "/"
        objects = {}
        for page in _call(ref, lambda: list(client.get_paginator("list_objects_v2").paginate(Bucket=ref.repo,
                                                                                            Prefix=prefix))):
            for obj in page.get("Contents", []):
                objects[obj["Key"][len(prefix):]] = obj
        names = serving_files(list(objects))
        if not names:
            found = "nothing" if not objects else f"{len(objects)} objects, no config.json + weights or one .gguf"
            raise ModelSourceError(f"{ref.text}: no model under s3://{ref.repo}/{prefix} ({found})")
        files = [RemoteFile(n, prefix + n, objects[n]["Size"], etag=objects[n]["ETag"]) for n in names]
    version = hashlib.sha256("\n".join(f"{f.key} {f.size} {f.etag}" for f in files).encode()).hexdigest()
    return Listing(ref, version, tuple(files))


def download(listing: Listing, directory: Path, progress: TransferProgress, arrived: Arrived,
             written: Written | None = None) -> None:
    """Every file of `listing` into `directory`, by parallel ranged GETs in the listing's order;
    `written(file, start, end)` as each piece of a range is written (a loader reads the tensors
    in it: sources/arriving.py), `arrived(file)` once a file's last range is."""
    ref = listing.ref
    client = s3_client(max_connections=PARALLEL_GETS)
    ranges, left, lock = [], {}, threading.Lock()  # left: file name -> its ranges not yet written
    for file in listing.files:
        path = directory / file.name
        with path.open("wb") as f:
            f.truncate(file.size)
        starts = range(0, file.size, RANGE_BYTES)
        ranges += [(file, path, start, min(start + RANGE_BYTES, file.size)) for start in starts]
        left[file.name] = len(starts)
        if not starts:
            arrived(file)  # empty: whole already

    def get(job) -> None:
        file, path, start, end = job
        progress.advance(0)  # raises once the download is cancelled: no GET for the ranges left
        got = _call(ref, _get_range, client, ref.repo, file, path, start, end, progress,
                    (lambda a, b: written(file, a, b)) if written is not None else None)
        if got != end - start:
            raise ModelSourceError(f"{ref.text}: {file.key} is truncated: a ranged GET of bytes {start}-{end - 1} "
                                   f"returned {got} bytes")
        with lock:
            left[file.name] -= 1
            whole = left[file.name] == 0
        if whole:
            arrived(file)

    with ThreadPoolExecutor(PARALLEL_GETS, thread_name_prefix="s3-get") as pool:
        for _ in pool.map(get, ranges):
            pass
    log.info("S3 GET throughput for %s: %.1f MB/s (%d ranged GETs of up to %d MiB, %d in parallel)", ref.text,
             progress.rate / 1e6, len(ranges), RANGE_BYTES >> 20, PARALLEL_GETS,
             extra={"model": ref.text, "bytes_per_s": round(progress.rate), "gets": len(ranges)})


def _get_range(client, bucket: str, file: RemoteFile, path: Path, start: int, end: int,
               progress: TransferProgress, written=None) -> int:
    """GET bytes [start, end) of `file` (of its ETag only) into `path` at the same offset; the bytes
    written. `written(a, b)` after each piece [a, b) is on disk."""
    body = client.get_object(Bucket=bucket, Key=file.key, Range=f"bytes={start}-{end - 1}", IfMatch=file.etag)["Body"]
    fd = os.open(path, os.O_WRONLY)
    try:
        offset = start
        for chunk in body.iter_chunks(1 << 20):
            os.pwrite(fd, chunk, offset)
            if written is not None:
                written(offset, offset + len(chunk))
            offset += len(chunk)
            progress.advance(len(chunk))
    finally:
        os.close(fd)
        body.close()
    return offset - start


def _call(ref: ModelRef, fn, *args, **kwargs):
    """`fn` with boto3's errors turned into one ModelSourceError that names the reference and the cause."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        IncompleteReadError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    try:
        return fn(*args, **kwargs)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code"))
        cause = {
            "NoSuchBucket": f"the bucket {ref.repo!r} does not exist",
            "NoSuchKey": f"no object {ref.path!r} in the bucket {ref.repo!r}",
            "404": f"no object {ref.path!r} in the bucket {ref.repo!r}",
            "AccessDenied": "access denied: the worker needs s3:ListBucket and s3:GetObject on it",
            "403": "access denied: the worker needs s3:ListBucket and s3:GetObject on it",
            "InvalidAccessKeyId": "the AWS access key is not valid",
            "SignatureDoesNotMatch": "the AWS secret key does not match the access key",
            "PreconditionFailed": "an object changed during the download (its ETag no longer matches)",
            "412": "an object changed during the download (its ETag no longer matches)",
        }.get(code, f"S3 error {code} {error.get('Message', '')}".rstrip())
        raise ModelSourceError(f"{ref.text}: {cause}") from None
    except (NoCredentialsError, PartialCredentialsError):
        raise ModelSourceError(f"{ref.text}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                               "a profile or an instance role)") from None
    except (IncompleteReadError, ResponseStreamingError, ReadTimeoutError) as exc:
        raise ModelSourceError(f"{ref.text}: a download broke off (truncated object): {exc}") from None
    except (EndpointConnectionError, BotoConnectionError) as exc:
        raise SourceUnreachableError(f"{ref.text}: the S3 endpoint is unreachable: {exc}") from None
