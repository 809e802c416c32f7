"""Reasoning through the real stack: a second worker, `FERRY_REASONING_PARSER=qwen3`, serves a tiny
model whose tokenizer has `<think>` and `</think>` tokens; the official `openai` client gets the
thinking as `reasoning_content`, apart from the answer, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferry.api.batches import output_line
from ferry.worker.protocol import JobRecord, JobRequest, JobResult, JobState, Usage
from tests.api.conftest import KEY_A, Proc, stack_env, wait_until
from tests.tiny_models import make_model

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

THINKING_MODEL = "tiny-thinking"
MESSAGES = [{"role": "user", "content": "Say hello."}]
REGEX = r"<think>[a-z ]{5,20}</think>[A-Za-z ]{3,20}"


@pytest.fixture(scope="module")
def thinking(stack, tmp_path_factory):
    """(the worker's tokenizer, an openai client): the worker joins the session stack's prefix."""
    model_dir = make_model(tmp_path_factory.mktemp("thinking-model"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's: one token each
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    env = stack_env(stack.prefix, model_dir, FERRY_MODEL_NAME=THINKING_MODEL, FERRY_REASONING_PARSER="qwen3")
    worker = Proc("worker-thinking", ["worker"], env, tmp_path_factory.mktemp("thinking-logs"))
    with stack.client() as api:
        wait_until(lambda: THINKING_MODEL in [m["id"] for m in api.get("/v1/models").json()["data"]], 120,
                   "the thinking worker", [worker])
    try:
        with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as client:
            yield tokenizer, client
    finally:
        worker.stop()


def _ask(tokenizer) -> dict:
    """A chat whose output the regex forces to a think block then an answer. A grammar waits for
    `</think>` when the first token is `<think>`'s (qwen3's rule): kept off that token, the first
    token is another the regex allows, so the grammar holds from the start and spells the block in
    other tokens."""
    start = tokenizer.convert_tokens_to_ids("<think>")
    return dict(model=THINKING_MODEL, messages=MESSAGES, max_tokens=120, temperature=0.0,
                logit_bias={str(start): -100}, extra_body={"structured_outputs": {"regex": REGEX}})


def test_the_thinking_is_reasoning_content_and_the_rest_the_answer(thinking, stack):
    tokenizer, client = thinking
    r = client.chat.completions.create(**_ask(tokenizer))
    message = r.choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert 5 <= len(reasoning) <= 20 and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert 3 <= len(content) <= 20 and "<" not in content
    with stack.client() as api:  # the job's result holds the split too
        output = api.get(f"/v1/jobs/{r.id.removeprefix('chatcmpl-')}").json()["output"]
    assert output["text"] == f"<think>{reasoning}</think>{content}"
    assert (output["reasoning_content"], output["content"]) == (reasoning, content)

    chunks = list(client.chat.completions.create(**_ask(tokenizer), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_completion_is_not_split(thinking, stack):
    _, client = thinking
    r = client.completions.create(model=THINKING_MODEL, prompt="Hi", max_tokens=40, temperature=0.0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    assert r.choices[0].text.startswith("<think>")  # the grammar from the first token: nothing waits
    with stack.client() as api:
        output = api.get(f"/v1/jobs/{r.id.removeprefix('cmpl-')}").json()["output"]
    assert output["reasoning_content"] is None


def _record(**result) -> JobRecord:
    """A succeeded chat job's record as Redis gives it back, `result` being what its worker wrote."""
    usage = Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    request = JobRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    base = JobRecord.new("job-1", request).to_redis()
    written = JobResult(state=JobState.succeeded, finished_at=1.0, worker_id="w", finish_reason="stop", usage=usage,
                        **result).to_redis()
    return JobRecord.from_redis(base | written)


def test_batch_output_lines_carry_the_reasoning_as_the_live_route():
    _, line = output_line(_record(text="<think>ab</think>cd", content="cd", reasoning_content="ab"), "c", True, "")
    message = json.loads(line)["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "cd", "reasoning_content": "ab"}
    # An answer without thinking: the parsed content ("" reasoning survives Redis), no reasoning field.
    _, line = output_line(_record(text="<thin", content="<thin", reasoning_content=""), "c", True, "")
    assert json.loads(line)["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "<thin"}
    # A worker without a reasoning parser: the text, as before.
    _, line = output_line(_record(text="<think>ab</think>cd"), "c", True, "")
    assert json.loads(line)["response"]["body"]["choices"][0]["message"]["content"] == "<think>ab</think>cd"
