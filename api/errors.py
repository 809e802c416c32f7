"""One error shape for every failure, OpenAI's: `{"error": {"message", "type", "param", "code", "field"?}}`.

`code` is stable (clients branch on it); `message` is for people; `type` is OpenAI's class of
error (`invalid_request_error` for a 4xx, `server_error` for a 5xx, ...); `param` names the
offending request field on validation errors, or is null; `field` repeats it, present only when
set, for clients written before `param`. Bad input is never a 500: validation errors, malformed JSON,
unknown routes and wrong methods all map to 4xx here.

A request field Ferry does not implement, or an unknown one, is refused with the code
`unsupported_parameter` (OpenAI's) and the field as `param`: never ignored.

Anthropic's Messages API (`/v1/messages` and below) answers the same errors, with the same
statuses, in Anthropic's shape instead: `{"type": "error", "error": {"type", "message", "code",
"param"?}}` (`anthropic_error_body`), so its official client reads them.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferry.api.offloop import INLINE_BYTES, NOT_JSON, body_json_problem, is_json_media

log = logging.getLogger("ferry.api")

UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field (or a value of it) Ferry does not implement, or unknown

# HTTP status -> the code used when Starlette itself answers (unknown route, wrong method, ...).
_STATUS_CODES = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "rate_limited",
}


class ApiError(Exception):
    """Raised anywhere in a request; rendered as the one error shape."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}


# HTTP status -> OpenAI's error `type` (any other 4xx is an invalid request, any 5xx a server error).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, code: str, message: str, field: str | None = None) -> dict:
    error = {"message": message, "type": error_type(status), "param": field, "code": code}
    if field is not None:
        error["field"] = field
    return {"error": error}


# HTTP status -> Anthropic's error `type` (any other 4xx is an invalid request, any 5xx an API error).
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"  # the routes whose errors take Anthropic's shape: this path and those below it


def anthropic_error_body(status: int, code: str, message: str, field: str | None = None) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error = {"type": kind, "message": message, "code": code}
    if field is not None:
        error["param"] = field
    return {"type": "error", "error": error}


def error_response(status: int, code: str, message: str, field: str | None = None, headers=None,
                   path: str = "") -> JSONResponse:
    """The error as JSON: Anthropic's shape for a request to `path` under ANTHROPIC_PATH, OpenAI's otherwise."""
    anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
    body = (anthropic_error_body if anthropic else error_body)(status, code, message, field)
    return JSONResponse(body, status_code=status, headers=headers)


def unsupported(field: str, why: str) -> ApiError:
    """The 422 for a field Ferry does not implement (or does not implement with this value)."""
    return ApiError(422, UNSUPPORTED_PARAMETER, f"{field}: {why}", field=field)


def validation_answer(error: dict, field: str | None) -> tuple[str, str]:
    """(code, message) for pydantic's error at `field`: an unknown field is an unsupported parameter."""
    if error.get("type") == "extra_forbidden":
        return UNSUPPORTED_PARAMETER, f"{field}: unknown field; Ferry does not support it"
    message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    return "invalid_request", f"{field}: {message}" if field else message


def not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"{what}_not_found", f"{what.replace('_', ' ')} {ident!r} not found")


def _field_name(loc: tuple) -> str | None:
    # loc: ("body", "input", "messages", 0, "content") -> "input.messages[0].content"
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers, request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    field = _field_name(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return error_response(422, "invalid_json", f"request body is not valid JSON: {first.get('msg')}",
                              path=request.url.path)
    code, message = validation_answer(first, field)
    return error_response(422, code, message, field, path=request.url.path)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400:  # FastAPI could not decode the body (not UTF-8, ...): malformed input, a 422
        return error_response(422, "invalid_json", f"request body cannot be parsed: {exc.detail}",
                              path=request.url.path)
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None),
                          path=request.url.path)


async def _redis_error(request: Request, exc: RedisError) -> JSONResponse:
    log.warning("redis error: %s", exc)
    return error_response(503, "redis_unavailable", "the job store is unavailable; retry later",
                          headers={"Retry-After": "1"}, path=request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal_error", "internal server error", path=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(Exception, _unexpected)


def _problem_response(problem: tuple[str, str] | str | None, path: str) -> JSONResponse | None:
    """The 422 for a JSON body no route may see (`json_value_problem`'s answer), or None. A body that
    does not parse is left to FastAPI, which answers `invalid_json`."""
    if problem is None or problem == NOT_JSON:
        return None
    where, why = problem
    if len(where) > 80:
        where = where[:60] + "..."
    return error_response(422, "invalid_request", f"{where}: {why}", None if where == "body" else where, path=path)


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    return is_json_media(dict(headers).get(b"content-type"))


class BodyLimitMiddleware:
    """Pure ASGI: answer 413 before the app sees a body over `max_bytes`, 408 for one not all in
    within `timeout_s` (a client sending it a byte at a time held its request for ever), and 422
    for a JSON body with a value no route can store (`json_value_problem`: a lone surrogate in a
    string or a key, a non-finite number), wherever in the body it is.

    Bodies are read up front (they are small JSON documents) and replayed to the app, so a
    chunked upload without Content-Length is limited as well as one that declares its size.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float, streamed: frozenset[tuple[str, str]] = frozenset()):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.streamed = streamed  # (method, path) whose handler reads the body as a stream and limits it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") or (
                (scope["method"], scope["path"]) in self.streamed):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    if len(body) > self.max_bytes:
                        return await self._too_large(scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            response = error_response(408, "body_timeout", f"request body not all in within {self.timeout_s:g} s",
                                      headers={"Connection": "close"}, path=scope["path"])
            return await response(scope, receive, send)
        refused = None
        if body and _is_json(scope["headers"]):
            # A large body's parse and walk (tens of ms per MB) run in a checker process at the
            # lowest CPU priority (`ferry.api.offloop`): one tenant's megabyte bodies must not stall the rest.
            checks = getattr(scope["app"].state, "body_checks", None)
            if len(body) <= INLINE_BYTES or checks is None:
                refused = _problem_response(body_json_problem(bytes(body)), scope["path"])
            else:
                refused = _problem_response(await checks.json_value_problem(bytes(body)), scope["path"])
        if refused is not None:
            return await refused(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, "body_too_large", f"request body is over the {self.max_bytes}-byte limit",
                                  path=scope["path"])
        await response(scope, receive, send)
