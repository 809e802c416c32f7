"""The chat template's own variables: chat_template_kwargs and reasoning_effort reach the template
when it reads them, and are refused by name when it does not (never dropped)."""

from __future__ import annotations

import copy
import json

import pytest

from ferry.worker.engine import InvalidPromptError
from ferry.worker.protocol import JobRequest
from ferry.worker.serve.render import PromptRenderer, template_variables
from tests.tiny_models import _tokenizer

# Qwen3's switch, and a reasoning_effort variable, as a template spells them.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}{% endif %}{% endif %}"
)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def thinking():
    tokenizer = _copy_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return PromptRenderer(tokenizer, "hermes")


def _copy_tokenizer():
    return copy.deepcopy(_tokenizer(384))  # the cached one is shared by every test model


def _job(**fields) -> JobRequest:
    return JobRequest(model="m", messages=CHAT, **fields)


def test_template_variables_are_the_names_its_source_reads():
    assert template_variables(THINKING_TEMPLATE) == {"messages", "add_generation_prompt", "enable_thinking",
                                                     "reasoning_effort"}
    assert template_variables(None) == frozenset()
    assert template_variables("{% for %}") is None  # unparsable: unknown, nothing refused on its account


def test_chat_template_kwargs_reach_the_template(thinking):
    plain = thinking.render(_job())
    off = thinking.render(_job(chat_template_kwargs={"enable_thinking": False}))
    assert off != plain
    assert thinking.tokenizer.decode(off).endswith("<|assistant|><think></think>")
    effort = thinking.render(_job(reasoning_effort="low"))
    assert thinking.tokenizer.decode(effort).endswith("effort: low")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
    ],
    ids=["unread-kwarg", "no-reasoning-effort"],
)
def test_a_variable_the_template_does_not_read_is_refused_by_name(fields, named):
    plain = PromptRenderer(_copy_tokenizer(), "hermes")  # the demo template reads messages only
    with pytest.raises(InvalidPromptError, match=f"^{named}: "):
        plain.render(_job(**fields))


def test_names_ferry_sets_itself_are_refused(thinking):
    with pytest.raises(InvalidPromptError, match="chat_template_kwargs.tokenize"):
        thinking.render(_job(chat_template_kwargs={"tokenize": False}))


def test_the_variables_are_reported_with_the_model(thinking):
    assert json.loads(thinking.reported()["chat_template_variables"]) == sorted(template_variables(THINKING_TEMPLATE))
    assert json.loads(PromptRenderer(None, "hermes").reported()["chat_template_variables"]) == []


def test_template_variables_need_a_chat():
    with pytest.raises(ValueError, match="need 'messages'"):
        JobRequest(model="m", prompt="x", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match="not both"):
        _job(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
