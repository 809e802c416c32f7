"""Batch API files: records in Redis, bytes in an object store (`FERRY_FILES_URL`, `file://` or `s3://`).

A file's bytes never sit whole in memory: an upload is parsed as it streams in (multipart, one
chunk at a time) into a local temporary file, checked against `max_file_bytes` on the way, then
handed to the store; a download streams the store's chunks out. The record (`Keys.file`) says
whose the file is: another tenant's file id is a 404, as if it did not exist.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
from python_multipart.multipart import MultipartParser, parse_options_header
from redis.exceptions import RedisError
from starlette.concurrency import iterate_in_threadpool
from starlette.requests import Request

from ferry.api.errors import ApiError, not_found
from ferry.worker.common.objectstore import ObjectStore, StoreError
from ferry.worker.protocol import Keys
from ferry.worker.protocol.keys import tenant_tag

log = logging.getLogger("ferry.api.files")

FILE_ID_PATTERN = r"^file-[0-9a-f]{32}(-(output|errors))?$"
PURPOSES = ("batch", "batch_output")  # what a client may upload, and what Ferry writes


@dataclass(slots=True)
class FileRecord:
    """One stored file, in OpenAI's `file` object shape (plus where its bytes are and whose it is)."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object_name: str  # the name in the store

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def object_name(tenant: str, file_id: str) -> str:
    return f"files/{tenant_tag(tenant)}/{file_id}.jsonl"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


async def save_record(redis, keys: Keys, record: FileRecord) -> None:
    """The record, last: the tenant's index first (a listing skips an id without a record), so the
    file exists once its record does."""
    await redis.zadd(keys.tenant_files(record.tenant), {record.id: record.created_at})
    await redis.hset(keys.file(record.id), mapping={k: str(v) for k, v in asdict(record).items()})


async def get_record(redis, keys: Keys, file_id: str, tenant: str) -> FileRecord:
    raw = await redis.hgetall(keys.file(file_id))
    if not raw or raw.get("tenant") != tenant:
        raise not_found("file", file_id)
    return FileRecord(**{**raw, "bytes": int(raw["bytes"]), "created_at": int(raw["created_at"])})


async def list_records(redis, keys: Keys, tenant: str, after: str | None, limit: int, purpose: str | None
                       ) -> tuple[list[FileRecord], bool]:
    """The tenant's files, newest first, from after the file `after`; and whether there are more."""
    ids = await redis.zrevrange(keys.tenant_files(tenant), 0, -1)
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    records: list[FileRecord] = []
    for file_id in ids:
        try:
            record = await get_record(redis, keys, file_id, tenant)
        except ApiError:
            continue  # deleted between the two reads
        if purpose is None or record.purpose == purpose:
            records.append(record)
        if len(records) > limit:
            break
    return records[:limit], len(records) > limit


async def delete_file(redis, keys: Keys, store: ObjectStore, record: FileRecord) -> None:
    await redis.delete(keys.file(record.id))
    await redis.zrem(keys.tenant_files(record.tenant), record.id)
    await anyio.to_thread.run_sync(store.delete, [record.object_name])


async def stream_content(store: ObjectStore, record: FileRecord) -> AsyncIterator[bytes]:
    """The file's bytes chunk by chunk (the store's reads run in worker threads, the first too: on
    S3 it is a request)."""
    try:
        chunks: Iterator[bytes] = await anyio.to_thread.run_sync(store.read_chunks, record.object_name)
    except StoreError as exc:
        raise ApiError(503, "file_store_unavailable", f"file {record.id!r}: {exc}") from exc
    return iterate_in_threadpool(chunks)


@dataclass(slots=True)
class Upload:
    purpose: str | None
    filename: str | None
    path: Path | None  # the file part's bytes, in a local temporary file
    size: int


