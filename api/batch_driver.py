"""The batch driver: a background task of every API process that moves batches along.

Each active batch (`Keys.active_batches`) is driven by one process at a time, the holder of its
lease (`Keys.batch_lease`, a random token per process, renewed every tick, taken over when it
lapses). Every write of the driver is one `lua.BATCH_FENCED` call that checks the lease first, so
a driver that stalled past its lease writes nothing. All of a batch's state is in Redis; a driver
holds only an open reader of the input file, which a new driver re-opens at the cursor.

One tick of an `in_progress` batch:
1. enqueue input lines while fewer than `batch_backlog` of its jobs are in flight (bounded
   backlog), each with the idempotency key `batch:{id}:{line}`: a driver killed between the
   enqueue and the cursor write re-enqueues the same job, never a second one;
2. collect finished jobs: their output and error lines go to a new part object named by the
   part number and the driver's token, then one fenced write commits the part, drops the lines
   from the in-flight hash and counts them. A part written but not committed is written again
   under the next driver's token; only committed parts are read. So each line lands in exactly
   one committed part: no loss, no duplicate;
3. when the cursor is at the end and nothing is in flight, or the window has passed, or a cancel
   came: `finalizing`, where the committed parts are concatenated into the output and error files
   (fixed ids derived from the batch id: finalizing again writes the same files), then the
   final status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import anyio

from ferry.api.batches import (
    FINAL,
    MAX_REPORTED_ERRORS,
    STATUS_TIMES,
    LineError,
    batch_json,
    output_line,
    parse_line,
    read_lines,
    unanswered_line,
)
from ferry.api.errors import ApiError
from ferry.api.files import Upload, get_record, store_upload
from ferry.api.joblist import index_job
from ferry.api.ratelimit import RateLimited, admit, estimate_tokens
from ferry.api.services import Services, cancel_job
from ferry.worker.common.objectstore import ObjectStore
from ferry.worker.protocol import TERMINAL_STATES, JobRecord, UnreadableRecord, enqueue_job_async, lua, new_job_id_for
from ferry.worker.protocol.codec import text

log = logging.getLogger("ferry.api.batches")

_RENEW_EVERY_LINES = 512  # validation renews the lease this often (a large file takes a while)
# Between two ticks that both moved lines. Each tick reads the state of every line in flight (up
# to batch_backlog): 50 ms keeps that a few thousand commands/s, and a backlog lasts far longer.
_BUSY_PAUSE_S = 0.05


class Fenced(Exception):
    """The batch's lease is no longer this driver's: another process drives it now."""


class _Reader:
    """An open read of a batch's input file, positioned after line `cursor`."""

    def __init__(self, lines: AsyncIterator[tuple[int, bytes]], cursor: int) -> None:
        self.lines, self.cursor = lines, cursor
        self.exhausted = False
        self.held: list[tuple[int, bytes]] = []  # taken from the file, not yet enqueued

    def hold(self, lines: list[tuple[int, bytes]]) -> None:
        """Keep lines taken but not enqueued (over the rate limit), in order, for the next `take`."""
        self.held = lines + self.held

    async def take(self, n: int) -> list[tuple[int, bytes]]:
        out, self.held = self.held[:n], self.held[n:]
        while len(out) < n and not self.exhausted:
            try:
                number, raw = await anext(self.lines)
            except StopAsyncIteration:
                self.exhausted = True
                break
            if number > self.cursor:
                out.append((number, raw))
        return out


