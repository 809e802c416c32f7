"""vLLM's /tokenize and /detokenize, and Anthropic's count_tokens, through the real stack: the token
ids are exactly those a generation job with the same prompt is given (its usage's prompt_tokens, and
the tokenizer's own encoding), a chat's go through the chat template with its tools, and decoding
gives the tokenizer's text back."""

from __future__ import annotations

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import KEY_A, MODEL

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def oai(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


def test_a_prompt_tokenizes_as_the_tokenizer_and_a_generation_see_it(api, oai, tiny_model_factory):
    prompt = "The quick brown fox jumps over the lazy dog."
    r = api.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > body["count"] and body["token_strs"] is None
    completion = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == body["count"]
    back = api.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(body["tokens"])


def test_a_chat_tokenizes_through_its_template_and_tools_as_generation_renders_it(api, oai):
    plain = api.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    with_tools = api.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS}).json()
    assert with_tools["count"] > plain["count"]  # the tools are described in the prompt
    for tools, expected in ((None, plain), (TOOLS, with_tools)):
        extra = {"tools": tools} if tools else {}
        chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **extra)
        assert chat.usage.prompt_tokens == expected["count"]


def test_anthropic_count_tokens_is_the_prompt_a_message_is_given(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key=KEY_A, max_retries=0) as client:
        messages = [{"role": "user", "content": "Say something."}]
        counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
        message = client.messages.create(model=MODEL, system="Be brief.", messages=messages, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ({"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "x", "tools": TOOLS}, "tools"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_a_rendering_option_ferry_does_not_implement_is_refused_by_name(api, body, field):
    r = api.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 422 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "unsupported_parameter", field)


def test_token_ids_beyond_the_vocabulary_are_an_invalid_prompt(api):
    r = api.post("/detokenize", json={"model": MODEL, "tokens": [10 ** 6]})
    assert r.status_code == 422, r.text