async def receive_upload(request: Request, max_bytes: int, directory: Path) -> Upload:
    """Parse a multipart/form-data body (`purpose`, `file`) as it arrives; the file part goes to a
    temporary file under `directory`. 413 past `max_bytes` of file, 422 for a malformed form."""
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(422, "invalid_request", "upload a multipart/form-data body with `purpose` and `file`")
    form = _FormSink(directory, max_bytes)
    parser = MultipartParser(boundary, form.callbacks())
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if form.too_large:
                raise ApiError(413, "file_too_large", f"file: over the {max_bytes}-byte limit", field="file")
        parser.finalize()
    except BaseException:
        form.discard()
        raise
    if form.path is None:
        raise ApiError(422, "invalid_request", "file: required", field="file")
    return Upload(form.fields.get("purpose"), form.filename, form.path, form.size)


class _FormSink:
    """The parser's callbacks: small fields into memory, the `file` part into a temporary file."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.path: Path | None = None
        self.size = 0
        self.too_large = False
        self._header_name = b""
        self._header_value = b""
        self._name: str | None = None
        self._value = bytearray()
        self._out = None

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._hvalue,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
                "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._name, self._value = None, bytearray()

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            _, options = parse_options_header(self._header_value)
            self._name = options.get(b"name", b"").decode()
            if b"filename" in options:
                self.filename = options[b"filename"].decode(errors="replace")
        self._header_name, self._header_value = b"", b""

    def _headers_done(self) -> None:
        if self._name == "file":
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="upload-", dir=self.directory)
            self.path = Path(name)
            self._out = open(fd, "wb")  # noqa: SIM115 (closed at the part's end or by discard)

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._out is not None:
            self.size += end - start
            if self.size > self.max_bytes:
                self.too_large = True
                return
            self._out.write(data[start:end])
        elif len(self._value) < 4096:  # a form field (purpose): small by nature
            self._value += data[start:end]

    def _end(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        elif self._name:
            self.fields[self._name] = self._value.decode(errors="replace")

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


async def store_upload(redis, keys: Keys, store: ObjectStore, tenant: str, upload: Upload, purpose: str,
                       file_id: str | None = None) -> FileRecord:
    """Put an uploaded (or driver-written) local file in the store and record it. An upload that is
    not recorded (Redis full or away: a 503; the client gone) leaves nothing behind in the store."""
    file_id = file_id or new_file_id()
    record = FileRecord(id=file_id, tenant=tenant, bytes=upload.size, created_at=int(time.time()),
                        filename=upload.filename or f"{file_id}.jsonl", purpose=purpose,
                        object_name=object_name(tenant, file_id))
    committed = False
    try:
        try:
            await anyio.to_thread.run_sync(store.upload, record.object_name, upload.path)
        except StoreError as exc:
            raise ApiError(503, "file_store_unavailable", f"cannot store the file: {exc}") from exc
        await save_record(redis, keys, record)
        committed = True
    finally:
        if not committed:
            with anyio.CancelScope(shield=True):
                await _discard(redis, keys, store, record)
    return record


async def _discard(redis, keys: Keys, store: ObjectStore, record: FileRecord) -> None:
    """Undo what an upload that failed may have written; what cannot be undone now is logged."""
    try:
        await anyio.to_thread.run_sync(store.delete, [record.object_name])
    except StoreError as exc:
        log.warning("file %s: an upload that failed left %s in the store: %s", record.id, record.object_name, exc)
    try:
        await redis.delete(keys.file(record.id))
        await redis.zrem(keys.tenant_files(record.tenant), record.id)
    except (RedisError, OSError) as exc:  # listings skip an index entry without a record; a record left names no object
        log.warning("file %s: an upload that failed may have left its record: %s", record.id, exc)


def list_body(records: list[FileRecord], has_more: bool) -> dict:
    data = [r.to_openai() for r in records]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


__all__ = ["FILE_ID_PATTERN", "PURPOSES", "FileRecord", "Upload", "delete_file", "get_record",
           "list_body", "list_records", "receive_upload", "store_upload", "stream_content"]
