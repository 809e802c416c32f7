"""A batch's input file as the driver reads it: the validation that advances a bounded step per
tick, the open read that enqueueing resumes at the cursor, and the answers of the lines a batch
that ends early never ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ferry.api.batches import (
    MAX_REPORTED_ERRORS,
    Envelope,
    LineError,
    Route,
    envelope_groups,
    unanswered_line,
)
from ferry.api.errors import ApiError
from ferry.worker.common.objectstore import ObjectStore

# How a batch that ends early answers the lines it never ran.
_UNRUN = {"expired": ("batch_expired", "this request could not be executed before the completion window expired"),
          "cancelled": ("batch_cancelled", "the batch was cancelled before this request ran")}


class InputReader:
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
class Validation:
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


def unrun_lines(store: ObjectStore, object_name: str, endpoint: str, max_bytes: int, cursor: int,
                ending: str) -> list[str]:
    """Error lines for the lines after `cursor`, never enqueued: the rest of a batch that ended
    `ending` ("expired" or "cancelled") (a thread's work: it reads and parses the file)."""
    code, message = _UNRUN[ending]
    groups = envelope_groups(store.read_chunks(object_name), endpoint, max_bytes)
    return [unanswered_line(item.custom_id, code, message) for group in groups for item in group
            if item.number > cursor]