class BatchDriver:
    def __init__(self, svc: Services, store: ObjectStore) -> None:
        self.svc, self.store = svc, store
        self.redis, self.keys, self.settings = svc.redis, svc.keys, svc.settings
        self.token = uuid.uuid4().hex
        self.readers: dict[str, _Reader] = {}
        self._fenced = self.redis.register_script(lua.BATCH_FENCED)
        self._renew = self.redis.register_script(lua.BATCH_RENEW)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-driver")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            busy = False
            try:
                busy = await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis or the store away: try again next tick, drive nothing meanwhile
                log.warning("batch driver tick failed", exc_info=True)
            # A tick that moved lines is followed at once by the next (a fast model drains a
            # backlog between two polls); an idle one waits the poll interval.
            await asyncio.sleep(_BUSY_PAUSE_S if busy else self.settings.batch_poll_s)

    async def tick(self) -> bool:
        """Advance every batch this process holds the lease of; True when some line moved."""
        busy = False
        for batch_id in sorted(await self.redis.smembers(self.keys.active_batches)):
            if not await self._hold(batch_id):
                self.readers.pop(batch_id, None)
                continue
            try:
                busy |= await self._advance(batch_id)
            except Fenced:
                self.readers.pop(batch_id, None)
            except ApiError as exc:  # the input file was deleted under the batch: nothing more can run
                self.readers.pop(batch_id, None)
                await self._fail(batch_id, exc)
        return busy

    async def _fail(self, batch_id: str, exc: ApiError) -> None:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        fields = {"errors": json.dumps([{"code": exc.code, "message": exc.message, "param": "input_file_id",
                                         "line": None}])}
        await self._announce(batch_id, raw, "failed", fields)
        await self._set_status(batch_id, "failed", **fields)
        await self.redis.srem(self.keys.active_batches, batch_id)

    # --- lease and fenced writes -------------------------------------------------------------------

    async def _hold(self, batch_id: str) -> bool:
        lease, ms = self.keys.batch_lease(batch_id), int(self.settings.batch_lease_s * 1000)
        if await self.redis.set(lease, self.token, nx=True, px=ms):
            return True
        return bool(await self._renew(keys=[lease], args=[self.token, ms]))

    async def _write(self, batch_id: str, writes: list[list]) -> None:
        """Apply `writes` ([command, key, args...], key one of "batch", "inflight", "parts") if the lease is ours."""
        names = {"batch": self.keys.batch(batch_id), "inflight": self.keys.batch_inflight(batch_id),
                 "parts": self.keys.batch_parts(batch_id)}
        order = list(names)
        encoded = [[w[0], order.index(w[1]) + 1, *map(str, w[2:])] for w in writes]
        keys = [self.keys.batch_lease(batch_id), *names.values()]
        if not await self._fenced(keys=keys, args=[self.token, json.dumps(encoded)]):
            raise Fenced(batch_id)

    async def _set_status(self, batch_id: str, status: str, **fields) -> None:
        pairs = [status_field for item in {"status": status, STATUS_TIMES[status]: time.time(), **fields}.items()
                 for status_field in item]
        await self._write(batch_id, [["HSET", "batch", *pairs]])

    # --- the state machine -------------------------------------------------------------------------

    async def _advance(self, batch_id: str) -> bool:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        status = raw.get("status")
        if not raw or status in FINAL:
            await self.redis.srem(self.keys.active_batches, batch_id)
            return False
        if status == "validating":
            await self._validate(batch_id, raw)
        elif status == "finalizing":
            await self._finalize(batch_id, raw)
        else:
            return await self._run_lines(batch_id, raw)
        return True

    async def _validate(self, batch_id: str, raw: dict) -> None:
        input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
        errors: list[dict] = []
        seen: set[str] = set()
        total = last = 0
        async for number, line in read_lines(self.store, input_file.object_name):
            last = number
            total += 1
            try:
                parsed = await parse_line(self.svc, raw["tenant"], batch_id, raw["endpoint"], number, line, 1.0)
                if parsed.custom_id in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {parsed.custom_id!r} is on an earlier line",
                                    "custom_id")
                seen.add(parsed.custom_id)
            except LineError as exc:
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(exc.to_json(number))
            if total % _RENEW_EVERY_LINES == 0 and not await self._hold(batch_id):
                raise Fenced(batch_id)
        if total == 0:
            errors.append(LineError("empty_file", "the input file has no request lines").to_json(1))
        if errors:
            fields = {"errors": json.dumps(errors), "total": total}
            await self._announce(batch_id, raw, "failed", fields)
            await self._set_status(batch_id, "failed", **fields)
            await self.redis.srem(self.keys.active_batches, batch_id)
        else:
            await self._set_status(batch_id, "in_progress", total=total, last_line=last, cursor=0)

    async def _run_lines(self, batch_id: str, raw: dict) -> bool:
        ending = "cancelled" if raw.get("cancel_requested") else (
            "expired" if time.time() >= float(raw["expires_at"]) else None)
        inflight = {int(n): json.loads(v) for n, v in (await self.redis.hgetall(self.keys.batch_inflight(batch_id))
                                                       ).items()}
        # No cursor yet: cancelled before its validation began (nothing to run, nothing to write).
        cursor, last = int(raw.get("cursor", 0)), int(raw.get("last_line", 0))
        enqueued_before = cursor
        if ending is None and cursor < last and len(inflight) < self.settings.batch_backlog:
            cursor = await self._enqueue(batch_id, raw, inflight, cursor)
        finished = await self._finished(inflight, cancel=ending is not None)
        out_lines: list[str] = []
        err_lines: list[str] = []
        counts = {"completed": 0, "failed": 0}
        for number in sorted(finished):
            job_id, custom_id, chat = inflight.pop(number)
            ok, line = output_line(finished[number], custom_id, chat, _echo(finished[number]))
            (out_lines if ok else err_lines).append(line)
            counts["completed" if ok else "failed"] += 1
        done = not inflight and (ending is not None or cursor >= last)
        if done and ending == "expired":
            for line in await self._unanswered(raw, cursor):
                err_lines.append(line)
                counts["failed"] += 1
        if out_lines or err_lines:
            await self._commit_part(batch_id, raw, out_lines, err_lines, list(finished), counts)
        if done:
            self.readers.pop(batch_id, None)
            await self._set_status(batch_id, "finalizing", outcome=ending or "completed")
        return done or bool(finished) or cursor != enqueued_before

    async def _enqueue(self, batch_id: str, raw: dict, inflight: dict, cursor: int) -> int:
        reader = self.readers.get(batch_id)
        if reader is None or reader.cursor != cursor:
            input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
            reader = self.readers[batch_id] = _Reader(read_lines(self.store, input_file.object_name), cursor)
        ttl_s = float(raw["expires_at"]) - time.time()
        added: dict[int, list] = {}
        failed: list[str] = []
        taken = await reader.take(self.settings.batch_backlog - len(inflight))
        for index, (number, line) in enumerate(taken):
            try:
                parsed = await parse_line(self.svc, raw["tenant"], batch_id, raw["endpoint"], number, line, ttl_s)
                tokens = await estimate_tokens(self.svc, parsed.job)
                admission = await admit(self.svc, raw["tenant"], "batch", tokens)
            except LineError as exc:  # valid at validation, not now (say, the model is no longer served)
                reader.cursor = number
                failed.append(unanswered_line(json.loads(line).get("custom_id", ""), exc.code, exc.message))
                continue
            except RateLimited as exc:
                if not exc.too_large:  # over the batch budget for now: this line and the rest go first next tick
                    reader.hold(taken[index:])
                    break
                reader.cursor = number  # larger than the whole budget: it can never run
                failed.append(unanswered_line(parsed.custom_id, exc.code, exc.message))
                continue
            reader.cursor = number
            line_key = f"batch:{batch_id}:{number}"
            job_id = new_job_id_for(self.keys, parsed.job, line_key)
            await index_job(self.redis, self.keys, self.settings, parsed.job.tenant, job_id)
            result = await enqueue_job_async(
                self.redis, self.keys, parsed.job, job_id=job_id, idempotency_key=line_key,
                idempotency_ttl_s=int(ttl_s) + 86400, batch_line=(batch_id, parsed.custom_id),
                reservation=(admission.budget, tokens) if admission.budget else None)
            added[number] = [result.job_id, parsed.custom_id, raw["endpoint"] == "/v1/chat/completions"]
        if reader.exhausted and not reader.held:
            reader.cursor = int(raw["last_line"])
        writes = [["HSET", "batch", "cursor", reader.cursor]]
        if added:
            writes.append(["HSET", "inflight", *[x for n, v in added.items() for x in (n, json.dumps(v))]])
        # Lines that failed here are a part of their own, committed with the cursor: counted exactly once.
        await self._commit_part(batch_id, raw, [], failed, [], {"failed": len(failed)}, extra=writes)
        inflight.update(added)
        return reader.cursor

    async def _finished(self, inflight: dict, cancel: bool) -> dict[int, JobRecord]:
        """The in-flight lines whose jobs ended, with their records. Each tick looks at every line
        in flight (up to `batch_backlog`), so it reads only the state first and the whole record
        (its request and result, parsed) only of the jobs that ended: the driver shares its event
        loop and Redis with live traffic."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _, _ in inflight.values():
            pipe.hmget(self.keys.job(job_id), "state", "cancel")
        ended: list[int] = []
        for number, (state, cancelled) in zip(inflight, await pipe.execute(), strict=True):
            if state is None:
                continue  # not yet visible, or lost with a Redis restart: the job's TTL ends it
            if text(state) in TERMINAL_STATES:
                ended.append(number)
            elif cancel and text(cancelled or "") != "1":
                await cancel_job(self.svc, inflight[number][0])
        pipe = self.redis.pipeline(transaction=False)
        for number in ended:
            pipe.hgetall(self.keys.job(inflight[number][0]))
        finished: dict[int, JobRecord] = {}
        for number, fields in zip(ended, await pipe.execute() if ended else [], strict=True):
            try:
                record = JobRecord.from_redis(fields)
            except UnreadableRecord:
                record = None
            if record is not None and record.terminal:
                finished[number] = record
        return finished

    async def _unanswered(self, raw: dict, cursor: int) -> list[str]:
        """Error lines for the lines never enqueued (an expired batch's rest)."""
        input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
        out = []
        async for number, line in read_lines(self.store, input_file.object_name):
            if number > cursor:
                out.append(unanswered_line(json.loads(line)["custom_id"], "batch_expired",
                                           "this request could not be executed before the completion window expired"))
        return out

    async def _commit_part(self, batch_id: str, raw: dict, out_lines: list[str], err_lines: list[str],
                           done_lines: list[int], counts: dict[str, int], extra: list | None = None) -> None:
        if not out_lines and not err_lines:
            await self._write(batch_id, extra or [])
            return
        seq = int(raw.get("part_count", 0))
        names = {}
        for kind, lines in (("out", out_lines), ("err", err_lines)):
            if lines:
                names[kind] = f"batches/{batch_id}/parts/{seq:08d}-{self.token}.{kind}.jsonl"
                await anyio.to_thread.run_sync(self._write_object, names[kind], lines)
        writes = [*(extra or []), ["HSET", "parts", seq, json.dumps(names)], ["HINCRBY", "batch", "part_count", 1]]
        writes += [["HINCRBY", "batch", name, n] for name, n in counts.items() if n]
        if done_lines:
            writes.append(["HDEL", "inflight", *done_lines])
        await self._write(batch_id, writes)
        raw["part_count"] = str(seq + 1)

    def _write_object(self, name: str, lines: list[str]) -> None:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".jsonl") as tmp:
            tmp.writelines(lines)
            tmp.flush()
            self.store.upload(name, Path(tmp.name))

    async def _finalize(self, batch_id: str, raw: dict) -> None:
        parts = await self.redis.hgetall(self.keys.batch_parts(batch_id))
        ordered = [json.loads(parts[k]) for k in sorted(parts, key=int)]
        file_ids = {}
        for kind, suffix, field in (("out", "output", "output_file_id"), ("err", "errors", "error_file_id")):
            names = [p[kind] for p in ordered if kind in p]
            if names:
                file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
                await self._concatenate(raw["tenant"], file_id, f"{batch_id}_{suffix}.jsonl", names)
                file_ids[field] = file_id
        outcome = raw.get("outcome", "completed")
        if raw.get("cancel_requested"):
            outcome = "cancelled"
        await self._announce(batch_id, raw, outcome, file_ids)
        await self._set_status(batch_id, outcome, **file_ids)
        await self.redis.srem(self.keys.active_batches, batch_id)
        leftovers = await anyio.to_thread.run_sync(self.store.list, f"batches/{batch_id}/")
        await anyio.to_thread.run_sync(self.store.delete, leftovers)

    async def _announce(self, batch_id: str, raw: dict, status: str, fields: dict) -> None:
        """Put the `batch.<status>` webhook in the outbox (before the status is written: a driver
        killed in between announces again under the same webhook id, never not at all)."""
        if not raw.get("webhook_url"):
            return
        now = time.time()
        final = {**raw, **{k: str(v) for k, v in fields.items()}, "status": status, STATUS_TIMES[status]: str(now)}
        event = f"batch.{status}"
        stamp = datetime.fromtimestamp(now, UTC).isoformat().replace("+00:00", "Z")
        body = json.dumps({"type": event, "timestamp": stamp, "data": batch_json(final)}, separators=(",", ":"))
        await self.redis.xadd(self.keys.webhook_outbox, {"webhook_id": f"msg_{batch_id}_{status}", "job_id": batch_id,
                                                         "event": event, "url": raw["webhook_url"], "body": body,
                                                         "tenant": raw["tenant"]})

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


def _echo(record: JobRecord) -> str:
    request = record.request
    echoed = request is not None and request.metadata.get("echo")
    return request.prompt if echoed and isinstance(request.prompt, str) else ""
