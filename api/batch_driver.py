"""The batch driver: a background task of every API process that moves batches along.

Each active batch (`Keys.active_batches`) is driven by one process at a time, the holder of its
lease, and every write of the driver is fenced by that lease (`api.batch_lease`). All of a
batch's state is in Redis; a driver holds only an open reader of the input file, which a new
driver re-opens at the cursor, and the progress of a validation, which a new driver starts again
(`api.batch_input`).

`validating` advances a bounded step per tick (`_VALIDATE_GROUPS` groups of lines, read and
parsed in a thread): a large file holds neither the event loop nor the other batches, and the
lease is renewed between two steps.

One tick of an `in_progress` batch:
1. enqueue input lines (`api.batch_jobs`) while fewer than `batch_backlog` of its jobs are in
   flight (bounded backlog), each with the idempotency key `batch:{id}:{line}`: a driver killed
   between the enqueue and the cursor write re-enqueues the same job, never a second one. A line
   whose request the live route would refuse is answered with that refusal instead;
2. collect finished jobs: their output and error lines are committed as one part, which drops
   them from the in-flight hash and counts them in the same fenced write (`api.batch_output`:
   each line lands in exactly one committed part, no loss, no duplicate);
3. when the cursor is at the end and nothing is in flight, or the window has passed, or a cancel
   came: the lines never run are answered `batch_expired` / `batch_cancelled`, then
   `finalizing`, where the committed parts are concatenated into the output and error files
   (fixed ids derived from the batch id: finalizing again writes the same files), then the
   final status.

What one batch raises never stops another: each is advanced on its own. The stores being away
(Redis, the file store) is retried at the next tick; any other exception is logged, counted
(`ferry_api_batch_driver_errors_total{scope="batch"}`) and, the `_MAX_BATCH_ERRORS`-th time,
fails that batch. Within a batch, a line the driver cannot handle is answered `internal_error`
(counted with `scope="line"`) and the other lines go on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import anyio
from redis.exceptions import RedisError

from ferry.api.batch_input import InputReader, Validation, unrun_lines
from ferry.api.batch_jobs import build_jobs, ended_jobs, enqueue_line
from ferry.api.batch_lease import BatchLease, Fenced
from ferry.api.batch_output import BatchOutput
from ferry.api.batches import (
    FINAL,
    INTERNAL_ERROR,
    Envelope,
    LineError,
    Route,
    answer_line,
    read_envelopes,
    refused_line,
    route_models,
    unanswered_line,
)
from ferry.api.errors import ApiError
from ferry.api.files import get_record
from ferry.api.ratelimit import RateLimited
from ferry.api.services import Services, cancel_job
from ferry.api.tasks import cancel_and_wait
from ferry.worker.common.objectstore import ObjectStore, StoreError

log = logging.getLogger("ferry.api.batches")

# Between two ticks that both moved lines. Each tick reads the state of every line in flight (up
# to batch_backlog): 50 ms keeps that a few thousand commands/s, and a backlog lasts far longer.
_BUSY_PAUSE_S = 0.05
_VALIDATE_GROUPS = 8  # groups of input lines (api.batches) one tick validates of one batch
_MAX_BATCH_ERRORS = 5  # unexpected exceptions on one batch before it is failed
# The stores being away: the tick is retried, and no batch is blamed for it.
_TRANSIENT = (RedisError, OSError, StoreError)


class BatchDriver:
    def __init__(self, svc: Services, store: ObjectStore) -> None:
        self.svc, self.store = svc, store
        self.redis, self.keys, self.settings = svc.redis, svc.keys, svc.settings
        self.lease = BatchLease(svc)
        self.output = BatchOutput(svc, store, self.lease)
        self.readers: dict[str, InputReader] = {}
        self.validations: dict[str, Validation] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-driver")

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            busy = False
            try:
                busy = await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away: try again next tick, drive nothing meanwhile
                log.warning("batch driver tick failed", exc_info=True)
            # A tick that moved lines is followed at once by the next (a fast model drains a
            # backlog between two polls); an idle one waits the poll interval.
            await asyncio.sleep(_BUSY_PAUSE_S if busy else self.settings.batch_poll_s)

    async def tick(self) -> bool:
        """Advance every batch this process holds the lease of; True when some line moved. Each
        batch is advanced on its own: one that raises holds none of the others back."""
        busy = False
        for batch_id in sorted(await self.redis.smembers(self.keys.active_batches)):
            try:
                if await self.lease.hold(batch_id):
                    busy |= await self._advance(batch_id)
                else:
                    self._forget(batch_id)
            except Exception as exc:
                self._forget(batch_id)
                try:
                    await self._on_error(batch_id, exc)
                except Exception:
                    log.warning("batch %s: cannot record the driver's error", batch_id, exc_info=True)
        return busy

    def _forget(self, batch_id: str) -> None:
        self.readers.pop(batch_id, None)
        self.validations.pop(batch_id, None)

    async def _on_error(self, batch_id: str, exc: Exception) -> None:
        """What an exception advancing one batch does (to that batch only)."""
        if isinstance(exc, Fenced):
            return
        if isinstance(exc, ApiError) and exc.code == "file_not_found":  # the input file was deleted under the batch
            await self._fail(batch_id, exc.code, exc.message, "input_file_id")
        elif isinstance(exc, _TRANSIENT) or (isinstance(exc, ApiError) and exc.status >= 500):
            log.warning("batch %s: %s (tried again next tick)", batch_id, exc)
        else:
            self.svc.metrics.batch_driver_errors.labels("batch").inc()
            log.error("batch %s: the batch driver raised", batch_id, exc_info=exc)
            await self.lease.write(batch_id, [["HINCRBY", "batch", "driver_errors", 1]])
            if int(await self.redis.hget(self.keys.batch(batch_id), "driver_errors") or 0) >= _MAX_BATCH_ERRORS:
                await self._give_up(batch_id, exc)

    async def _fail(self, batch_id: str, code: str, message: str, param: str | None = None, **files: str) -> None:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        fields = {"errors": json.dumps([{"code": code, "message": message, "param": param, "line": None}]), **files}
        try:
            await self.output.announce(batch_id, raw, "failed", fields)
        except _TRANSIENT:
            raise
        except Exception:  # a record the driver cannot read (what failed it, maybe): failed all the same
            log.exception("batch %s: cannot announce batch.failed", batch_id)
        await self.lease.set_status(batch_id, "failed", **fields)
        await self.redis.srem(self.keys.active_batches, batch_id)

    async def _give_up(self, batch_id: str, exc: Exception) -> None:
        """Fail a batch the driver raised on `_MAX_BATCH_ERRORS` times. Its running jobs are
        cancelled; the lines it answered are kept in its files where these can still be written."""
        for value in (await self.redis.hgetall(self.keys.batch_inflight(batch_id))).values():
            try:
                job_id = json.loads(value)[0]
            except (ValueError, LookupError, TypeError):
                continue  # an unreadable entry names no job
            await cancel_job(self.svc, job_id)
        files: dict[str, str] = {}
        try:
            files = await self.output.write_files(batch_id, await self.redis.hgetall(self.keys.batch(batch_id)))
        except _TRANSIENT:
            raise
        except Exception:
            log.exception("batch %s: cannot write the lines it answered", batch_id)
        message = f"the batch driver failed {_MAX_BATCH_ERRORS} times on this batch ({type(exc).__name__})"
        await self._fail(batch_id, "internal_error", message + ("; the lines it answered are in its files" if files
                                                                 else ""), **files)
        if files:
            await self.output.delete_parts(batch_id)

    # --- the state machine -------------------------------------------------------------------------

    async def _advance(self, batch_id: str) -> bool:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        status = raw.get("status")
        if not raw or status in FINAL:
            self._forget(batch_id)
            await self.redis.srem(self.keys.active_batches, batch_id)
            return False
        if status == "validating":
            await self._validate(batch_id, raw)
            return True
        self.validations.pop(batch_id, None)  # cancelled while validating
        if status == "finalizing":
            await self._finalize(batch_id, raw)
            return True
        return await self._run_lines(batch_id, raw)

    async def _validate(self, batch_id: str, raw: dict) -> None:
        """One step of the validation: up to `_VALIDATE_GROUPS` groups of lines; the last step writes the outcome."""
        state = self.validations.get(batch_id)
        if state is None:
            input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
            groups = read_envelopes(self.store, input_file.object_name, raw["endpoint"], self.settings.max_body_bytes)
            state = self.validations[batch_id] = Validation(groups)
        for _ in range(_VALIDATE_GROUPS):
            group = await anext(state.groups, None)
            if group is None:
                del self.validations[batch_id]
                await self._validated(batch_id, raw, state)
                return
            await route_models(self.svc, raw["tenant"], [item for item in group if isinstance(item, Envelope)],
                               state.routes)
            for item in group:
                state.check(item)

    async def _validated(self, batch_id: str, raw: dict, state: Validation) -> None:
        if state.total == 0:
            state.errors.append(LineError(1, "empty_file", "the input file has no request lines").to_json())
        if state.errors:
            fields = {"errors": json.dumps(state.errors), "total": state.total}
            await self.output.announce(batch_id, raw, "failed", fields)
            await self.lease.set_status(batch_id, "failed", **fields)
            await self.redis.srem(self.keys.active_batches, batch_id)
        else:
            await self.lease.set_status(batch_id, "in_progress", total=state.total, last_line=state.last, cursor=0)

    async def _run_lines(self, batch_id: str, raw: dict) -> bool:
        ending = "cancelled" if raw.get("cancel_requested") else (
            "expired" if time.time() >= float(raw["expires_at"]) else None)
        inflight = {int(n): json.loads(v) for n, v in (await self.redis.hgetall(self.keys.batch_inflight(batch_id))
                                                       ).items()}
        # No cursor yet: cancelled before its validation ended (nothing to run, nothing to write).
        cursor, last = int(raw.get("cursor", 0)), int(raw.get("last_line", 0))
        enqueued_before = cursor
        if ending is None and cursor < last and len(inflight) < self.settings.batch_backlog:
            cursor = await self._enqueue(batch_id, raw, inflight, cursor)
        ended = await ended_jobs(self.svc, inflight, cancel=ending is not None)
        answers = await anyio.to_thread.run_sync(
            self._answer, batch_id, [(number, ended[number], *inflight.pop(number)[1:]) for number in sorted(ended)])
        out_lines: list[str] = []
        err_lines: list[str] = []
        for ok, line in answers:
            (out_lines if ok else err_lines).append(line)
        counts = {"completed": len(out_lines), "failed": len(err_lines)}
        done = not inflight and (ending is not None or cursor >= last)
        if done and ending is not None and cursor < last:
            input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
            unrun = await anyio.to_thread.run_sync(unrun_lines, self.store, input_file.object_name, raw["endpoint"],
                                                   self.settings.max_body_bytes, cursor, ending)
            err_lines += unrun
            counts["failed"] += len(unrun)
        if out_lines or err_lines:
            await self.output.commit_part(batch_id, raw, out_lines, err_lines, list(ended), counts)
        if done:
            self.readers.pop(batch_id, None)
            await self.lease.set_status(batch_id, "finalizing", outcome=ending or "completed")
        return done or bool(ended) or cursor != enqueued_before

    async def _enqueue(self, batch_id: str, raw: dict, inflight: dict, cursor: int) -> int:
        reader = self.readers.get(batch_id)
        if reader is None or reader.cursor != cursor:
            input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
            groups = read_envelopes(self.store, input_file.object_name, raw["endpoint"], self.settings.max_body_bytes)
            reader = self.readers[batch_id] = InputReader(groups, cursor)
        ttl_s = float(raw["expires_at"]) - time.time()
        taken = await reader.take(self.settings.batch_backlog - len(inflight))
        routes: dict[str | None, Route | ApiError] = {}
        await route_models(self.svc, raw["tenant"], [item for item in taken if isinstance(item, Envelope)], routes)
        built = await anyio.to_thread.run_sync(build_jobs, self.svc, raw["tenant"], batch_id, raw["endpoint"], taken,
                                               routes, ttl_s)
        added: dict[int, list] = {}
        failed: list[str] = []
        for index, (item, line) in enumerate(zip(taken, built, strict=True)):
            try:
                added[item.number] = await enqueue_line(self.svc, batch_id, raw, line, ttl_s)
            except RateLimited as exc:
                if not exc.too_large:  # over the batch budget for now: this line and the rest go first next tick
                    reader.hold(taken[index:])
                    break
                failed.append(refused_line(item.custom_id, exc))  # larger than the whole budget: it can never run
            except LineError as exc:  # valid at validation, not now (the byte limit was lowered since)
                failed.append(unanswered_line(exc.custom_id, exc.code, exc.message))
            except ApiError as exc:  # a request the live route would refuse: the line's answer
                failed.append(refused_line(item.custom_id, exc))
            except _TRANSIENT:
                raise
            except Exception as exc:
                self._line_broke(batch_id, item.number, exc)
                failed.append(refused_line(item.custom_id, INTERNAL_ERROR))
            reader.cursor = item.number
        if reader.exhausted and not reader.held:
            reader.cursor = int(raw["last_line"])
        writes = [["HSET", "batch", "cursor", reader.cursor]]
        if added:
            writes.append(["HSET", "inflight", *[x for n, v in added.items() for x in (n, json.dumps(v))]])
        # Lines that failed here are a part of their own, committed with the cursor: counted exactly once.
        await self.output.commit_part(batch_id, raw, [], failed, [], {"failed": len(failed)}, extra=writes)
        inflight.update(added)
        return reader.cursor

    def _line_broke(self, batch_id: str, number: int, exc: Exception) -> None:
        self.svc.metrics.batch_driver_errors.labels("line").inc()
        log.error("batch %s, line %d: the batch driver raised; the line is answered internal_error", batch_id, number,
                  exc_info=exc)

    def _answer(self, batch_id: str, ended: list[tuple[int, dict, str, bool]]) -> list[tuple[bool, str]]:
        """(succeeded, JSONL line) of each ended line (a thread's work: it parses every job's record)."""
        answers = []
        for number, fields, custom_id, chat in ended:
            try:
                answers.append(answer_line(fields, custom_id, chat))
            except Exception as exc:  # this line's answer; the others go on
                self._line_broke(batch_id, number, exc)
                answers.append((False, refused_line(custom_id, INTERNAL_ERROR)))
        return answers

    async def _finalize(self, batch_id: str, raw: dict) -> None:
        file_ids = await self.output.write_files(batch_id, raw)
        outcome = raw.get("outcome", "completed")
        if raw.get("cancel_requested"):
            outcome = "cancelled"
        await self.output.announce(batch_id, raw, outcome, file_ids)
        await self.lease.set_status(batch_id, outcome, **file_ids)
        await self.redis.srem(self.keys.active_batches, batch_id)
        await self.output.delete_parts(batch_id)
