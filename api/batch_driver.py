"""The batch driver: a background task of every API process that moves batches along.

Each active batch (`Keys.active_batches`) is driven by one process at a time, the holder of its
lease (`Keys.batch_lease`, a random token per process, renewed every tick, taken over when it
lapses). Every write of the driver is one `lua.BATCH_FENCED` call that checks the lease first, so
a driver that stalled past its lease writes nothing. All of a batch's state is in Redis; a driver
holds only an open reader of the input file, which a new driver re-opens at the cursor, and the
progress of a validation, which a new driver starts again.

`validating` advances a bounded step per tick (`_VALIDATE_GROUPS` groups of lines, read and
parsed in a thread): a large file holds neither the event loop nor the other batches, and the
lease is renewed between two steps.

One tick of an `in_progress` batch:
1. enqueue input lines while fewer than `batch_backlog` of its jobs are in flight (bounded
   backlog), each with the idempotency key `batch:{id}:{line}`: a driver killed between the
   enqueue and the cursor write re-enqueues the same job, never a second one. A line whose
   request the live route would refuse is answered with that refusal instead;
2. collect finished jobs: their output and error lines go to a new part object named by the
   part number and the driver's token, then one fenced write commits the part, drops the lines
   from the in-flight hash and counts them. A part written but not committed is written again
   under the next driver's token; only committed parts are read. So each line lands in exactly
   one committed part: no loss, no duplicate;
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
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import anyio
from redis.exceptions import RedisError

from ferry.api.batches import (
    FINAL,
    INTERNAL_ERROR,
    MAX_REPORTED_ERRORS,
    STATUS_TIMES,
    Envelope,
    Line,
    LineError,
    Route,
    answer_line,
    batch_json,
    build_line,
    envelope_groups,
    read_envelopes,
    refused_line,
    route_models,
    unanswered_line,
)
from ferry.api.errors import ApiError
from ferry.api.files import Upload, get_record, store_upload
from ferry.api.joblist import index_job
from ferry.api.ratelimit import RateLimited, admit, estimate_tokens
from ferry.api.services import Services, cancel_job, check_against_model
from ferry.worker.common.objectstore import ObjectStore, StoreError
from ferry.worker.protocol import TERMINAL_STATES, enqueue_job_async, lua, new_job_id_for
from ferry.worker.protocol.codec import text

log = logging.getLogger("ferry.api.batches")

# Between two ticks that both moved lines. Each tick reads the state of every line in flight (up
# to batch_backlog): 50 ms keeps that a few thousand commands/s, and a backlog lasts far longer.
_BUSY_PAUSE_S = 0.05
_VALIDATE_GROUPS = 8  # groups of input lines (api.batches) one tick validates of one batch
_MAX_BATCH_ERRORS = 5  # unexpected exceptions on one batch before it is failed
# The stores being away: the tick is retried, and no batch is blamed for it.
_TRANSIENT = (RedisError, OSError, StoreError)
# How a batch that ends early answers the lines it never ran.
_UNRUN = {"expired": ("batch_expired", "this request could not be executed before the completion window expired"),
          "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran")}


class Fenced(Exception):
    """The batch's lease is no longer this driver's: another process drives it now."""


class _Reader:
    """An open read of a batch's input file, positioned after line `cursor`."""

    def __init__(self, groups: AsyncIterator[list[Envelope | LineError]], cursor: int) -> None:
        self.groups, self.cursor = groups, cursor
        self.exhausted = False
        self.held: list[Envelope | LineError] = []  # taken from the file, not yet enqueued

    def hold(self, items: list[Envelope | LineError]) -> None:
        """Keep lines taken but not enqueued (over the rate limit), in order, for the next `take`."""
        self.held = items + self.held

    async def take(self, n: int) -> list[Envelope | LineError]:
        out, self.held = self.held[:n], self.held[n:]
        while len(out) < n and not self.exhausted:
            group = await anext(self.groups, None)
            if group is None:
                self.exhausted = True
                break
            out += [item for item in group if item.number > self.cursor]
        self.held = out[n:] + self.held
        return out[:n]


@dataclass(slots=True)
class _Validation:
    """A batch's validation so far (it advances one bounded step per tick)."""

    groups: AsyncIterator[list[Envelope | LineError]]  # the input file's lines still to check
    seen: set[str] = field(default_factory=set)  # custom_ids of the lines checked
    errors: list[dict] = field(default_factory=list)  # OpenAI's `errors.data`, at most MAX_REPORTED_ERRORS
    routes: dict[str | None, Route | ApiError] = field(default_factory=dict)  # each model named, routed once
    total: int = 0  # request lines checked
    last: int = 0  # the number of the last one

    def check(self, item: Envelope | LineError) -> None:
        self.total += 1
        self.last = item.number
        error = item if isinstance(item, LineError) else self._problem(item)
        if error is not None and len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(error.to_json())

    def _problem(self, line: Envelope) -> LineError | None:
        if line.custom_id in self.seen:
            return LineError(line.number, "duplicate_custom_id", "custom_id: the same as on an earlier line",
                             "custom_id")
        self.seen.add(line.custom_id)
        model = line.body.get("model")
        route = self.routes.get(model) if model is None or isinstance(model, str) else None
        if isinstance(route, ApiError) and route.status == 404:  # a model nobody serves fails the batch
            return LineError(line.number, route.code, route.message, "body.model")
        return None


