"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers' own forward pass on the same
weights: each prompt token's logprob given the tokens before it, and the top-n at its position,
whether the prompt is computed in one step or in chunks, batched with other requests, or already in
the prefix cache (such a prompt is computed again: a cached block has KV but no logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ferry.worker.engine import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(41)]  # 41 tokens: chunks of 16 cut it in three
TOP_N = 3


@pytest.fixture(scope="module")
def reference(llama_dir) -> torch.Tensor:
    """[len(PROMPT), vocab] transformers' log-probabilities at each prompt position."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0].log_softmax(dim=-1)


def _params(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, **extra)


def _check(prompt_logprobs, reference: torch.Tensor, top_n: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        entry, expected = prompt_logprobs[position], reference[position - 1]
        token = PROMPT[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=2e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top_ids = expected.topk(top_n).indices.tolist()
        assert set(top_ids) <= set(entry) and len(entry) in (top_n, top_n + 1)
        assert [entry[t].rank for t in top_ids] == list(range(1, top_n + 1))


@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_match_transformers_whole_or_chunked(llama_dir, reference, budget):
    llm = LLM(str(llama_dir), max_num_batched_tokens=budget)
    plain, scored = llm.generate([PROMPT, PROMPT], [_params(), _params(prompt_logprobs=TOP_N)], use_tqdm=False)
    _check(scored.prompt_logprobs, reference, TOP_N)
    assert plain.prompt_logprobs is None
    assert scored.token_ids == plain.token_ids  # scoring the prompt changes nothing it generates


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llama_dir, reference):
    llm = LLM(str(llama_dir))
    first = llm.generate([PROMPT], _params(), use_tqdm=False)[0]
    again = llm.generate([PROMPT], _params(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache holds the prompt ...
    scored = llm.generate([PROMPT], _params(prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # ... but a scored prompt does not read it
    _check(scored.prompt_logprobs, reference, 0)
    assert scored.token_ids == first.token_ids


def test_a_prompt_of_one_token_has_one_empty_entry(llama_dir):
    out = LLM(str(llama_dir)).generate([[PROMPT[0]]], _params(prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
