"""What a batch hands back: its answered lines, as parts and then as the output and error files,
and the `batch.<status>` webhook of its end.

Answered lines go to a new part object named by the part number and the driver's token, then one
fenced write commits the part (with whatever else the driver writes along: the lines dropped from
the in-flight hash, their counts, the cursor). A part written but not committed is written again
under the next driver's token; only committed parts are read. So each line lands in exactly one
committed part: no loss, no duplicate. At the end the committed parts are concatenated into the
output and error files, whose ids derive from the batch id: writing them again writes the same files.
"""

from __future__ import annotations

import json
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio

from ferry.api.batch_lease import BatchLease
from ferry.api.batches import STATUS_TIMES, batch_json
from ferry.api.files import Upload, store_upload
from ferry.api.services import Services
from ferry.worker.common.objectstore import ObjectStore


class BatchOutput:
    """The parts, files and webhooks of the batches this process holds (its writes fenced by `lease`)."""

    def __init__(self, svc: Services, store: ObjectStore, lease: BatchLease) -> None:
        self.redis, self.keys, self.settings = svc.redis, svc.keys, svc.settings
        self.store, self.lease = store, lease

    async def commit_part(self, batch_id: str, raw: dict, out_lines: list[str], err_lines: list[str],
                          done_lines: list[int], counts: dict[str, int], extra: list | None = None) -> None:
        """Write the answered lines as a new part and commit it in one fenced write with `extra`, the
        lines `done_lines` dropped from the in-flight hash and `counts` added (only `extra`: no lines)."""
        if not out_lines and not err_lines:
            await self.lease.write(batch_id, extra or [])
            return
        seq = int(raw.get("part_count", 0))
        names = {}
        for kind, lines in (("out", out_lines), ("err", err_lines)):
            if lines:
                names[kind] = f"batches/{batch_id}/parts/{seq:08d}-{self.lease.token}.{kind}.jsonl"
                await anyio.to_thread.run_sync(self._write_object, names[kind], lines)
        writes = [*(extra or []), ["HSET", "parts", seq, json.dumps(names)], ["HINCRBY", "batch", "part_count", 1]]
        writes += [["HINCRBY", "batch", name, n] for name, n in counts.items() if n]
        if done_lines:
            writes.append(["HDEL", "inflight", *done_lines])
        await self.lease.write(batch_id, writes)
        raw["part_count"] = str(seq + 1)

    def _write_object(self, name: str, lines: list[str]) -> None:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".jsonl") as tmp:
            tmp.writelines(lines)
            tmp.flush()
            self.store.upload(name, Path(tmp.name))

    async def write_files(self, batch_id: str, raw: dict) -> dict[str, str]:
        """Concatenate the committed parts into the output and error files: their ids by field."""
        parts = await self.redis.hgetall(self.keys.batch_parts(batch_id))
        ordered = [json.loads(parts[k]) for k in sorted(parts, key=int)]
        file_ids = {}
        for kind, suffix, name in (("out", "output", "output_file_id"), ("err", "errors", "error_file_id")):
            names = [p[kind] for p in ordered if kind in p]
            if names:
                file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
                await self._concatenate(raw["tenant"], file_id, f"{batch_id}_{suffix}.jsonl", names)
                file_ids[name] = file_id
        return file_ids

    async def delete_parts(self, batch_id: str) -> None:
        leftovers = await anyio.to_thread.run_sync(self.store.list, f"batches/{batch_id}/")
        await anyio.to_thread.run_sync(self.store.delete, leftovers)

    async def announce(self, batch_id: str, raw: dict, status: str, fields: dict) -> None:
        """Put the `batch.<status>` webhook in the outbox (before the status is written: a driver
        killed in between announces again under the same webhook id, never not at all)."""
        if not raw.get("webhook_url"):
            return
        now = time.time()
        final = {**raw, **{k: str(v) for k, v in fields.items()}, "status": status, STATUS_TIMES[status]: str(now)}
        event = f"batch.{status}"
        stamp = datetime.fromtimestamp(now, UTC).isoformat().replace("+00:00", "Z")
        body = json.dumps({"type": event, "timestamp": stamp, "data": batch_json(final)}, separators=(",", ":"))
        # Its delivery attempts join the batch's trace (the batch keeps its request's context: api.tracing).
        await self.redis.xadd(self.keys.webhook_outbox, {"webhook_id": f"msg_{batch_id}_{status}", "job_id": batch_id,
                                                         "event": event, "url": raw["webhook_url"], "body": body,
                                                         "tenant": raw["tenant"],
                                                         "traceparent": raw.get("traceparent", "")})

    async def _concatenate(self, tenant: str, file_id: str, filename: str, names: list[str]) -> None:
        directory = Path(self.settings.upload_dir)
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=directory, suffix=".jsonl") as tmp:
            size = await anyio.to_thread.run_sync(self._copy_parts, names, tmp)
            upload = Upload(purpose="batch_output", filename=filename, path=Path(tmp.name), size=size)
            await store_upload(self.redis, self.keys, self.store, tenant, upload, "batch_output", file_id=file_id)

    def _copy_parts(self, names: list[str], out) -> int:
        size = 0
        for name in names:
            for chunk in self.store.read_chunks(name):
                out.write(chunk)
                size += len(chunk)
        out.flush()
        return size
