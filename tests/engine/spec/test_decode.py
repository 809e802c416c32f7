"""Speculative decoding: exact greedy outputs, exact sampling distributions, rollback, stops, abort."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferry.worker.engine import Engine, EngineConfig, SamplingParams
from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.outputs import RequestMetrics
from ferry.worker.engine.request import Request, RequestStatus
from ferry.worker.engine.sampler import adjust_logits, sampling_probs
from ferry.worker.engine.scheduler import Scheduler
from ferry.worker.engine.spec.decode import verify
from ferry.worker.engine.spec.governor import SpecGovernor
from ferry.worker.engine.spec.proposers import prompt_lookup
from tests.engine.helpers import make_request

# --- statistics ------------------------------------------------------------------------------------


def chi_square_p_value(counts: dict, probs: dict, n: int) -> float:
    """Pearson's test of n draws against exact probabilities over a partition: outcomes expected
    at least 5 times are bins of their own, the rest (and anything unlisted) one more bin."""
    assert all(probs.get(outcome, 1.0) > 0 for outcome in counts), "drew an outcome of probability 0"
    bins = [o for o, p in probs.items() if p * n >= 5]
    observed = [counts.get(o, 0) for o in bins]
    expected = [probs[o] * n for o in bins]
    rest_expected = n - sum(expected)
    if rest_expected >= 1:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(expected) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


# --- configuration and the pieces ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"method": "medusa"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "ngram_max": 3, "prompt_lookup_max": 3}, "not both"),
        ({"method": "draft"}, "needs draft_model"),
        ({"method": "ngram", "draft_model": "x"}, "only used by method 'draft'"),
        ({"method": "ngram", "lookahead": 3}, "unknown speculative settings"),
        ({"num_speculative_tokens": 3}, "needs a method"),
        ({"method": "ngram", "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_raises(speculative, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative=speculative)


def test_speculative_config_takes_ngram_max():
    cfg = EngineConfig(model="m", speculative={"method": "ngram", "num_speculative_tokens": 3, "ngram_max": 2})
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens, cfg.speculative.prompt_lookup_max) == (
        "ngram",
        3,
        2,
    )


def test_prompt_lookup_continues_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3]
    assert prompt_lookup(tokens, 3, 1, 3) == [4, 5, 6]  # "2 3" last seen before "4 5 6"
    assert prompt_lookup(tokens, 8, 1, 3) == [4, 5, 6, 7, 2, 3, 4, 5]  # past the end: the period repeats
    assert prompt_lookup([5, 6, 5, 6, 5], 5, 1, 4) == [6, 5, 6, 5, 6]
    assert prompt_lookup([8, 8], 3, 1, 4) == [8, 8, 8]
    assert prompt_lookup([1, 2, 3, 4], 2, 1, 3) == []  # no suffix repeats
    assert prompt_lookup([1, 2, 8, 1, 3, 8], 2, 2, 3) == []  # "3 8" never seen; 1-grams not allowed
    assert prompt_lookup([7], 2, 1, 3) == []


def _verifying(request_id: str, proposals: list[int], draft_probs=None, **params) -> Request:
    request = make_request(request_id, 3, **params)
    request.spec.token_ids = list(proposals)
    request.spec.draft_probs = draft_probs
    return request


def test_greedy_verification_accepts_the_matching_prefix_then_the_argmax():
    vocab = 10
    # Argmax per row: 4, 7, 2, 9 (one request with 3 proposals), then 5 (one without proposals).
    logits = torch.zeros(5, vocab)
    for row, token in enumerate([4, 7, 2, 9, 5]):
        logits[row, token] = 3.0
    cases = [([4, 7, 2], [4, 7, 2, 9]), ([4, 7, 1], [4, 7, 2]), ([3, 7, 2], [4])]
    for proposals, expected in cases:
        requests = [_verifying("a", proposals, temperature=0.0), _verifying("b", [], temperature=0.0)]
        assert verify(logits.clone(), requests).token_ids == [expected, [5]]


def test_verification_sees_earlier_proposals_in_its_penalties():
    # Row 1 scores the position after proposal 4: a repetition penalty must count that 4.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 2.9, 3.0]])
    request = _verifying("a", [4], temperature=0.0, repetition_penalty=2.0)
    request.prompt_token_ids = request.all_token_ids = [0, 1]
    assert verify(logits, [request]).token_ids == [[4, 3]]  # 3.0 / 2 < 2.9


VOCAB = 6
TARGET_ROWS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5, -0.5, 1.5]])


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p distribution, computed independently of the sampler."""
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    kept = torch.zeros_like(probs)
    kept[order[before < top_p]] = probs[order[before < top_p]]
    return kept / kept.sum()


