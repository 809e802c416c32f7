"""Object stores: one small interface, two stores chosen by URL. Prefix-cache snapshots
(`FERRY_SNAPSHOT_URL`) and Batch API files (`FERRY_FILES_URL`) live in one.

- `file:///dir` (or a plain path): the embedded default; every write lands under a temporary
  name and is renamed into place, so a reader never sees half a file.
- `s3://bucket/prefix`: boto3, multipart transfers for large shards. Endpoint, region and
  credentials come from the standard AWS chain (env, config files, instance role);
  `FERRY_S3_ENDPOINT_URL` (or an explicit `endpoint_url`) points it at MinIO or a local server.

Names are `/`-separated paths relative to the store's root. Every failure to reach or use the
store is raised as `StoreError`; a missing object is not an error where a caller may expect it
(`read_bytes` returns None).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

Progress = Callable[[int], None]  # called with the number of bytes just transferred

_COPY_CHUNK = 8 << 20


class StoreError(RuntimeError):
    """The store could not be reached or refused an operation (network, permissions, disk)."""


class ObjectStore(Protocol):
    url: str

    def read_bytes(self, name: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    def write_bytes(self, name: str, data: bytes) -> None: ...

    def upload(self, name: str, path: Path, progress: Progress | None = None) -> None: ...

    def download(self, name: str, path: Path, progress: Progress | None = None) -> None:
        """Copy the object to the local file `path`; StoreError when it is missing."""

    def read_chunks(self, name: str) -> Iterator[bytes]:
        """The object's bytes in chunks of at most a few MiB, never all at once; StoreError when it
        is missing (raised before the first chunk)."""

    def list(self, prefix: str) -> list[str]:
        """Names of all objects under `prefix` (recursive, sorted)."""

    def delete(self, names: list[str]) -> None: ...


def open_store(url: str, endpoint_url: str | None = None) -> ObjectStore:
    """The store for `url`: `file:///dir`, a plain local path, or `s3://bucket/prefix`."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URL {url!r} names no bucket: use s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path.strip("/"), endpoint_url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"store URL {url!r}: file URLs take an absolute path, file:///dir")
        return FileStore(Path(unquote(parsed.path)))
    if parsed.scheme == "":
        return FileStore(Path(url).expanduser().resolve())
    raise ValueError(f"unsupported store URL {url!r}: use file:///dir or s3://bucket/prefix")


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def _path(self, name: str) -> Path:
        return self.root / name

    def read_bytes(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {self._path(name)}: {exc}") from exc

    def write_bytes(self, name: str, data: bytes) -> None:
        self._atomic_write(name, lambda out: out.write(data))

    def upload(self, name: str, path: Path, progress: Progress | None = None) -> None:
        self._atomic_write(name, lambda out: _copy(path, out, progress))

    def download(self, name: str, path: Path, progress: Progress | None = None) -> None:
        source = self._path(name)
        try:
            with path.open("wb") as out:
                _copy(source, out, progress)
        except FileNotFoundError as exc:
            raise StoreError(f"{source} is missing") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {source}: {exc}") from exc

    def read_chunks(self, name: str) -> Iterator[bytes]:
        source = self._path(name)
        try:
            src = source.open("rb")
        except FileNotFoundError as exc:
            raise StoreError(f"{source} is missing") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {source}: {exc}") from exc
        return _chunks(src)

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        names = (p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())
        return sorted(n for n in names if not Path(n).name.startswith(".tmp-"))

    def delete(self, names: list[str]) -> None:
        for name in names:
            path = self._path(name)
            path.unlink(missing_ok=True)
            # Drop directories the deletion left empty, up to the store's root.
            parent = path.parent
            while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent

    def _atomic_write(self, name: str, write: Callable) -> None:
        target = self._path(name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    write(out)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise StoreError(f"cannot write {target}: {exc}") from exc


def _copy(source: Path, out, progress: Progress | None) -> None:
    with source.open("rb") as src:
        while chunk := src.read(_COPY_CHUNK):
            out.write(chunk)
            if progress is not None:
                progress(len(chunk))


def _chunks(src) -> Iterator[bytes]:
    with src:
        while chunk := src.read(_COPY_CHUNK):
            yield chunk


def s3_client(endpoint_url: str | None = None, max_connections: int = 10):
    """A boto3 S3 client on `endpoint_url`, else `FERRY_S3_ENDPOINT_URL`, else AWS; credentials
    and region from the standard chain. `max_connections`: its HTTP pool (one per parallel call)."""
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("FERRY_S3_ENDPOINT_URL") or None
    # Few, quick retries: an unreachable store must turn into a cold start, not a long hang.
    config = Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
                    max_pool_connections=max_connections)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


class S3Store:
    """`s3://bucket/prefix` through boto3; large files go up and down in parallel multipart chunks."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None = None,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 16 << 20,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.client = s3_client(endpoint_url)
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read_bytes(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self._call("read", name, self.client.get_object, Bucket=self.bucket, Key=self._key(name))[
                "Body"
            ].read()
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def write_bytes(self, name: str, data: bytes) -> None:
        self._call("write", name, self.client.put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    def upload(self, name: str, path: Path, progress: Progress | None = None) -> None:
        self._call(
            "upload", name, self.client.upload_file, str(path), self.bucket, self._key(name),
            Callback=progress, Config=self.transfer,
        )

    def download(self, name: str, path: Path, progress: Progress | None = None) -> None:
        self._call(
            "download", name, self.client.download_file, self.bucket, self._key(name), str(path),
            Callback=progress, Config=self.transfer,
        )

    def read_chunks(self, name: str) -> Iterator[bytes]:
        body = self._call("read", name, self.client.get_object, Bucket=self.bucket, Key=self._key(name))["Body"]
        return self._body_chunks(name, body)

    def _body_chunks(self, name: str, body) -> Iterator[bytes]:
        with body:
            chunks = body.iter_chunks(_COPY_CHUNK)
            while chunk := self._call("read", name, next, chunks, b""):
                yield chunk

    def list(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        strip = len(self.prefix) + 1 if self.prefix else 0
        names: list[str] = []
        self._call("list", prefix, lambda: names.extend(o["Key"][strip:] for p in pages for o in p.get("Contents", [])))
        return sorted(names)

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            objects = [{"Key": self._key(n)} for n in names[start : start + 1000]]
            self._call(
                "delete", names[start], self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": objects}
            )

    def _call(self, verb: str, name: str, fn: Callable, *args, **kwargs):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise StoreError(
                f"S3 {verb} {self.url}/{name}: {error.get('Code')} {error.get('Message', '')}".rstrip()
            ) from exc
        except (BotoCoreError, Boto3Error, OSError) as exc:
            raise StoreError(f"S3 {verb} {self.url}/{name}: {exc}") from exc


__all__ = ["FileStore", "ObjectStore", "Progress", "S3Store", "StoreError", "open_store", "s3_client"]
