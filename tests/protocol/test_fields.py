"""The wire's field types refuse what no job should carry: empty stop strings, unbounded durations,
huge model names, JSON whose key a message could not encode."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ferry.api.openai_schemas import ChatCompletionRequest
from ferry.worker.engine import InvalidSamplingParams, SamplingParams
from ferry.worker.protocol import JobRequest
from ferry.worker.protocol.fields import MAX_JOB_SECONDS, MAX_MODEL_NAME_CHARS, json_problem


@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""])
def test_an_empty_stop_string_is_refused_by_the_wire_and_the_engine(stop):
    with pytest.raises(ValidationError, match="stop"):
        JobRequest(model="m", prompt="hi", stop=stop)
    with pytest.raises(InvalidSamplingParams, match="stop"):
        SamplingParams(stop=stop if isinstance(stop, list) else [stop])


@pytest.mark.parametrize("field", ["ttl_s", "timeout_s"])
def test_a_job_may_not_ask_to_wait_or_run_longer_than_a_week(field):
    assert getattr(JobRequest(model="m", prompt="hi", **{field: float(MAX_JOB_SECONDS)}), field) == MAX_JOB_SECONDS
    for value in (MAX_JOB_SECONDS + 1.0, 1e308):
        with pytest.raises(ValidationError, match=field):
            JobRequest(model="m", prompt="hi", **{field: value})


def test_a_model_name_is_bounded_on_the_wire_and_on_the_openai_routes():
    JobRequest(model="m" * MAX_MODEL_NAME_CHARS, prompt="hi")
    with pytest.raises(ValidationError, match="model"):
        JobRequest(model="m" * (MAX_MODEL_NAME_CHARS + 1), prompt="hi")
    with pytest.raises(ValidationError, match="model"):
        ChatCompletionRequest.model_validate({"model": "m" * 100_000, "messages": [{"role": "user", "content": "hi"}]})


def test_stream_options_take_a_boolean_not_a_string():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert ChatCompletionRequest.model_validate(body | {"stream_options": {"include_usage": True}})
    with pytest.raises(ValidationError, match="include_usage"):
        ChatCompletionRequest.model_validate(body | {"stream_options": {"include_usage": "yes"}})


def test_a_problem_names_a_key_with_a_lone_surrogate_in_an_encodable_way():
    problem = json_problem({"ok": {"\udfff": "\ud800"}}, max_depth=8)
    assert problem is not None and "\\udfff" in problem
    problem.encode("utf-8")  # the message itself is valid Unicode
