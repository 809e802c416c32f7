"""The official `openai` client, unchanged, against the running stack."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.conftest import KEY_A, MODEL

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_stream_equals_non_stream_for_greedy(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream_for_greedy(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens(client):
    long_prompt = " ".join(["Ferry serves language models behind an async job API."] * 8)
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token blocks are reused; the last prompt token is always recomputed.
    assert cached >= 16 * ((second.usage.prompt_tokens - 1) // 16) and cached % 16 == 0


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(
        len(top) <= 3 and max(top.values()) >= lp.token_logprobs[i] - 1e-5 for i, top in enumerate(lp.top_logprobs)
    )
    assert lp.text_offset == sorted(lp.text_offset)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string_and_seed(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:9]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_unset_max_tokens_is_the_rest_of_the_context_window(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == 1024  # the tiny model's max_model_len, not 16 tokens


@pytest.mark.parametrize(
    ("priority", "lane"), [("high", "high"), (-3, "high"), (0, "normal"), ("low", "low"), (7, "low")]
)
def test_priority_picks_the_queue_lane(stack, client, priority, lane):
    whole = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": priority})
    with stack.client() as api:
        assert api.get(f"/v1/jobs/{whole.id.removeprefix('cmpl-')}").json()["priority"] == lane


def test_unknown_priority_is_refused_with_the_field_named(client):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"priority": "urgent"})
    assert info.value.param.startswith("priority")


def test_logit_bias_steers_the_tokens_and_is_checked_against_the_vocabulary(stack, client):
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                      logit_bias={"9": 100}, extra_body={"ignore_eos": True})
    with stack.client() as api:
        job = api.get(f"/v1/jobs/{whole.id.removeprefix('cmpl-')}").json()
    assert job["output"]["token_ids"] == [9] * 4, job
    for bias, where in (({"99999999": 1}, "logit_bias"), ({"9": 101}, "logit_bias"), ({"x": 1}, "logit_bias")):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias=bias)
        assert info.value.param.startswith(where)


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(client):
    batch = ["The quick brown", "Hello", PROMPT]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=batch, **kwargs)
    alone = [client.completions.create(prompt=p, **kwargs) for p in batch]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in alone]
    assert whole.usage.completion_tokens == 18
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_echo_puts_the_prompt_before_the_completion(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs, echo=True).choices[0].text == PROMPT + plain
    chunks = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == PROMPT + plain


def test_errors_reach_the_client_as_openai_errors(stack, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    too_long = "fox " * 1500  # more tokens than max_model_len (1024)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model=MODEL, prompt=too_long)
    assert info.value.body["code"] == "prompt_too_long"
    assert (info.value.code, info.value.type, info.value.param) == ("prompt_too_long", "invalid_request_error", None)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert (info.value.code, info.value.type, info.value.param) == ("invalid_request", "invalid_request_error",
                                                                    "temperature")
    with pytest.raises(openai.UnprocessableEntityError):  # a stream that fails at once still gets a status
        client.completions.create(model=MODEL, prompt=too_long, stream=True)
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_an_idempotency_key_answers_a_retry_from_the_same_jobs(client):
    """As on /v1/jobs: the same key and body name the same jobs (every choice's), another body is a 409."""
    key = {"Idempotency-Key": "retry-1"}
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3, temperature=1.0,
                                           extra_headers=key)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3, temperature=1.0,
                                           extra_headers=key)
    assert again.id == first.id
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    other = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3, temperature=1.0)
    assert other.id != first.id
    with pytest.raises(openai.ConflictError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, extra_headers=key)
    assert refused.value.body["code"] == "idempotency_conflict"


def test_a_stream_left_with_an_idempotency_key_goes_on_for_the_retry(client, stack):
    """A client that goes away mid-stream cancels its job, unless it sent an Idempotency-Key: then
    the job runs on, and the retry streams it whole from its first event."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True}
    whole = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body) if c.choices)
    with stack.client() as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"Idempotency-Key": "left-1"}) as r:
            assert r.status_code == 200
            first_line = next(line for line in r.iter_lines() if line.startswith("data: "))
        job_id = json.loads(first_line[len("data: "):])["id"].removeprefix("chatcmpl-")
        # the connection is closed: without the key the API would now cancel the job
        final = wait_job(http, job_id)
    assert final["status"] == "succeeded", final
    retried = client.chat.completions.create(**body, extra_headers={"Idempotency-Key": "left-1"})
    chunks = list(retried)
    assert chunks[0].id == f"chatcmpl-{job_id}"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def wait_job(http, job_id: str) -> dict:
    """The job once it is terminal: its event stream ends with its terminal event."""
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as events:
        for _ in events.iter_lines():
            pass
    return http.get(f"/v1/jobs/{job_id}").json()


def test_prompt_logprobs_are_the_models_own_whole_and_streamed(client, tiny_model_factory):
    """vLLM's prompt_logprobs: each prompt token's logprob given those before it (and its rank), against
    transformers' forward on the worker's own weights; streamed, they come in a chunk before the first token."""
    prompt = [5, 9, 13, 21, 34, 55, 89, 144]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama"), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "extra_body": {"prompt_logprobs": 2}}
    scored = client.completions.create(**body).choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        entry, expected = scored[position], reference[position - 1]
        token = prompt[position]
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token].item(), abs=2e-4)
        assert entry[str(token)]["rank"] == int((expected > expected[token]).sum()) + 1
        assert {str(t) for t in expected.topk(2).indices.tolist()} <= set(entry)
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert streamed[0] == scored and not any(streamed[1:])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # a scored prompt skips the prefix cache
