"""structured_outputs on the wire: checked without a compiler, stored and read back as given."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ferry.worker.engine import SamplingParams, StructuredOutputs
from ferry.worker.protocol import JobRecord, JobRequest, StructuredOutputsRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_job_with_a_schema_round_trips_through_its_record_and_reaches_the_engine():
    request = JobRequest(model="m", prompt="x", structured_outputs={"json": SCHEMA})
    stored = JobRecord.new("j1", request).to_redis()
    assert '"structured_outputs":{"json":' in stored["request"]
    back = JobRecord.from_redis(stored).request
    assert back.structured_outputs.json_schema == SCHEMA
    params = SamplingParams(**back.sampling_kwargs())
    assert params.structured_outputs == StructuredOutputs(json=SCHEMA)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": 7}}, "not a valid JSON schema"),
        ({"json": "[1,"}, "not valid JSON"),
        ({"regex": "(unclosed"}, "not a valid regular expression"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"regex": "a", "grammar": "root ::= \"a\""}, "exactly one"),
        ({}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"tools": []}, "Extra inputs"),
    ],
)
def test_bad_specs_are_refused_before_queueing(spec, message):
    with pytest.raises(ValidationError, match=message):
        StructuredOutputsRequest(**spec)


def test_json_text_is_parsed_and_every_kind_maps_to_the_engine():
    assert StructuredOutputsRequest(json='{"type": "string"}').engine_kwargs()["json"] == {"type": "string"}
    for spec in ({"json_object": True}, {"regex": "[ab]+"}, {"choice": ["x"]}, {"grammar": 'root ::= "a"'}):
        StructuredOutputs(**StructuredOutputsRequest(**spec).engine_kwargs())