@pytest.mark.parametrize("top_p", [1.0, 0.7])
@pytest.mark.parametrize("proposer", ["draft", "point-mass"])
def test_rejection_sampling_reproduces_the_target_distribution(proposer, top_p):
    """Position 1 must follow p0 whatever was proposed; the bonus after an acceptance follows p1."""
    n = 6000
    gen = torch.Generator().manual_seed(11)
    p0, p1 = (_nucleus(row.softmax(-1), top_p) for row in TARGET_ROWS)
    q = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.3, 0.2])  # a poor draft: mass where p has little or none
    requests = []
    for i in range(n):
        if proposer == "draft":
            token = int(torch.multinomial(q, 1, generator=gen))
            requests.append(_verifying(f"r{i}", [token], q[None].clone(), temperature=1.0, top_p=top_p))
        else:  # deterministic proposals: a likely token, an unlikely one (outside the nucleus at top_p 0.7)
            requests.append(_verifying(f"r{i}", [(1, 4)[i % 2]], None, temperature=1.0, top_p=top_p))
    torch.manual_seed(0)
    result = verify(TARGET_ROWS.repeat(n, 1), requests).token_ids
    firsts = Counter(tokens[0] for tokens in result)
    bonuses = Counter(tokens[1] for tokens in result if len(tokens) == 2)
    assert chi_square_p_value(firsts, dict(enumerate(p0.tolist())), n) > 1e-3
    assert chi_square_p_value(bonuses, dict(enumerate(p1.tolist())), sum(bonuses.values())) > 1e-3
    # The acceptance rate itself is sum_x min(p(x), q(x)) (draft) or the mean p(d) (point masses).
    accept = float(torch.minimum(p0, q).sum()) if proposer == "draft" else float(p0[[1, 4]].mean())
    assert abs(sum(bonuses.values()) / n - accept) < 4 * math.sqrt(accept * (1 - accept) / n)
    # And the test has power: the same draws are far from the draft's own distribution.
    assert proposer != "draft" or chi_square_p_value(firsts, dict(enumerate(q.tolist())), n) < 1e-9


# --- scheduler and block manager -------------------------------------------------------------------


def _decoding(sched: Scheduler, *request_ids: str) -> list[Request]:
    """Running requests of 3 prompt tokens, prompt computed and a first output token sampled."""
    requests = [make_request(rid, 3) for rid in request_ids]
    for request in requests:
        sched.add(request)
    out = sched.schedule()
    assert out.requests == requests
    for request in requests:
        request.num_computed_tokens = 3
        request.append_output(7, None)
    return requests