class BatchDriver:
    def __init__(self, svc: Services, store: ObjectStore) -> None:
        self.svc, self.store = svc, store
        self.redis, self.keys, self.settings = svc.redis, svc.keys, svc.settings
        self.token = uuid.uuid4().hex
        self.readers: dict[str, _Reader] = {}
        self.validations: dict[str, _Validation] = {}
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
                if await self._hold(batch_id):
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
            await self._write(batch_id, [["HINCRBY", "batch", "driver_errors", 1]])
            if int(await self.redis.hget(self.keys.batch(batch_id), "driver_errors") or 0) >= _MAX_BATCH_ERRORS:
                await self._give_up(batch_id, exc)

    async def _fail(self, batch_id: str, code: str, message: str, param: str | None = None, **files: str) -> None:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        fields = {"errors": json.dumps([{"code": code, "message": message, "param": param, "line": None}]), **files}
        try:
            await self._announce(batch_id, raw, "failed", fields)
        except _TRANSIENT:
            raise
        except Exception:  # a record the driver cannot read (what failed it, maybe): failed all the same
            log.exception("batch %s: cannot announce batch.failed", batch_id)
        await self._set_status(batch_id, "failed", **fields)
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
            files = await self._write_files(batch_id, await self.redis.hgetall(self.keys.batch(batch_id)))
        except _TRANSIENT:
            raise
        except Exception:
            log.exception("batch %s: cannot write the lines it answered", batch_id)
        message = f"the batch driver failed {_MAX_BATCH_ERRORS} times on this batch ({type(exc).__name__})"
        await self._fail(batch_id, "internal_error", message + ("; the lines it answered are in its files" if files
                                                                 else ""), **files)
        if files:
            await self._delete_parts(batch_id)

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
            state = self.validations[batch_id] = _Validation(groups)
        for _ in range(_VALIDATE_GROUPS):
            group = await anext(state.groups, None)
            if group is None:
                del self.validations[batch_id]
                await self._validated(batch_id, raw, state)
                return
            await route_models(self.svc, [item for item in group if isinstance(item, Envelope)], state.routes)
            for item in group:
                state.check(item)

    async def _validated(self, batch_id: str, raw: dict, state: _Validation) -> None:
        if state.total == 0:
            state.errors.append(LineError(1, "empty_file", "the input file has no request lines").to_json())
        if state.errors:
            fields = {"errors": json.dumps(state.errors), "total": state.total}
            await self._announce(batch_id, raw, "failed", fields)
            await self._set_status(batch_id, "failed", **fields)
            await self.redis.srem(self.keys.active_batches, batch_id)
        else:
            await self._set_status(batch_id, "in_progress", total=state.total, last_line=state.last, cursor=0)

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
        ended = await self._ended(inflight, cancel=ending is not None)
        answers = await anyio.to_thread.run_sync(
            self._answer, batch_id, [(number, ended[number], *inflight.pop(number)[1:]) for number in sorted(ended)])
        out_lines: list[str] = []
        err_lines: list[str] = []
        for ok, line in answers:
            (out_lines if ok else err_lines).append(line)
        counts = {"completed": len(out_lines), "failed": len(err_lines)}
        done = not inflight and (ending is not None or cursor >= last)
        if done and ending is not None and cursor < last:
            unrun = await self._unrun(raw, cursor, ending)
            err_lines += unrun
            counts["failed"] += len(unrun)
        if out_lines or err_lines:
            await self._commit_part(batch_id, raw, out_lines, err_lines, list(ended), counts)
        if done:
            self.readers.pop(batch_id, None)
            await self._set_status(batch_id, "finalizing", outcome=ending or "completed")
        return done or bool(ended) or cursor != enqueued_before

    async def _enqueue(self, batch_id: str, raw: dict, inflight: dict, cursor: int) -> int:
        reader = self.readers.get(batch_id)
        if reader is None or reader.cursor != cursor:
            input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
            groups = read_envelopes(self.store, input_file.object_name, raw["endpoint"], self.settings.max_body_bytes)
            reader = self.readers[batch_id] = _Reader(groups, cursor)
        ttl_s = float(raw["expires_at"]) - time.time()
        taken = await reader.take(self.settings.batch_backlog - len(inflight))
        routes: dict[str | None, Route | ApiError] = {}
        await route_models(self.svc, [item for item in taken if isinstance(item, Envelope)], routes)
        built = await anyio.to_thread.run_sync(self._build, raw["tenant"], batch_id, raw["endpoint"], taken, routes,
                                               ttl_s)
        added: dict[int, list] = {}
        failed: list[str] = []
        for index, (item, line) in enumerate(zip(taken, built, strict=True)):
            try:
                added[item.number] = await self._submit(batch_id, raw, line, ttl_s)
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
        await self._commit_part(batch_id, raw, [], failed, [], {"failed": len(failed)}, extra=writes)
        inflight.update(added)
        return reader.cursor

    def _build(self, tenant: str, batch_id: str, endpoint: str, items: list[Envelope | LineError],
               routes: dict[str | None, Route | ApiError], ttl_s: float) -> list[Line | Exception]:
        """Each line's job, or why it has none (a thread's work: it parses every body)."""
        built: list[Line | Exception] = []
        for item in items:
            try:
                built.append(item if isinstance(item, LineError) else
                             build_line(self.svc, tenant, batch_id, endpoint, item, routes, ttl_s))
            except Exception as exc:  # the line's answer, raised again by _submit
                built.append(exc)
        return built

    async def _submit(self, batch_id: str, raw: dict, line: Line | Exception, ttl_s: float) -> list:
        """Admit and enqueue one line's job: its in-flight entry [job id, custom_id, chat]."""
        if isinstance(line, Exception):
            raise line
        await check_against_model(self.svc, line.job)
        tokens = await estimate_tokens(self.svc, line.job)
        admission = await admit(self.svc, raw["tenant"], "batch", tokens)
        line_key = f"batch:{batch_id}:{line.number}"
        job_id = new_job_id_for(self.keys, line.job, line_key)
        await index_job(self.redis, self.keys, self.settings, line.job.tenant, job_id)
        result = await enqueue_job_async(
            self.redis, self.keys, line.job, job_id=job_id, idempotency_key=line_key,
            idempotency_ttl_s=int(ttl_s) + 86400, batch_line=(batch_id, line.custom_id),
            reservation=(admission.budget, tokens) if admission.budget else None)
        return [result.job_id, line.custom_id, raw["endpoint"] == "/v1/chat/completions"]

    def _line_broke(self, batch_id: str, number: int, exc: Exception) -> None:
        self.svc.metrics.batch_driver_errors.labels("line").inc()
        log.error("batch %s, line %d: the batch driver raised; the line is answered internal_error", batch_id, number,
                  exc_info=exc)

    async def _ended(self, inflight: dict, cancel: bool) -> dict[int, dict]:
        """The in-flight lines whose jobs ended, with their job hashes (empty: the hash is gone). Each
        tick looks at every line in flight (up to `batch_backlog`), so it reads only the state first
        and the whole hash only of the jobs that ended: the driver shares its event loop and Redis
        with live traffic."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _, _ in inflight.values():
            pipe.hmget(self.keys.job(job_id), "state", "cancel")
        ended: list[int] = []
        for number, (state, cancelled) in zip(inflight, await pipe.execute(), strict=True):
            # No hash: Redis lost it, or it expired; its job was enqueued before the line was in flight.
            if state is None or text(state) in TERMINAL_STATES:
                ended.append(number)
            elif cancel and text(cancelled or "") != "1":
                await cancel_job(self.svc, inflight[number][0])
        pipe = self.redis.pipeline(transaction=False)
        for number in ended:
            pipe.hgetall(self.keys.job(inflight[number][0]))
        return dict(zip(ended, await pipe.execute() if ended else [], strict=True))

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

    async def _unrun(self, raw: dict, cursor: int, ending: str) -> list[str]:
        """Error lines for the lines after `cursor`, never enqueued (an expired or cancelled batch's rest)."""
        input_file = await get_record(self.redis, self.keys, raw["input_file_id"], raw["tenant"])
        code, message = _UNRUN[ending]

        def lines() -> list[str]:
            groups = envelope_groups(self.store.read_chunks(input_file.object_name), raw["endpoint"],
                                     self.settings.max_body_bytes)
            return [unanswered_line(item.custom_id, code, message) for group in groups for item in group
                    if item.number > cursor]

        return await anyio.to_thread.run_sync(lines)

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
        file_ids = await self._write_files(batch_id, raw)
        outcome = raw.get("outcome", "completed")
        if raw.get("cancel_requested"):
            outcome = "cancelled"
        await self._announce(batch_id, raw, outcome, file_ids)
        await self._set_status(batch_id, outcome, **file_ids)
        await self.redis.srem(self.keys.active_batches, batch_id)
        await self._delete_parts(batch_id)

    async def _write_files(self, batch_id: str, raw: dict) -> dict[str, str]:
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

    async def _delete_parts(self, batch_id: str) -> None:
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
