"""Requests without a model, for block-manager and scheduler unit tests."""

from __future__ import annotations

import itertools

from ferry.worker.engine.outputs import RequestMetrics
from ferry.worker.engine.request import Request
from ferry.worker.engine.sampling_params import SamplingParams

_arrivals = itertools.count()


def make_request(
    request_id: str, num_tokens: int, priority: int = 0, first_token: int = 0, background: bool = False, **params
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_tokens)),
        params=SamplingParams(**params).resolved({}, remaining=16),  # as Engine.add_request resolves them
        priority=priority,
        arrival_seq=next(_arrivals),
        metrics=RequestMetrics(arrival_time=0.0),
        background=background,
    )