def test_proposals_count_in_the_budget_and_get_lookahead_slots_never_cached():
    sched = Scheduler(KVCacheManager(8, 4, enable_prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=6)
    a, b = _decoding(sched, "a", "b")  # 4 tokens known, 3 computed: one block each
    assert (a.block_ids, b.block_ids) == ([0], [1])
    a.spec.token_ids = [1, 2, 3, 4]
    b.spec.token_ids = [5, 6]
    out = sched.schedule()
    # a: 1 + 4 = 5 tokens, positions 3..7 -> blocks [0, 2]; b gets the last token of budget, no proposals.
    assert list(zip([r.request_id for r in out.requests], out.num_scheduled_tokens, strict=True)) == [
        ("a", 5),
        ("b", 1),
    ]
    assert (a.spec.token_ids, b.spec.token_ids) == ([1, 2, 3, 4], [])
    assert (a.block_ids, b.block_ids) == ([0, 2], [1])
    # Block 0 is full of known tokens and is cached; block 2 holds only proposals and is not.
    assert sched.kv.block_meta[0] is not None and sched.kv.block_meta[2] is None


def test_a_short_pool_drops_proposals_before_preempting():
    sched = Scheduler(KVCacheManager(2, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _decoding(sched, "a", "b")
    a.spec.token_ids = [1, 2, 3]  # would need a third block
    out = sched.schedule()
    assert not out.preempted and out.num_scheduled_tokens == [1, 1]
    assert a.spec.token_ids == [] and b.status is RequestStatus.RUNNING


def test_trim_returns_rejected_positions_blocks_to_the_front_of_the_queue():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    request = make_request("a", 3)
    kv.allocate(request, 3, lookahead=6)  # 9 slots: blocks 0, 1, 2
    assert request.block_ids == [0, 1, 2]
    request.num_computed_tokens = 5  # two of six proposals accepted
    kv.trim(request)
    assert request.block_ids == [0, 1] and list(kv.free_queue)[0] == 2 and kv.num_free_blocks == 4


def test_governor_speculates_where_measured_faster_and_probes_the_other_side():
    governor = SpecGovernor(min_samples=2, probe_every=4, max_probe_every=8)
    for _ in range(2):
        assert governor.choose(8)  # nothing measured: speculate first ...
        governor.observe(8, True, 24, 0.1)  # 240 tokens/s
    for _ in range(2):
        assert not governor.choose(8)  # ... then measure without
        governor.observe(8, False, 8, 0.02)  # 400 tokens/s: plain wins
    # Probes of the slower side after 4 decisions, then 8, then (at most) 8 again.
    assert [governor.choose(8) for _ in range(20)] == [False] * 3 + [True] + ([False] * 7 + [True]) * 2
    assert governor.choose(2)  # another batch size is measured on its own
    for _ in range(10):
        governor.observe(8, True, 40, 0.05)  # speculation got faster (acceptance rose): 800 tokens/s
    assert [governor.choose(8) for _ in range(4)] == [True, True, True, False]


def test_governor_switches_on_one_probe_that_finds_the_slower_side_faster_now():
    governor = SpecGovernor(min_samples=3, probe_every=4, max_probe_every=8, probe_budget=1.0)
    for speculate in (True, True, True, False, False, False):
        assert governor.choose(8) is speculate
        governor.observe(8, speculate, 8, 0.1 if speculate else 0.02)  # 80 vs 400 tokens/s
    assert _plain_steps_before_the_next_probe(governor, 0.02) == 3  # the probe ...
    governor.observe(8, True, 40, 0.05)  # ... finds the text repeating: 800 tokens/s, against three stale 80s
    assert governor.choose(8) is True  # one more step to confirm
    governor.observe(8, True, 32, 0.05)
    assert [governor.choose(8) for _ in range(3)] == [True] * 3  # switched, not after 2 more probes
    governor.observe(8, True, 8, 0.1)
    governor.observe(8, True, 8, 0.1)  # the probe was luck: the median of its side's last three is 80 again
    assert governor.choose(8) is False


def test_governor_does_not_switch_on_one_lucky_probe_step():
    governor = SpecGovernor(min_samples=3, probe_every=4, max_probe_every=8, probe_budget=1.0)
    for speculate in (True, True, True, False, False, False):
        assert governor.choose(8) is speculate
        governor.observe(8, speculate, 8, 0.1 if speculate else 0.02)  # 80 vs 400 tokens/s
    assert _plain_steps_before_the_next_probe(governor, 0.02) == 3
    governor.observe(8, True, 40, 0.05)  # every proposal accepted, once: 800 tokens/s
    assert governor.choose(8) is True  # confirming ...
    governor.observe(8, True, 8, 0.1)  # ... finds the usual 80: 48 tokens in 0.15 s, below plain
    # Plain all along: the probes stay at their doubled interval (8), where a switch there and back
    # would have started them again from probe_every (4).
    assert _plain_steps_before_the_next_probe(governor, 0.02) == 7


def test_governor_rates_a_side_by_its_tokens_over_its_time_leaving_out_stalls():
    # Verifications emit 1 token or all 5 (acceptance about 0.4): 2.6 tokens per 5 ms step on
    # average is 520 tokens/s, above plain's 400; the median step's 1 token (200 tokens/s) is not.
    governor = SpecGovernor(min_samples=5, probe_every=64, max_probe_every=64)
    for tokens in (1, 5, 1, 5, 1):
        assert governor.choose(1)
        governor.observe(1, True, tokens, 0.005)
    for _ in range(5):
        assert not governor.choose(1)
        governor.observe(1, False, 1, 0.0025)
    assert governor.choose(1)
    governor.observe(1, True, 1, 0.05)  # a step stalled 10x by another process: left out
    assert governor.choose(1)
    governor.observe(1, True, 1, 0.0145)  # slow, not stalled (under 3x): 14 tokens in 0.0395 s
    assert not governor.choose(1)


def test_governor_repeats_a_probe_that_could_not_be_timed():
    governor = SpecGovernor(min_samples=1, probe_every=2, max_probe_every=8)
    for speculate in (True, False):
        assert governor.choose(8) is speculate
        governor.observe(8, speculate, 8 if speculate else 8, 0.1 if speculate else 0.02)  # plain 5x faster
    assert governor.choose(8) is False
    assert governor.choose(8) is True  # the probe ...
    governor.unmeasured(8)  # ... went untimed (the draft caught up first): probe again
    assert governor.choose(8) is True
    governor.unmeasured(8)
    assert governor.choose(8) is True
    governor.unmeasured(8)  # the third untimed step gives the probe up until the next interval
    assert [governor.choose(8) for _ in range(3)] == [False] * 3
    governor.unmeasured(8)  # an untimed step that was no probe changes nothing
    assert governor.choose(8) is True  # the next probe, 4 decisions after the last
    governor.observe(8, True, 8, 0.1)
    assert [governor.choose(8) for _ in range(7)] == [False] * 7


def _plain_wins(governor: SpecGovernor, plain_step: float) -> None:
    """Measure both sides once (min_samples=1): speculation 0.125 s a step, plain `plain_step`."""
    for speculate in (True, False):
        assert governor.choose(8) is speculate
        governor.observe(8, speculate, 8, 0.125 if speculate else plain_step)
    assert governor.choose(8) is False
    governor.observe(8, False, 8, plain_step)
    assert governor.choose(8) is True  # the first probe, after the interval: nothing paid for yet


def _plain_steps_before_the_next_probe(governor: SpecGovernor, plain_step: float, limit: int = 2000,
                                      missed_per_step: int = 0) -> int:
    """Plain steps of 8 tokens until the governor speculates; the draft, idle meanwhile, misses
    `missed_per_step` tokens a step (what the engine's proposer would report as its catch-up)."""
    steps = 0
    while steps < limit and not governor.choose(8, missed_per_step * steps):
        governor.observe(8, False, 8, plain_step)
        steps += 1
    return steps


def test_governor_spaces_probes_by_what_they_cost():
    # Binary fractions throughout, so the budget arithmetic is exact.
    governor = SpecGovernor(min_samples=1, probe_every=2, max_probe_every=2, probe_budget=0.125)
    plain_step = 1 / 64  # 8 tokens: 512 tokens/s
    _plain_wins(governor, plain_step)
    governor.observe(8, True, 8, 0.125)  # the probe: 0.109375 s more than plain would have taken
    # The next probe waits until plain steps have run 0.109375 / 0.125 = 0.875 s: 56 steps, not 2.
    assert _plain_steps_before_the_next_probe(governor, plain_step) == 56


@pytest.mark.parametrize(("seconds_per_token", "plain_steps"), [(1 / 1024, 2000), (1 / 16384, 1)])
def test_governor_runs_the_draft_again_only_where_catching_up_fits_the_budget(seconds_per_token, plain_steps):
    governor = SpecGovernor(min_samples=1, probe_every=2, max_probe_every=2, probe_budget=0.125)
    plain_step = 1 / 64  # 8 tokens
    governor.note_running(["a", "b"])
    assert governor.choose(8, 256) is True  # the first measurement; the draft first feeds on the prompts:
    governor.observe(8, True, 8, 256 * seconds_per_token, caught_up_tokens=256)
    governor.unmeasured(8)
    assert governor.choose(8) is True  # nothing missed since: measured now
    governor.observe(8, True, 8, 0.125)
    assert governor.choose(8) is False
    governor.observe(8, False, 8, plain_step)  # plain is faster
    # Each plain step leaves the draft 8 tokens to catch up on: 1/128 s of a 1/64 s step, over the
    # budget's eighth, so no probe while these requests run; at 1/2048 s, the probe after the interval.
    assert _plain_steps_before_the_next_probe(governor, plain_step, missed_per_step=8) == plain_steps


def test_governor_keeps_its_choice_when_the_requests_turn_over_and_probes_again_soon():
    # A probe costs 0.01 s over plain; a budget of a quarter lets one follow 2 plain steps.
    governor = SpecGovernor(min_samples=2, probe_every=4, max_probe_every=64, probe_budget=0.25)

    def run(decisions: int) -> list[int]:
        """Decide and observe `decisions` steps (speculation 0.03 s, plain 0.02 s, 8 tokens each);
        the indices of those that speculated."""
        chosen = []
        for i in range(decisions):
            speculate = governor.choose(4)
            governor.observe(4, speculate, 8, 0.03 if speculate else 0.02)
            chosen += [i] if speculate else []
        return chosen

    governor.note_running(["a", "b", "c", "d"])
    assert run(4) == [0, 1]  # measured: speculation first, then plain, which is faster
    assert run(4 + 8 + 16 + 32) == [3, 11, 27, 59]  # probes confirm plain at doubling intervals
    governor.note_running(["a", "b", "e", "f"])  # half still running: the same workload
    assert run(1) == [] and governor.turnovers == 0
    governor.note_running(["e", "f", "g", "h"])  # all new: plain stays the choice, no measuring afresh ...
    assert governor.turnovers == 1
    # ... but their acceptance is unknown: the next probe comes after probe_every decisions, not 64.
    assert run(4) == [3]


def _decisions_with_quiet_stretches(governor: SpecGovernor, steps: int, plain_step: float) -> list[bool]:
    """What SpecDecoder does: after a plain decision, the plain steps the governor grants run
    undecided and untimed, then are accounted for at once. Per step: whether it speculated."""
    out, quiet, taken = [], 0, 0
    for _ in range(steps):
        if quiet:
            quiet, taken = quiet - 1, taken + 1
            out.append(False)
            continue
        if taken:
            governor.note_quiet(8, taken, taken * plain_step)
            taken = 0
        speculate = governor.choose(8)
        governor.observe(8, speculate, 8, 0.125 if speculate else plain_step)
        if not speculate:
            quiet = governor.quiet_steps(8)
        out.append(speculate)
    return out


def test_governor_quiet_plain_stretches_keep_the_probe_schedule():
    plain_step = 1 / 64
    timed, quiet = (SpecGovernor(min_samples=1, probe_every=16, max_probe_every=32) for _ in range(2))
    for governor in (timed, quiet):  # measured: speculation 0.125 s a step, plain 1/64 s
        for speculate in (True, False):
            assert governor.choose(8) is speculate
            governor.observe(8, speculate, 8, 0.125 if speculate else plain_step)
    every_step = []
    for _ in range(400):
        every_step.append(timed.choose(8))
        timed.observe(8, every_step[-1], 8, 0.125 if every_step[-1] else plain_step)
    stretched = _decisions_with_quiet_stretches(quiet, 400, plain_step)
    probes = [i for i, d in enumerate(every_step) if d]
    probes_stretched = [i for i, d in enumerate(stretched) if d]
    # The first probe is due after 16 decisions: at the same step. Later ones wait on the budget
    # (a probe's 0.11 s over plain needs 4.4 s of plain steps at 2.5%): at most _QUIET_MAX steps
    # later, since a quiet stretch does not look at the budget. Most plain steps went undecided.
    assert len(probes) == len(probes_stretched) >= 2 and probes[0] == probes_stretched[0] == 15
    assert all(0 <= b - a <= 7 for a, b in zip(probes, probes_stretched, strict=True))
    assert sum(stretched) == sum(every_step)
    bucket = (8).bit_length()
    assert quiet._buckets[bucket].plain.samples * 5 < timed._buckets[bucket].plain.samples  # decided: 1 step in 8


@pytest.mark.parametrize(("spec_step", "catch_up", "expected"), [
    (0.1, 100, [False] * 4),  # plain won: a 0.1 s catch-up waits for 0.8 s of plain steps, no probe yet
    (0.1, 0, [False] * 3 + [True]),  # plain won, nothing to catch up on: the probe after probe_every
    (0.005, 100, [True] * 3 + [False]),  # speculation won: its catch-up is paid at once; plain probed later
])
def test_governor_pays_a_new_prompt_catch_up_only_where_speculation_won(spec_step, catch_up, expected):
    governor = SpecGovernor(min_samples=1, probe_every=4, max_probe_every=4, probe_budget=0.125)
    governor.note_running(["a"])
    assert governor.choose(1, 100)  # the first measurement, catch-up included (0.1 s)
    governor.observe(1, True, 1, 100 / 1024, caught_up_tokens=100)
    governor.unmeasured(1)
    assert governor.choose(1)
    governor.observe(1, True, 3, spec_step)
    assert not governor.choose(1)
    governor.observe(1, False, 1, 0.02)
    governor.note_running(["b"])  # a new request: its whole prompt is the draft's to catch up on
    decisions = []
    for _ in range(4):
        decisions.append(governor.choose(1, catch_up))
        governor.observe(1, decisions[-1], 3 if decisions[-1] else 1, spec_step if decisions[-1] else 0.02)
    assert decisions == expected


# --- the engine ------------------------------------------------------------------------------------

# Tests that count proposals turn the timing governor off: on a busy CPU it may rightly decide
# that tiny models decode faster without speculation.
EVERY_STEP = {"measure_speedup": False}


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def small_draft(tiny_model_factory):
    """Unrelated random weights, same tokenizer: nearly every proposal is rejected."""
    return str(tiny_model_factory("llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1))


@pytest.fixture(scope="module")
def sharp_pair(tiny_model_factory, tmp_path_factory):
    """A target with peaked next-token distributions, and as its draft its own first layer
    (same embeddings and head): proposals are accepted about a quarter to a third of the time."""
    target_dir = tiny_model_factory("llama", initializer_range=0.8)
    draft_dir = tmp_path_factory.mktemp("sharp-draft")
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(draft_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(draft_dir)
    return str(target_dir), str(draft_dir)


def _specs(target, small_draft) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, **EVERY_STEP},
        "draft-rejected": {"method": "draft", "draft_model": small_draft, "num_speculative_tokens": 3, **EVERY_STEP},
        "draft-accepted": {"method": "draft", "draft_model": target, "num_speculative_tokens": 4, **EVERY_STEP},
    }


PROMPT_LENGTHS = [1, 3, 7, 12, 16, 17, 33, 50]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _params(i: int, max_tokens: int = 32) -> SamplingParams:
    # Half the requests repeat themselves (a repetition penalty below 1), which n-gram proposals catch.
    penalty = 0.3 if i % 2 else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)


def _check_blocks(engine: Engine, exact: bool) -> None:
    """Blocks cover the computed tokens (exactly, when no proposal slots are held between steps);
    every cached block holds the request's verified tokens, never a rejected proposal."""
    bs, kv = engine.block_size, engine.kv
    k = engine.spec.config.num_speculative_tokens if engine.spec else 0
    for r in engine.scheduler.running:
        low = -(-r.num_computed_tokens // bs)
        high = low if exact else -(-(r.num_computed_tokens + k) // bs)
        assert low <= len(r.block_ids) <= high
        for i, block in enumerate(r.block_ids):
            meta = kv.block_meta[block]
            if meta is not None:
                assert meta.token_ids == tuple(r.all_token_ids[i * bs : (i + 1) * bs])


def _bytes_per_block(engine: Engine) -> int:
    pools = [engine.runner.kv_cache]
    if engine.spec is not None and hasattr(engine.spec.proposer, "runner"):
        pools.append(engine.spec.proposer.runner.kv_cache)  # the draft's pool, same block count
    return sum(pool[:, :, 0].numel() * pool.element_size() for pool in pools)


def _generate(engine: Engine, prompts, params, check_blocks: bool = True) -> list[list[int]]:
    before = engine.stats()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    metrics = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            metrics[out.request_id] = out.metrics
        if check_blocks:
            _check_blocks(engine, exact=engine.spec is None or engine.spec.config.method == "ngram")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and sum(engine.kv.ref_counts) == 0
    after = engine.stats()  # the requests' own counts add up to what the engine counted meanwhile
    assert sum(m.num_preemptions for m in metrics.values()) == after.num_preemptions - before.num_preemptions
    if after.spec_decode is not None:
        now, was = after.spec_decode, before.spec_decode
        assert sum(m.num_draft_tokens for m in metrics.values()) == now.num_draft_tokens - was.num_draft_tokens
        assert sum(m.num_accepted_tokens for m in metrics.values()) == now.num_accepted_tokens - was.num_accepted_tokens
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def greedy_reference(target):
    prompts = _prompts()
    params = [_params(i) for i in range(len(prompts))]
    return prompts, params, _generate(Engine(target), prompts, params)


@pytest.mark.parametrize("method", ["ngram", "draft-rejected", "draft-accepted"])
@pytest.mark.parametrize("setting", ["chunked-prefill", "preemption"])
def test_greedy_output_is_identical_to_non_speculative(target, small_draft, greedy_reference, method, setting):
    prompts, params, expected = greedy_reference
    spec = _specs(target, small_draft)[method]
    if setting == "chunked-prefill":  # 8 tokens a step: prompts split, proposals cut to what fits
        engine = Engine(target, speculative=spec, max_num_batched_tokens=8, enable_prefix_caching=False)
    else:  # 12 blocks of 16 for 8 requests of up to 82 tokens (and the draft's KV from the same budget)
        per_block = _bytes_per_block(Engine(target, speculative=spec, max_model_len=128))
        engine = Engine(target, speculative=spec, max_model_len=128, kv_cache_bytes=12 * per_block)
    assert _generate(engine, prompts, params) == expected
    stats = engine.stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    spec_stats = stats.spec_decode
    assert spec_stats.num_draft_tokens > 0
    if method == "draft-accepted":
        assert spec_stats.acceptance_rate > 0.9 and spec_stats.mean_accepted_length > 3
    elif method == "ngram":
        assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens


def _run_one(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
    engine.add_request(request_id, prompt, params)
    result = {"tokens": [], "text": "", "logprobs": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            result["tokens"] += out.new_token_ids
            result["text"] += out.new_text
            result["logprobs"] += out.new_logprobs or []
            if out.finished:
                result["reason"], result["stop_reason"] = out.finish_reason, out.stop_reason
    return result


@pytest.mark.parametrize("method", ["ngram", "draft-accepted"])
def test_greedy_output_is_identical_with_the_speedup_governor_deciding(target, small_draft, greedy_reference, method):
    """The governor on, as users run it: whatever it decides from this machine's timings
    (speculating, probing, quiet plain stretches that end as requests finish), the tokens are
    the non-speculative ones and no block is left behind."""
    prompts, params, expected = greedy_reference
    spec = {k: v for k, v in _specs(target, small_draft)[method].items() if k != "measure_speedup"}
    engine = Engine(target, speculative=spec)
    assert engine.spec.governor is not None
    for _ in range(2):  # the second time, with what the first taught it
        assert _generate(engine, prompts, params) == expected


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_greedy_output_is_identical_for_every_architecture(tiny_model_factory, arch):
    """Attention bias (Qwen2), q/k norms (Qwen3), Mistral's config: n-gram, a small draft of the
    same family and the target as its own draft all give the non-speculative tokens."""
    target = str(tiny_model_factory(arch))
    small = str(tiny_model_factory(arch, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=1))
    prompts = _prompts()[:5]
    params = [_params(i, max_tokens=20) for i in range(len(prompts))]
    expected = _generate(Engine(target), prompts, params)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft", "draft_model": small, "num_speculative_tokens": 3},
        {"method": "draft", "draft_model": target, "num_speculative_tokens": 3},
    ):
        engine = Engine(target, speculative={**spec, **EVERY_STEP})
        assert _generate(engine, prompts, params) == expected, spec
        assert engine.stats().spec_decode.num_draft_tokens > 0
    assert engine.stats().spec_decode.acceptance_rate > 0.9  # its own draft


def test_stop_conditions_cut_an_accepted_run(target):
    """With the target as its own draft nearly every proposal is accepted: stops fall inside runs."""
    base_engine = Engine(target)
    spec_engine = Engine(
        target, speculative={"method": "draft", "draft_model": target, "num_speculative_tokens": 4, **EVERY_STEP}
    )
    prompt = [5, 6, 7, 8, 9]
    base = _run_one(base_engine, "base", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    stop_token = base["tokens"][5]
    first = base["tokens"].index(stop_token)
    stop_text = next(base["text"][i : i + 3] for i in range(6, 30) if "\ufffd" not in base["text"][i : i + 3])
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token], logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token], min_tokens=first + 2),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_text]),
    ]
    for i, params in enumerate(cases):
        expected = _run_one(base_engine, f"b{i}", prompt, params)
        got = _run_one(spec_engine, f"s{i}", prompt, params)
        assert got["tokens"] == expected["tokens"] and got["text"] == expected["text"]
        assert (got["reason"], got["stop_reason"]) == (expected["reason"], expected["stop_reason"])
        for a, b in zip(got["logprobs"], expected["logprobs"], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert expected["reason"] == "stop" and expected["stop_reason"] == stop_text
    assert spec_engine.stats().spec_decode.acceptance_rate > 0.9
    short = Engine(target, max_model_len=20, speculative={"method": "draft", "draft_model": target, **EVERY_STEP})
    result = _run_one(short, "m", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert result["tokens"] == base["tokens"][:15] and result["reason"] == "length"
    assert short.stats().spec_decode.num_accepted_tokens > 0


def _exact_joint(model_dir: str, prompt: list[int], params: SamplingParams, depth: int, n: int) -> dict:
    """The non-speculative engine's distribution of the first `depth` tokens: the target's
    logits (transformers) under the sampler's own transforms. Lists every outcome whose
    probability could reach 5/n (prefixes below it are not expanded)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    frontier = {(): 1.0}
    for _ in range(depth):
        contexts = list(frontier)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(c) for c in contexts])).logits[:, -1].float()
        rows = []
        for context in contexts:
            request = Request("x", list(prompt), params.resolved({}, depth), 0, 0, RequestMetrics(0.0))
            for token in context:
                request.append_output(token, None)
            rows.append(request)
        adjust_logits(logits, rows)
        probs = sampling_probs(logits, rows)
        frontier = {
            c + (t,): frontier[c] * p
            for c, row in zip(contexts, probs, strict=True)
            for t, p in enumerate(row.tolist())
            if frontier[c] * p * n >= 5
        }
    return frontier


@pytest.mark.parametrize(
    ("method", "prompt", "params"),
    [
        ("draft", [100, 200, 100, 200, 100], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)),
        ("draft", [100, 200, 100, 200, 100], SamplingParams(max_tokens=4, temperature=1.0, top_p=0.8, ignore_eos=True)),
        (
            "ngram",
            [285, 227, 10, 227, 285],
            SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, repetition_penalty=0.5, ignore_eos=True),
        ),
    ],
    ids=["draft-t1", "draft-top-p", "ngram-top-p-penalty"],
)
def test_sampled_tokens_follow_the_target_distribution(sharp_pair, method, prompt, params):
    """Token 1 comes from the prefill; tokens 2 and 3 from a verification of up to 2 proposals."""
    target_dir, draft_dir = sharp_pair
    n = 1500
    spec = {"method": method, "num_speculative_tokens": 2, **EVERY_STEP}
    if method == "draft":
        spec["draft_model"] = draft_dir
    engine = Engine(target_dir, speculative=spec, max_num_seqs=256, max_num_batched_tokens=1024)
    outputs = _generate(engine, [prompt] * n, [params] * n, check_blocks=False)
    counts = Counter(tuple(tokens[:3]) for tokens in outputs)
    stats = engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both branches taken
    assert chi_square_p_value(counts, _exact_joint(target_dir, prompt, params, 3, n), n) > 1e-3


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_requests_give_the_non_speculative_tokens_in_any_batch(sharp_pair, method):
    """Seeded rows are verified by coupling on the seed's own noise: the tokens are those of the
    non-speculative engine, whatever the batch, the budget or the proposals did."""
    target_dir, draft_dir = sharp_pair
    spec = {"method": method, "num_speculative_tokens": 3, **EVERY_STEP}
    if method == "draft":
        spec["draft_model"] = draft_dir
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True, repetition_penalty=0.7)
    other = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    prompt = [285, 227, 10, 227, 285]
    plain = _generate(Engine(target_dir), [prompt], [seeded])[0]
    alone_engine = Engine(target_dir, speculative=spec)
    alone = _generate(alone_engine, [prompt], [seeded])[0]
    crowded = Engine(target_dir, speculative=spec, max_num_batched_tokens=6)
    batched = _generate(crowded, [[9, 9], prompt, [4]], [other, seeded, other])[1]
    assert alone == plain == batched and len(plain) == 24
    assert alone_engine.stats().spec_decode.num_accepted_tokens > 0


def test_abort_between_verifications_leaves_nothing_behind(target, greedy_reference):
    """Aborts land while requests hold accepted runs, and (a 12-token budget leaves some out of
    a step) draft lookahead slots for proposals that were never verified."""
    prompts, params, expected = greedy_reference
    spec = {"method": "draft", "draft_model": target, "num_speculative_tokens": 4}
    engine = Engine(target, speculative=spec, max_num_batched_tokens=12)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    reasons = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
        victim = {2: "r1", 3: "r3", 6: "r5"}.get(step)  # each mid-generation, holding verified runs
        if victim is not None:
            assert engine.abort(victim)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and sum(engine.kv.ref_counts) == 0
    for i in range(len(prompts)):
        rid = f"r{i}"
        if rid in ("r1", "r3", "r5"):
            assert reasons[rid] == "abort" and tokens[rid] == expected[i][: len(tokens[rid])]
        else:
            assert reasons[rid] == "length" and tokens[rid] == expected[i]


def test_speculation_pauses_where_it_does_not_pay(target, small_draft):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = {"method": "draft", "draft_model": small_draft, "num_speculative_tokens": 3, **EVERY_STEP}
    eager = Engine(target, speculative={**spec, "min_acceptance_rate": 0.0})
    patient = Engine(target, speculative={**spec, "min_acceptance_rate": 0.5, "pause_steps": 10})
    assert _generate(eager, [[5, 6, 7]], [params]) == _generate(patient, [[5, 6, 7]], [params])
    # Every decode step proposes without pausing; with it, one probe per pause.
    assert eager.stats().spec_decode.num_drafts >= 30
    assert patient.stats().spec_decode.num_drafts <= 6
    crowded = Engine(target, speculative={**spec, "disable_by_batch_size": 3})
    _generate(crowded, [[5], [6], [7]], [params] * 3)
    assert crowded.stats().spec_decode.num_drafts == 0


def test_the_draft_reports_the_catch_up_its_next_proposal_would_cost(target):
    """What the governor charges a probe: every token the draft model has not yet fed on, beyond
    the newest one of each request (a whole prompt the first time)."""
    spec = {"method": "draft", "draft_model": target, "num_speculative_tokens": 3, **EVERY_STEP}
    engine = Engine(target, speculative=spec)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(5, 25)), params)  # 20 prompt tokens
    engine.add_request("b", list(range(30, 37)), params)  # 7
    proposer = engine.spec.proposer
    running = engine.scheduler.running
    engine.spec.propose = lambda requests: None  # hold the draft back for two steps
    engine.step()  # the prompts, and a first token each
    engine.step()  # one more token each, the draft still idle
    assert proposer.pending_catch_up(running) == (20 + 1) + (7 + 1)
    del engine.spec.propose
    engine.step()  # the draft catches up and proposes; the target accepts all of it
    assert proposer.catch_up_total == (20 + 2) + (7 + 2)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
    assert proposer.pending_catch_up(running) <= len(running)  # at most the bonus token each


def test_draft_with_another_tokenizer_is_refused(target, tiny_model_factory):
    other = tiny_model_factory("llama", vocab_size=300)
    with pytest.raises(ValueError, match="different tokenizer"):
        Engine(target, speculative={"method": "draft", "draft_model": str(other)})
