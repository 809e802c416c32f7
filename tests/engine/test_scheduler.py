"""Scheduler: token budget, chunked prefill, priority order, preemption victims, abort."""

from __future__ import annotations

from ferry.worker.engine.kv_cache import KVCacheManager
from ferry.worker.engine.request import RequestStatus
from ferry.worker.engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.helpers import make_request


def _scheduler(num_blocks=16, block_size=4, max_num_seqs=8, budget=32, caching=False) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget)


def _advance(sched: Scheduler, out) -> None:
    """What the engine does after a step: count computed tokens, append a token where sampled."""
    for request, n in zip(out.requests, out.num_scheduled_tokens):
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.append_output(7, None)


def _plan(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)]


def test_chunked_prefill_never_stalls_decodes():
    sched = _scheduler(budget=8)
    a = make_request("a", 3)
    sched.add(a)
    out = sched.schedule()
    assert _plan(out) == [("a", 3)]
    _advance(sched, out)
    sched.add(make_request("long", 20))
    out = sched.schedule()
    assert _plan(out) == [("a", 1), ("long", 7)]  # the decode first, the prompt gets the rest
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("a", 1), ("long", 7)]
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("a", 1), ("long", 6)]


def test_waiting_order_is_priority_then_arrival():
    sched = _scheduler(max_num_seqs=2)
    for rid, prio in [("low", 5), ("first", 0), ("second", 0), ("high", -1)]:
        sched.add(make_request(rid, 2, priority=prio))
    assert [r.request_id for r in sched.waiting] == ["high", "first", "second", "low"]
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["high", "first"]  # max_num_seqs = 2
    assert [r.request_id for r in sched.waiting] == ["second", "low"]


def test_token_budget_is_respected():
    sched = _scheduler(budget=10)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4))
    out = sched.schedule()
    assert _plan(out) == [("r0", 4), ("r1", 4), ("r2", 2)]
    assert out.total_tokens == 10


def test_preemption_picks_lowest_priority_latest_arrival_and_recomputes():
    # 4 blocks of 4 tokens. Three requests of 4 tokens fill 3 blocks; each decode needs a new block.
    sched = _scheduler(num_blocks=4, budget=64)
    a, b, c = make_request("a", 4, priority=0), make_request("b", 4, priority=1), make_request("c", 4, priority=0)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert _plan(out) == [("a", 4), ("c", 4), ("b", 4)]  # admitted by priority, then arrival
    assert [r.block_ids for r in (a, c, b)] == [[0], [1], [2]]
    _advance(sched, out)
    out = sched.schedule()
    # a takes block 3; c finds the pool empty: b (priority 1) is the victim, not later-arrived c.
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert _plan(out) == [("a", 1), ("c", 1)]
    assert a.block_ids == [0, 3] and c.block_ids == [1, 2]
    assert sched.num_preemptions == 1
    _advance(sched, out)
    # b keeps its generated token and recomputes prompt + output when it gets back in.
    assert b.all_token_ids[-1] == 7 and b.num_tokens == 5


def test_preempting_itself_when_it_is_the_victim():
    sched = _scheduler(num_blocks=2, budget=64)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    _advance(sched, out)
    out = sched.schedule()
    # a needs a block: b (same priority, later) is preempted; a continues.
    assert [r.request_id for r in out.preempted] == ["b"] and _plan(out) == [("a", 1)]


def test_abort_frees_blocks_from_waiting_and_running():
    sched = _scheduler()
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add(a)
    out = sched.schedule()
    _advance(sched, out)
    sched.add(b)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "abort" and a.block_ids == []
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished()
    sched.finish(a, "abort")  # idempotent


def test_admission_waits_at_the_head_of_line_when_the_pool_is_short():
    sched = _scheduler(num_blocks=3, budget=64)
    big, small = make_request("big", 16, priority=0), make_request("small", 2, priority=1)
    sched.add(make_request("a", 8))
    sched.schedule()
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    # big needs 4 blocks, 1 is free: it waits, and lower-priority small does not jump the queue.
    assert [r.request_id for r in out.requests] == ["a"] and [r.request_id for r in sched.waiting] == ["big", "small"]


