"""Reasoning through the real stack: an API and a worker with `FERRY_REASONING_PARSER=qwen3` on a tiny
model whose tokenizer has `<think>` and `</think>` tokens; the official `openai` client gets the
thinking as `reasoning_content`, apart from the answer, whole and streamed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferry.api.batches import output_line
from ferry.worker.protocol import JobRecord, JobRequest, JobResult, JobState, Usage
from tests.api.conftest import (
    KEY_A,
    Proc,
    api_keys_setting,
    delete_prefix,
    free_port,
    new_prefix,
    stack_env,
    wait_until,
)
from tests.tiny_models import make_model

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

THINKING_MODEL = "tiny-thinking"
MESSAGES = [{"role": "user", "content": "Say hello."}]
REGEX = r"<think>[a-z ]{5,20}</think>[A-Za-z ]{3,20}"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """(the worker's tokenizer, an openai client, an httpx client): an API and the worker on a prefix
    of their own (a second model on the session stack's would make `model` required there)."""
    model_dir = make_model(tmp_path_factory.mktemp("thinking-model"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3's: one token each
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prefix, port = new_prefix(), free_port()
    env = stack_env(prefix, model_dir, FERRY_MODEL_NAME=THINKING_MODEL, FERRY_REASONING_PARSER="qwen3",
                    FERRY_API_KEYS=api_keys_setting())
    logs = tmp_path_factory.mktemp("thinking-logs")
    procs = [Proc("worker", ["worker"], env, logs), Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)],
                                                          env, logs)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 120, "the thinking stack", procs)
        with (openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as client,
              httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as api):
            yield tokenizer, client, api
    finally:
        for proc in procs:
            proc.stop()
        delete_prefix(prefix)


def _ask(tokenizer) -> dict:
    """A chat whose output the regex forces to a think block then an answer. A grammar waits for
    `</think>` when the first token is `<think>`'s (qwen3's rule): kept off that token, the first
    token is another the regex allows, so the grammar holds from the start and spells the block in
    other tokens."""
    start = tokenizer.convert_tokens_to_ids("<think>")
    return dict(model=THINKING_MODEL, messages=MESSAGES, max_tokens=120, temperature=0.0,
                logit_bias={str(start): -100}, extra_body={"structured_outputs": {"regex": REGEX}})


def test_the_thinking_is_reasoning_content_and_the_rest_the_answer(thinking):
    tokenizer, client, api = thinking
    r = client.chat.completions.create(**_ask(tokenizer))
    message = r.choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert 5 <= len(reasoning) <= 20 and set(reasoning) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert 3 <= len(content) <= 20 and "<" not in content
    output = api.get(f"/v1/jobs/{r.id.removeprefix('chatcmpl-')}").json()["output"]  # the job's result too
    assert output["text"] == f"<think>{reasoning}</think>{content}"
    assert (output["reasoning_content"], output["content"]) == (reasoning, content)

    chunks = list(client.chat.completions.create(**_ask(tokenizer), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_chats_grammar_waits_for_the_end_of_the_thinking(thinking):
    tokenizer, client, _ = thinking
    start = tokenizer.convert_tokens_to_ids("<think>")
    # `<think>` pushed to the top: the first token opens the block, and the grammar waits for a
    # `</think>` that never comes (the regex, applied, would have closed the block by now).
    forced = {"structured_outputs": {"regex": REGEX}}
    r = client.chat.completions.create(model=THINKING_MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                       logit_bias={str(start): 100}, extra_body=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.reasoning_content, choice.message.content) == ("<think>" * 7, "")


def test_a_completion_is_not_split(thinking):
    _, client, api = thinking
    r = client.completions.create(model=THINKING_MODEL, prompt="Hi", max_tokens=40, temperature=0.0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    assert r.choices[0].text.startswith("<think>")  # the grammar from the first token: nothing waits
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
