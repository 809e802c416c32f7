"""The one table of sampling fields, walked against each schema that reads it: the engine's
SamplingParams, the wire's JobRequest and the OpenAI-compatible request bodies agree on every
field's default, bounds, type strictness and finiteness."""

from __future__ import annotations

import math
import re

import pytest
from pydantic import ValidationError

from ferry.api.openai_schemas import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from ferry.worker.engine import SamplingParams
from ferry.worker.protocol import JobRequest
from ferry.worker.protocol.sampling import SAMPLING_LIMITS, Limit, combination_problem

# schema -> (how it names the table's fields, the fields of its own that are not sampling fields)
RENAMED = {
    "job": {"logprobs": "top_logprobs"},
    "completion": {},
    "chat": {"logprobs": "top_logprobs"},
}
NOT_SAMPLING = {
    "job": {
        "model",
        "lora",
        "prompt",
        "messages",
        "logprobs",
        "n",
        "priority",
        "ttl_s",
        "timeout_s",
        "tenant",
        "metadata",
        "webhook",
        "created_at",
        "cache_salt",
        "structured_outputs",
        "logit_bias",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "reasoning_effort",
        "task",
    },
    "completion": {
        "model",
        "n",
        "stream",
        "stream_options",
        "logit_bias",
        "priority",
        "user",
        "structured_outputs",
        "response_format",
        *UNSUPPORTED_FIELDS,
        "prompt",
        "echo",
        "suffix",
        "best_of",
        "tools",
        "tool_choice",
    },
    "chat": {
        "model",
        "n",
        "stream",
        "stream_options",
        "logit_bias",
        "priority",
        "user",
        "structured_outputs",
        "response_format",
        *UNSUPPORTED_FIELDS,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "reasoning_effort",
    },
}
PYDANTIC = {"job": JobRequest, "completion": CompletionRequest, "chat": ChatCompletionRequest}
BASE = {
    "job": {"model": "m", "prompt": "hi"},
    "completion": {"prompt": "hi"},
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
}


def _accepts(schema: str, limit: Limit, value) -> bool:
    if schema == "engine":
        try:
            SamplingParams(**{limit.name: value}, **({"max_tokens": 1 << 20} if limit.name == "min_tokens" else {}))
            return True
        except ValueError:
            return False
    name = RENAMED[schema].get(limit.name, limit.name)
    extra = {"max_tokens": 1 << 20} if limit.name == "min_tokens" else {}
    if schema != "completion" and limit.name == "logprobs":
        extra["logprobs"] = True
    try:
        PYDANTIC[schema].model_validate({**BASE[schema], **extra, name: value})
        return True
    except ValidationError:
        return False


def _scalar_cases(limit: Limit) -> tuple[list, list]:
    """(allowed, refused) values for one item of the field."""
    if limit.kind is bool:
        return [True, False], [1, "true", None]
    if limit.kind is str:
        return ["</s>", "\n"], [1, True, ""]
    step = 1 if limit.kind is int else 1e-6
    ok, bad = [], ["1", True, [1]]
    if limit.kind is float:
        bad += [math.inf, -math.inf, math.nan]
    else:
        bad += [1.5]
    for bound, inclusive, sign in (
        (limit.ge, True, -1),
        (limit.gt, False, -1),
        (limit.le, True, 1),
        (limit.lt, False, 1),
    ):
        if bound is None:
            continue
        inside = bound if inclusive else bound - sign * step
        ok.append(int(inside) if limit.kind is int else float(inside))
        outside = bound + sign * step if inclusive else bound
        bad.append(int(outside) if limit.kind is int else float(outside))
    return ok, bad


def _cases(limit: Limit) -> tuple[list, list]:
    ok, bad = _scalar_cases(limit)
    if limit.items:
        ok_lists = [[v] for v in ok] + ([[]] if limit.min_items == 0 else [])
        if limit.kind is not str:  # a bare string is a list of one for `stop`; a bare number is not a list
            bad_lists = [[v] for v in bad if v is not None] + ok[:1]
        else:
            bad_lists = [[v] for v in bad]
            ok_lists += ok[:1]
        if limit.max_items is not None:
            bad_lists.append([ok[0]] * (limit.max_items + 1))
        if limit.min_items:
            bad_lists.append([ok[0]] * (limit.min_items - 1))
        ok, bad = ok_lists, bad_lists
    if limit.nullable:
        ok.append(None)
    return ok, bad


@pytest.mark.parametrize("limit", SAMPLING_LIMITS, ids=lambda limit: limit.name)
@pytest.mark.parametrize("schema", ["engine", "job", "completion", "chat"])
def test_every_schema_takes_what_the_table_allows_and_refuses_the_rest(schema, limit):
    ok, bad = _cases(limit)
    if schema in ("completion", "chat"):  # every field is optional there: null leaves the engine's default
        ok, bad = ok + [None], [v for v in bad if v is not None]
    if schema == "job" and limit.name == "logprobs":  # `top_logprobs` counts: 0 when not asked for, never null
        ok, bad = [v for v in ok if v is not None], bad + [None]
    assert [v for v in ok if not _accepts(schema, limit, v)] == []
    assert [v for v in bad if _accepts(schema, limit, v)] == []


@pytest.mark.parametrize("limit", SAMPLING_LIMITS, ids=lambda limit: limit.name)
def test_defaults_come_from_the_table(limit):
    if limit.name not in ("stop", "stop_token_ids"):  # normalised to lists by the engine
        assert getattr(SamplingParams(), limit.name) == limit.default
    job = JobRequest(**BASE["job"])
    if limit.name == "logprobs":
        assert job.sampling_kwargs()["logprobs"] is None
    else:
        assert getattr(job, limit.name) == limit.default
    for schema in ("completion", "chat"):  # unset: the engine's default applies
        body = PYDANTIC[schema].model_validate(BASE[schema])
        assert getattr(body, RENAMED[schema].get(limit.name, limit.name)) is None


@pytest.mark.parametrize("schema", ["job", "completion", "chat"])
def test_no_schema_has_a_sampling_field_the_table_lacks(schema):
    names = {RENAMED[schema].get(limit.name, limit.name) for limit in SAMPLING_LIMITS}
    assert set(PYDANTIC[schema].model_fields) - NOT_SAMPLING[schema] == names


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must be <= max_tokens (4)"),
        ({"min_tokens": 1, "structured_outputs": {"choice": ["a"]}}, "min_tokens cannot be combined with structured"),
    ],
    ids=["min-above-max", "min-with-grammar"],
)
def test_the_rules_across_fields_are_stated_once_and_both_schemas_refuse_them(fields, problem):
    stated = combination_problem(fields["min_tokens"], fields.get("max_tokens"), "structured_outputs" in fields)
    assert stated is not None and stated.startswith(problem)
    with pytest.raises(ValueError, match=re.escape(problem)):
        SamplingParams(**fields)
    with pytest.raises(ValidationError):
        JobRequest.model_validate({**BASE["job"], **fields})
    assert combination_problem(4, 4, False) is None and combination_problem(9, None, False) is None