def test_next_step_is_full_counts_prompt_tokens_decodes_and_the_sequence_cap():
    sched = _scheduler(budget=8, max_num_seqs=3)
    assert not sched.next_step_is_full()
    a = make_request("a", 3)
    sched.add(a)
    assert not sched.next_step_is_full()  # 3 of 8 tokens: a later arrival could still join
    out = sched.schedule()
    _advance(sched, out)
    sched.add(make_request("b", 6))
    assert not sched.next_step_is_full()  # a's decode (1) + b's prompt (6) = 7 < 8
    sched.add(make_request("c", 1))
    assert sched.next_step_is_full()  # 8 tokens wanted, and 3 sequences = max_num_seqs
    sched.finish(sched.requests["c"], "abort")
    assert not sched.next_step_is_full()
    sched.add(make_request("d", 2))
    assert sched.next_step_is_full()  # 1 + 6 + 2 = 9 tokens (and 3 sequences again)


def test_next_step_is_full_counts_only_what_a_prefix_hit_leaves_to_compute():
    sched = _scheduler(budget=8, caching=True)
    first = make_request("first", 9)
    sched.add(first)
    while first.num_output_tokens == 0:  # prefill (two steps), then its first token
        _advance(sched, sched.schedule())
    sched.finish(first, "stop")  # its two full blocks (8 tokens) stay in the prefix cache
    again = make_request("again", 9)  # the same prompt: 8 of 9 tokens cached, 1 to compute
    sched.add(again)
    assert not sched.next_step_is_full()  # whole, the prompt (9) would have filled the budget (8)
    sched.add(make_request("other", 7, first_token=100))
    assert sched.next_step_is_full()  # 1 + 7 = 8
    out = sched.schedule()
    assert _plan(out) == [("again", 1), ("other", 7)]


def test_a_higher_priority_request_takes_the_slot_of_the_lowest_latest_running_one():
    sched = _scheduler(max_num_seqs=2)
    batch = [make_request(f"batch{i}", 3, priority=2) for i in range(2)]
    for r in batch:
        sched.add(r)
    _advance(sched, sched.schedule())
    sched.add(make_request("live", 3, priority=1))
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["batch1"]  # lowest priority, latest arrival
    assert _plan(out) == [("batch0", 1), ("live", 3)]
    assert batch[1].status is RequestStatus.WAITING and batch[1].num_computed_tokens == 0
    # A peer of the live request takes the other batch slot, never the live one's.
    sched.add(make_request("peer", 3, priority=1))
    _advance(sched, out)
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["batch0"]
    assert _plan(out) == [("live", 1), ("peer", 3)]
    sched.add(make_request("third", 3, priority=1))
    _advance(sched, out)
    out = sched.schedule()
    assert out.preempted == [] and _plan(out) == [("live", 1), ("peer", 1)]  # it waits for a slot


def test_a_higher_priority_request_preempts_for_blocks_when_the_pool_is_short():
    sched = _scheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    low = make_request("low", 12, priority=2)  # 3 of the 4 blocks
    sched.add(low)
    _advance(sched, sched.schedule())
    sched.add(make_request("live", 8, priority=0))  # needs 2 blocks, 1 is free
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["low"]
    assert _plan(out) == [("live", 8)]


def test_a_lower_priority_request_never_preempts():
    sched = _scheduler(max_num_seqs=1)
    sched.add(make_request("live", 3, priority=0))
    _advance(sched, sched.schedule())
    sched.add(make_request("batch", 3, priority=2))
    out = sched.schedule()
    assert out.preempted == [] and _plan(out) == [("live", 1)]


def test_background_decodes_sit_out_a_step_that_prefills_a_foreground_prompt():
    sched = _scheduler(num_blocks=32, budget=32)
    for rid in ("b0", "b1"):
        sched.add(make_request(rid, 3, priority=2, background=True))
    _advance(sched, sched.schedule())
    assert _plan(sched.schedule()) == [("b0", 1), ("b1", 1)]  # decoding, nothing else here
    sched.add(make_request("live", 6, priority=1))
    out = sched.schedule()
    assert _plan(out) == [("live", 6)]  # the batch keeps its blocks but computes nothing this step
    assert not out.preempted and [r.status for r in sched.running] == [RequestStatus.RUNNING] * 3
    _advance(sched, out)
    assert _plan(sched.schedule()) == [("b0", 1), ("b1", 1), ("live", 1)]  # prefilled: all decode again


