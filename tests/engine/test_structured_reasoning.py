"""Structured outputs after a think block: the grammar stays off the output until its reasoning
end tokens were generated, then holds the answer to the schema (a random-weight model: only the
grammar can make the answer valid)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ferry.worker.engine import LLM, Engine, Resume, SamplingParams
from ferry.worker.engine.sampling_params import InvalidSamplingParams
from ferry.worker.engine.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "measure_speedup": False, "pause_steps": 0}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=512)


def _params(**reasoning) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA),
                          **reasoning)


@pytest.fixture(scope="module")
def free(llm) -> list[int]:
    """The unconstrained greedy output: the thinking a gated request must reproduce."""
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return out.token_ids


def _end_pair(tokens: list[int], eos: int, first: int = 3) -> int:
    """Where a pair of tokens first occurs (from `first` on) that does not occur before it, with no
    EOS up to it (a request that does not ignore EOS would end there)."""
    for k in range(first, len(tokens) - 1):
        pair = tokens[k:k + 2]
        if eos in pair:
            break
        if all(tokens[i:i + 2] != pair for i in range(k)):
            return k
    raise AssertionError("no fresh token pair in the free output")


def _answer(llm, tokens: list[int]) -> dict:
    value = json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)
    return value


def test_the_thinking_is_unconstrained_and_the_answer_after_its_end_tokens_matches(llm, free):
    k = _end_pair(free, llm.tokenizer.eos_token_id)
    end = free[k:k + 2]  # a `</think>` of two tokens
    [plain] = llm.generate([PROMPT], _params(), use_tqdm=False)
    assert plain.token_ids[:k + 2] != free[:k + 2]  # the grammar from the start would have changed the thinking
    [gated] = llm.generate([PROMPT], _params(reasoning_end_token_ids=end), use_tqdm=False)
    assert gated.token_ids[:k + 2] == free[:k + 2]
    assert gated.finish_reason == "stop"
    _answer(llm, gated.token_ids[k + 2:])


def test_qwen3_style_thinks_only_when_the_first_token_opens_the_block(llm, free):
    k = _end_pair(free, llm.tokenizer.eos_token_id)
    end = free[k:k + 2]
    [plain] = llm.generate([PROMPT], _params(), use_tqdm=False)
    # The free output's first token is the model's favourite: allowed beside the grammar's, it is
    # taken and opens the thinking.
    [opened] = llm.generate([PROMPT], _params(reasoning_end_token_ids=end, reasoning_start_token_id=free[0]),
                            use_tqdm=False)
    assert opened.token_ids[:k + 2] == free[:k + 2]
    _answer(llm, opened.token_ids[k + 2:])
    # A start token the model does not pick: the answer begins at once, as without reasoning.
    unlikely = next(t for t in range(llm.engine.arch.vocab_size) if t not in free and t not in plain.token_ids)
    [direct] = llm.generate([PROMPT], _params(reasoning_end_token_ids=end, reasoning_start_token_id=unlikely,
                                              logit_bias={unlikely: -100}), use_tqdm=False)
    assert direct.token_ids == plain.token_ids
    _answer(llm, direct.token_ids)


def test_greedy_tokens_are_the_same_with_ngram_speculation(llama_dir, llm, free):
    # A longer thinking: its repeated tokens make the n-gram proposer propose inside it too.
    k = _end_pair(free, llm.tokenizer.eos_token_id, first=14)
    params = [_params(reasoning_end_token_ids=free[k:k + 2]),
              _params(reasoning_end_token_ids=free[k:k + 2], reasoning_start_token_id=free[0]),
              _params(reasoning_end_token_ids=[free[k]])]
    plain = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    spec = LLM.__new__(LLM)
    spec.engine, spec._next_id = Engine(str(llama_dir), max_model_len=512, speculative=NGRAM), 0
    speculated = spec.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert spec.engine.stats().spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("where", ["thinking", "end", "answer"])
def test_a_resumed_request_goes_on_with_the_grammar_where_it_was(llm, free, where):
    k = _end_pair(free, llm.tokenizer.eos_token_id)
    params = _params(reasoning_end_token_ids=free[k:k + 2])
    [whole] = llm.generate([PROMPT], params, use_tqdm=False)
    cut = {"thinking": k - 1, "end": k + 1, "answer": k + 4}[where]  # "end": between the two end tokens
    engine = llm.engine
    engine.add_request(f"resumed-{where}", PROMPT, params, resume=Resume(whole.token_ids[:cut]))
    rest = []
    while engine.has_unfinished_requests():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert whole.token_ids[:cut] + rest == whole.token_ids


def test_reasoning_token_ids_are_checked():
    with pytest.raises(InvalidSamplingParams, match="reasoning_end_token_ids"):
        SamplingParams(reasoning_end_token_ids=[])
    with pytest.raises(InvalidSamplingParams, match="needs reasoning_end_token_ids"):
        SamplingParams(reasoning_start_token_id=3)
