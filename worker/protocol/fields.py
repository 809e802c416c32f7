"""The wire's field types, shared by the job request and the API's request bodies: finite floats,
token ids, logit_bias, metadata, every sampling field from the one table
(`worker.protocol.sampling`), and what any JSON a request carries must be."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field, Strict

from ferry.worker.protocol.codec import compact_json
from ferry.worker.protocol.sampling import (
    LOGIT_BIAS_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    SAMPLING_LIMITS,
    TOKEN_ID_MAX,
    Limit,
)

# --- what any JSON a request carries must be -----------------------------------------------------

MAX_JSON_DEPTH = 64  # nesting of a whole request body (a JSON schema for structured outputs included)
METADATA_MAX_DEPTH = 8  # nesting of `metadata`, returned as given (also in webhook bodies)
METADATA_MAX_BYTES = 16 << 10  # `metadata` as compact JSON


def json_value_problem(value: Any, max_depth: int | None = None) -> tuple[str, str] | None:
    """(where, why) for the first thing in decoded JSON that Ferry cannot store and hand back as
    given, or None: a string or object key with a lone surrogate ("\\udfff": no UTF-8 encoder takes
    it), a number JSON cannot carry (NaN, Infinity, or one beyond a double's range such as 1e999,
    which Python reads as inf), or containers nested deeper than `max_depth` (None: any). `where` names the
    place (`metadata.k`, `messages[0]`), escaped so the message itself can be encoded.

    The common case, nothing to find, costs a C-speed encode and a walk over the containers alone
    (a megabyte body in milliseconds: it runs in the request's path); only a body with something
    to report is walked element by element, to name the place. No recursion: any depth is answered."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
        if max_depth is None or not nested_deeper_than(value, max_depth):
            return None
    except (ValueError, RecursionError, TypeError):  # TypeError: not decoded JSON (raw bytes, say): walk it
        pass
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        where = path if len(path) <= 80 else path[:60] + "..."
        if max_depth is not None and depth > max_depth and isinstance(item, dict | list | tuple):
            return where or "body", f"nested deeper than {max_depth} levels"
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return where or "body", "not valid Unicode (a lone surrogate)"
        elif isinstance(item, float) and not math.isfinite(item):
            return where or "body", "not a finite number (NaN, Infinity, or beyond a double's range)"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = _printable(key)
                name = f"{path}.{name}" if path else name
                stack += [(child, depth + 1, name), (key, depth, name)]  # the key first
        elif isinstance(item, list | tuple):
            stack += [(child, depth + 1, f"{path}[{i}]") for i, child in reversed(list(enumerate(item)))]
    return None


def json_problem(value: Any, max_depth: int | None) -> str | None:
    """`json_value_problem` as one message ("where: why"), or None."""
    problem = json_value_problem(value, max_depth)
    return None if problem is None else ": ".join(problem)


def _printable(key: Any) -> str:
    return key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)


def nested_deeper_than(value: Any, max_depth: int) -> bool:
    """Whether a decoded JSON value nests containers deeper than `max_depth` (walked without
    recursion, so it answers the same whatever the interpreter's recursion limit; only containers
    are visited, so a long list of strings costs one pass of C-level iteration)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack += [(child, depth + 1) for child in children if type(child) in (dict, list)]
    return False


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json_problem` as a pydantic before-validator (ValueError: a 422 naming the place)."""
    problem = json_problem(value, max_depth)
    if problem is not None:
        raise ValueError(problem)
    return value


def check_metadata(value: dict[str, Any]) -> dict[str, Any]:
    check_json(value, METADATA_MAX_DEPTH)
    size = len(compact_json(value).encode())
    if size > METADATA_MAX_BYTES:
        raise ValueError(f"metadata is {size} bytes as JSON; at most {METADATA_MAX_BYTES} are kept")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(check_metadata)]
MAX_MODEL_NAME_CHARS = 256  # a served model's name (a Hub id is far shorter); it is echoed back in a 404
ModelName = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]
MAX_JOB_SECONDS = 7 * 86400  # the longest ttl_s / timeout_s a job may ask for (a week)
JobSeconds = Annotated[float, Strict(), Field(gt=0, le=MAX_JOB_SECONDS, allow_inf_nan=False)]
StrictFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]
TokenIds = list[Annotated[int, Strict(), Field(ge=0, le=TOKEN_ID_MAX)]]
# OpenAI's logit_bias: JSON keys are strings ("50256": -100), read as token ids.
LogitBias = Annotated[
    dict[
        Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)],
        Annotated[float, Strict(), Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX, allow_inf_nan=False)],
    ],
    Field(max_length=MAX_LOGIT_BIAS_ENTRIES),
]


# --- sampling fields, from the one table -------------------------------------------------------


def sampling_annotation(limit: Limit, nullable: bool | None = None) -> Any:
    """The pydantic type of one sampling field: bounds from the table, no type coercion
    (`"16"` or `true` is not a number), finite floats only; `nullable` overrides the table's."""
    constraints = {k: getattr(limit, k) for k in ("ge", "gt", "le", "lt") if getattr(limit, k) is not None}
    finite = {"allow_inf_nan": False} if limit.kind is float else {}
    non_empty = {"min_length": 1} if limit.kind is str else {}
    scalar: Any = Annotated[limit.kind, Strict(), Field(**finite, **constraints, **non_empty)]
    if limit.items:
        listed = Annotated[list[scalar], Field(min_length=limit.min_items, max_length=limit.max_items)]
        scalar = listed if limit.kind is not str else scalar | listed  # a bare stop string is a list of one
    return scalar | None if (limit.nullable if nullable is None else nullable) else scalar


def sampling_fields(*, optional: bool = False, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """`create_model` field definitions of every sampling field; `optional`: each defaults to
    None (unset: the engine's default applies), as the OpenAI-compatible bodies want."""
    fields: dict[str, Any] = {}
    for limit in SAMPLING_LIMITS:
        if limit.name in exclude:
            continue
        annotation = sampling_annotation(limit)
        if optional:
            fields[limit.name] = (annotation | None, Field(default=None, description=limit.doc))
        else:
            fields[limit.name] = (annotation, Field(default=limit.default, description=limit.doc))
    return fields