def test_background_sits_out_every_chunk_of_a_long_foreground_prompt_and_no_step_of_a_decode():
    sched = _scheduler(num_blocks=32, budget=8)
    sched.add(make_request("batch", 2, priority=2, background=True))
    sched.add(make_request("live", 2, priority=0))
    out = sched.schedule()
    assert _plan(out) == [("live", 2)]  # a waiting foreground request holds the batch back at admission too
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("live", 1), ("batch", 2)]
    _advance(sched, out)
    sched.add(make_request("long", 12, priority=1))
    for chunk in (7, 5):  # the budget left after the live decode, then the rest: the batch waits for both
        out = sched.schedule()
        assert _plan(out) == [("live", 1), ("long", chunk)]
        _advance(sched, out)
    assert _plan(sched.schedule()) == [("live", 1), ("batch", 1), ("long", 1)]


def test_the_background_flag_not_the_priority_decides_who_steps_aside():
    """A background request ahead in priority still waits for a foreground prompt's prefill,
    and a foreground one behind it in the queue is admitted past it."""
    sched = _scheduler(num_blocks=32, budget=32)
    sched.add(make_request("batch", 3, priority=0, background=True))
    sched.add(make_request("live", 4, priority=5))
    assert _plan(sched.schedule()) == [("live", 4)]


def test_a_step_the_background_stands_aside_for_does_not_wait_for_arrivals():
    """The worker waits for announced jobs only while the next step could take them: background
    arrivals (a batch's next lines) cannot join a step that prefills a foreground prompt."""
    sched = _scheduler(num_blocks=32, budget=32)
    sched.add(make_request("b0", 3, priority=2, background=True))
    _advance(sched, sched.schedule())
    assert not sched.next_step_is_full()  # one decode: arrivals could still join it
    sched.add(make_request("live", 4, priority=1))
    assert sched.next_step_is_full()
    _advance(sched, sched.schedule())
    assert not sched.next_step_is_full()  # prefilled: every request decodes, room for more


def test_without_background_requests_a_prefill_steps_with_every_decode():
    sched = _scheduler()
    sched.add(make_request("batch", 3, priority=2))
    _advance(sched, sched.schedule())
    sched.add(make_request("live", 4, priority=0))
    assert not sched.next_step_is_full()  # no one steps aside: arrivals may still join the step
    assert _plan(sched.schedule()) == [("batch", 1), ("live", 4)]


def _long_rope_request(rid: str, prompt_len: int):
    request = make_request(rid, prompt_len)
    request.long_rope_after, request.long_rope_cache_extra = 6, b"long"
    return request


def test_a_longrope_sequence_is_recomputed_once_when_it_grows_past_the_switch():
    """Switch at 6 tokens: prefill 5, decode the 6th (still short), then the 7th token makes the
    sequence long: its KV is freed and the whole sequence is scheduled again, with the long
    namespace, in the same step; afterwards it decodes as usual."""
    sched = _scheduler(caching=True)
    a = _long_rope_request("a", 5)
    sched.add(a)
    plans = []
    for _ in range(4):
        out = sched.schedule()
        plans.append(_plan(out))
        _advance(sched, out)
    assert plans == [[("a", 5)], [("a", 1)], [("a", 7)], [("a", 1)]]
    assert a.rope_long and a.cache_extra == b"long" and sched.num_preemptions == 0


def test_a_longrope_sequence_preempted_at_the_switch_is_readmitted_long():
    """Preempted (holding no KV) just as it grew past the switch: it is long when admitted again,
    never recomputed short first."""
    sched = _scheduler()
    a = _long_rope_request("a", 6)
    sched.add(a)
    _advance(sched, sched.schedule())  # 6 prompt tokens, one sampled: 7 > 6
    sched._preempt(a, SchedulerOutput([], []))  # a higher-priority request took its blocks
    assert a.status is RequestStatus.WAITING and not a.rope_long
    out = sched.schedule()
    assert _plan(out) == [("a", 7)] and a.rope_long and a.cache_extra == b"long"
