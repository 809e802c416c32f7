"""Sampler: each parameter changes the distribution as defined."""

from __future__ import annotations

import math

import pytest
import torch

from ferry.worker.engine.sampler import adjust_logits, sample
from tests.engine.helpers import make_request

VOCAB = 50


def _logits(n_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(logits_row: torch.Tensor, n: int, **params) -> list[int]:
    """n draws for one row with the given params (rows batched n-wide, unseeded)."""
    requests = [make_request(f"r{i}", 3, **params) for i in range(n)]
    return sample(logits_row.expand(n, -1).clone(), requests).token_ids


def test_greedy_is_argmax():
    logits = _logits(4)
    requests = [make_request(f"r{i}", 3, temperature=0.0) for i in range(4)]
    assert sample(logits.clone(), requests).token_ids == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_k_largest():
    row = _logits(1)[0]
    allowed = set(row.topk(5).indices.tolist())
    draws = _draws(row, 2000, top_k=5)
    assert set(draws) <= allowed and len(set(draws)) == 5


def test_top_p_keeps_the_smallest_nucleus():
    row = _logits(1, seed=3)[0]
    probs = row.softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    nucleus_size = int((cumulative < 0.6).sum()) + 1  # tokens needed to reach 0.6
    nucleus = set(order[:nucleus_size].tolist())
    draws = _draws(row, 2000, top_p=0.6)
    assert set(draws) <= nucleus and len(set(draws)) == nucleus_size


def test_min_p_drops_unlikely_tokens():
    row = _logits(1, seed=4)[0]
    probs = row.softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    assert set(_draws(row, 2000, min_p=0.2)) <= allowed


def test_temperature_matches_softmax_frequencies():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4))
    n = 20000
    draws = torch.tensor(_draws(row, n, temperature=2.0))
    expected = (row / 2.0).softmax(-1)[:4]
    observed = torch.bincount(draws, minlength=VOCAB)[:4].float() / n
    assert torch.allclose(observed, expected, atol=0.015)


def test_seed_reproduces_whatever_the_batch():
    logits = _logits(3, seed=5)
    alone = sample(logits[1:2].clone(), [make_request("x", 3, seed=42)]).token_ids
    batched = sample(logits.clone(), [make_request("a", 3), make_request("x", 3, seed=42), make_request("b", 3)])
    assert batched.token_ids[1] == alone[0]
    sequence_a = [sample(logits[1:2].clone(), [r]).token_ids[0] for r in [make_request("s", 3, seed=7)] * 20]
    same_seed = make_request("t", 3, seed=7)
    sequence_b = [sample(logits[1:2].clone(), [same_seed]).token_ids[0] for _ in range(20)]
    assert sequence_a == sequence_b and len(set(sequence_a)) > 1


def test_repetition_penalty_follows_transformers_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5] + [0.0] * (VOCAB - 4)])
    request = make_request("r", 0, repetition_penalty=2.0, temperature=0.0)
    request.all_token_ids = [0, 1]  # seen: positive logit divided, negative multiplied
    out = logits.clone()
    assert adjust_logits(out, [request]) == {}
    assert out[0, :4].tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties_count_output_tokens():
    request = make_request("r", 2, presence_penalty=0.5, frequency_penalty=0.25)
    for token in (3, 3, 4):
        request.append_output(token, None)
    out = torch.zeros(1, VOCAB)
    adjust_logits(out, [request])
    assert out[0, 3].item() == pytest.approx(-(0.5 + 2 * 0.25))
    assert out[0, 4].item() == pytest.approx(-(0.5 + 0.25))
    assert out[0, 0].item() == 0.0  # prompt tokens are not penalised by presence/frequency


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 10.0
    logits[0, 8] = 9.0
    request = make_request("r", 3, temperature=0.0, min_tokens=2, stop_token_ids=[8])
    request.eos_token_ids = (9,)
    assert sample(logits.clone(), [request]).token_ids == [logits[0, :8].argmax().item()]
    request.append_output(1, None)
    request.append_output(1, None)
    assert sample(logits.clone(), [request]).token_ids == [9]


def test_logprobs_are_top_n_of_the_raw_distribution_plus_the_sampled_token():
    logits = _logits(1, seed=6)
    request = make_request("r", 3, logprobs=3, top_k=1, temperature=1.0)
    out = sample(logits.clone(), [request])
    entry = out.logprobs[0]
    raw = logits[0].log_softmax(-1)
    top3 = raw.topk(3)
    for rank, (token, value) in enumerate(zip(top3.indices.tolist(), top3.values.tolist()), start=1):
        assert entry[token].rank == rank and math.isclose(entry[token].logprob, value, rel_tol=1e-5)
    assert out.token_ids[0] == top3.indices[0].item()


def test_a_row_whose_own_data_raises_fails_alone():
    good = make_request("good", 1, repetition_penalty=2.0, temperature=0.0, min_tokens=3)
    bad = make_request("bad", 2, repetition_penalty=2.0, temperature=0.0, min_tokens=3)
    bad.params.stop_token_ids.append(VOCAB + 7)  # data no validation let through: an index past the vocabulary
    logits = torch.randn(2, VOCAB)
    alone = logits[:1].clone()
    out = sample(logits, [good, bad])
    assert list(out.failed) == [1] and "IndexError" in out.failed[1]
    assert out.token_ids[0] == sample(alone, [good]).token_ids[0]


def test_logit_bias_forces_bans_and_shifts_only_its_tokens():
    logits = _logits(3, seed=5)
    worst = int(logits[0].argmin())
    best = int(logits[1].argmax())
    rows = [
        make_request("force", 3, temperature=0.0, logit_bias={worst: 100.0}),
        make_request("ban", 3, temperature=0.0, logit_bias={best: -100.0}),
        make_request("none", 3, temperature=0.0),
    ]
    adjusted = logits.clone()
    assert adjust_logits(adjusted, rows) == {}
    assert adjusted[0, worst] == logits[0, worst] + 100 and adjusted[1, best] == logits[1, best] - 100
    assert torch.equal(adjusted[2], logits[2])
    untouched = [i for i in range(VOCAB) if i != worst]
    assert torch.equal(adjusted[0, untouched], logits[0, untouched])
    out = sample(logits.clone(), rows)
    assert out.token_ids[0] == worst and out.token_ids[1] != best


def test_a_logit_bias_past_the_vocabulary_fails_its_row_alone():
    good = make_request("good", 1, temperature=0.0, logit_bias={3: 5.0})
    bad = make_request("bad", 2, temperature=0.0, logit_bias={VOCAB + 7: 5.0})  # what the engine's check refuses
    logits = torch.randn(2, VOCAB)
    out = sample(logits.clone(), [good, bad])
    assert list(out.failed) == [1] and "IndexError" in out.failed[1]
    assert out.token_ids[0] == sample(logits[:1].clone(), [good]).token_ids[0]
