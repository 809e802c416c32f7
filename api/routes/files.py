"""OpenAI's Files API, for batch input and output: upload, look up, download, list, delete."""

from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse

from ferry.api.auth import tenant
from ferry.api.errors import ApiError
from ferry.api.files import (
    FILE_ID_PATTERN,
    delete_file,
    get_record,
    list_body,
    list_records,
    receive_upload,
    store_upload,
    stream_content,
)
from ferry.api.schemas import error_responses
from ferry.api.services import Services, services
from ferry.worker.common.objectstore import ObjectStore

router = APIRouter(prefix="/v1/files", tags=["files"])

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]
FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN)]


async def file_store(request: Request) -> ObjectStore:
    return request.app.state.files_store


Store = Annotated[ObjectStore, Depends(file_store)]


@router.post("", responses=error_responses(401, 413, 422, 503), summary="Upload a JSONL file (purpose=batch)")
async def upload(request: Request, svc: Svc, store: Store, tenant_name: Tenant) -> dict:
    upload = await receive_upload(request, svc.settings.max_file_bytes, FsPath(svc.settings.upload_dir))
    try:
        if upload.purpose != "batch":
            raise ApiError(422, "invalid_request", f"purpose: {upload.purpose!r} is not supported; use 'batch'",
                           field="purpose")
        record = await store_upload(svc.redis, svc.keys, store, tenant_name, upload, "batch")
    finally:
        upload.path.unlink(missing_ok=True)
    return record.to_openai()


@router.get("", responses=error_responses(401), summary="The caller's files, newest first")
async def list_files(svc: Svc, tenant_name: Tenant, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, purpose: str | None = None) -> dict:
    records, has_more = await list_records(svc.redis, svc.keys, tenant_name, after, limit, purpose)
    return list_body(records, has_more)


@router.get("/{file_id}", responses=error_responses(401, 404), summary="A file's record")
async def retrieve(file_id: FileId, svc: Svc, tenant_name: Tenant) -> dict:
    return (await get_record(svc.redis, svc.keys, file_id, tenant_name)).to_openai()


@router.get("/{file_id}/content", responses=error_responses(401, 404, 503), summary="A file's bytes (streamed)")
async def content(file_id: FileId, svc: Svc, store: Store, tenant_name: Tenant) -> StreamingResponse:
    record = await get_record(svc.redis, svc.keys, file_id, tenant_name)
    return StreamingResponse(await stream_content(store, record), media_type="application/jsonl",
                             headers={"Content-Length": str(record.bytes)})


@router.delete("/{file_id}", responses=error_responses(401, 404), summary="Delete a file")
async def delete(file_id: FileId, svc: Svc, store: Store, tenant_name: Tenant) -> dict:
    record = await get_record(svc.redis, svc.keys, file_id, tenant_name)
    await delete_file(svc.redis, svc.keys, store, record)
    return {"id": file_id, "object": "file", "deleted": True}
