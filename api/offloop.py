"""Large request bodies are checked in processes of their own, at the lowest CPU priority.

FastAPI parses a body and runs its model's validators on the event loop, before the endpoint; for
a megabyte body (a long prompt, a big JSON schema) that is tens of milliseconds during which no
request of any tenant moves, and a thread would still hold the GIL against the loop. So a body over
`INLINE_BYTES` is first parsed and checked in a `BodyChecks` process (`nice 19`: the API's loop
and the engine take the CPU first): the middleware's JSON check (`json_value_problem`), then, on
an `OffLoopBodyRoute`, its route's model. A body the model refuses is answered from there with
the 422 FastAPI would give (the same errors, under `body`), so a tenant sending bodies that are
refused costs the loop almost nothing; a body the model takes is validated once more, on a thread,
and handed to FastAPI as the model (which it takes as it is). One that does not parse takes
FastAPI's own path (its `invalid_json`).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from ferry.worker.protocol.fields import json_value_problem

INLINE_BYTES = 32 << 10  # bodies up to this size are checked on the loop (well under a millisecond)
NOT_JSON = "not json"  # what a check answers for a body that does not parse
_PARENT_POLL_S = 1.0  # how often a checker process looks whether the API process is still there


class BodyChecks:
    """A pool of `processes` checker processes, started at once (their first check is not a cold start)."""

    def __init__(self, processes: int) -> None:
        self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_checker_started, initargs=(os.getpid(),))
        self._pool.submit(int)  # start a process now: spawning one (Python, pydantic, Ferry's models) takes a second

    async def json_value_problem(self, body: bytes) -> tuple[str, str] | str | None:
        """`json_value_problem` of the parsed body, NOT_JSON, or None."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, body_json_problem, body)

    async def model_errors(self, model: type[BaseModel], body: bytes) -> list[dict] | str | None:
        """The errors `model` refuses the body with (FastAPI's shape), NOT_JSON, or None."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, _model_errors, model, body)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _checker_started(api_pid: int) -> None:
    """In a checker process: the lowest CPU priority, and an exit once the API process is gone. A
    pool's process holds both ends of its own task pipe, so it never reads an end of input: an API
    process killed (kill -9, the OOM killer) would leave it waiting for ever (a test run left 67)."""
    os.nice(19)

    def watch() -> None:
        while os.getppid() == api_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def body_json_problem(body: bytes) -> tuple[str, str] | str | None:
    """`json_value_problem` of a body as bytes (surrogates, non-finite numbers; the routes' models
    check depth), NOT_JSON when it does not parse."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return NOT_JSON
    return json_value_problem(value)


def _model_errors(model: type[BaseModel], body: bytes) -> list[dict] | str | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return NOT_JSON
    try:
        model.model_validate(value)
    except ValidationError as exc:
        # What the error handler reads (the input itself may be the megabyte that was refused).
        return [{"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"]} for e in exc.errors(include_url=False)]
    return None


class OffLoopBodyRoute(APIRoute):
    """A route whose large JSON bodies are checked in the app's `BodyChecks` (`app.state.body_checks`)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = getattr(self.body_field, "field_info", None) and self.body_field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def route(request: Request):
            checks: BodyChecks | None = getattr(request.app.state, "body_checks", None)
            body = await request.body()
            if checks is not None and len(body) > INLINE_BYTES and _is_json(request):
                errors = await checks.model_errors(model, body)
                if isinstance(errors, list):
                    raise RequestValidationError(errors)
                if errors is None:
                    request._json = await anyio.to_thread.run_sync(_validated, model, body)  # what FastAPI reads next
            return await handler(request)

        return route


def _validated(model: type[BaseModel], body: bytes) -> Any:
    return model.model_validate(json.loads(body))


def is_json_media(content_type: bytes | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON: none, application/json or */*+json."""
    if content_type is None:
        return True
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _is_json(request: Request) -> bool:
    content_type = request.headers.get("content-type")
    return is_json_media(content_type.encode("latin-1") if content_type is not None else None)
