"""The engine loop on its own: a real engine on a tiny model, jobs handed in as the intake hands
them, and the writes it hands the publisher collected as they come (no Redis)."""

from __future__ import annotations

import contextlib
import json
import queue
import time

import pytest

from ferry.worker.engine import LLM, Engine, SamplingParams
from ferry.worker.protocol import ErrorCode, JobRequest
from ferry.worker.serve.engine_loop import EngineLoop
from ferry.worker.serve.job_output import BACKGROUND_FLUSH_TOKENS
from ferry.worker.serve.job_starts import JobStart, Streamed
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.pacing import BackgroundPacing
from ferry.worker.serve.render import PromptRenderer
from ferry.worker.serve.writes import Delivery, Finish, HandBack, Progress

PROMPT = "The quick brown fox jumps over the lazy dog. Pack my box"


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine(llama_dir, kv_cache_bytes=16 << 20, max_model_len=256)


_renderer: list[PromptRenderer] = []  # the intake's renderer for the tiny model (set once per module)


@pytest.fixture(scope="module", autouse=True)
def renderer(llama_dir):
    _renderer.append(PromptRenderer.for_model(llama_dir, "hermes"))
    yield
    _renderer.clear()


def running_loop(engine, pacing: BackgroundPacing | None = None):
    """An engine loop on its thread, its writes collected in `.writes`; stopped (engine empty) after."""
    writes: queue.SimpleQueue = queue.SimpleQueue()
    runner = EngineLoop(engine, "w1", WorkerMetrics(), lambda batch: [writes.put(w) for w in batch],
                        pacing=pacing or BackgroundPacing())
    runner.thread.start()
    runner.writes = writes
    yield runner
    runner.stop.set()
    runner.thread.join(10)
    assert not engine.has_unfinished_requests()


@pytest.fixture
def loop(engine):
    yield from running_loop(engine)


def job(job_id: str, streamed: Streamed | None = None, timeout_s: float = 60.0, **fields) -> JobStart:
    request = JobRequest(**{"model": "tiny", "prompt": PROMPT, "temperature": 0.0, "ignore_eos": True, "max_tokens": 12,
                            **fields})
    now = time.time()
    return JobStart(job_id, Delivery("q", f"{job_id}-0", {"job_id": job_id, "attempt": "1"}), request,
                    _renderer[0].render(request), 1, now, None, now + timeout_s, streamed or Streamed([], "", 1))


def until_finished(loop, job_id: str, timeout: float = 30.0) -> list:
    """Every write for `job_id` until (and with) its Finish or HandBack."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            write = loop.writes.get(timeout=0.1)
        except queue.Empty:
            continue
        if getattr(write, "job_id", None) == job_id:
            got.append(write)
            if isinstance(write, Finish | HandBack):
                return got
    raise AssertionError(f"no end for {job_id}: {got}")


def events(writes: list) -> list:
    return [e for w in writes for e in w.events]


def reference(llama_dir, max_tokens: int = 12, **params):
    llm = LLM(llama_dir, kv_cache_bytes=16 << 20, max_model_len=256)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    return llm.generate([PROMPT], sampling, use_tqdm=False)[0]


def test_a_job_streams_its_tokens_in_order_and_finishes_with_its_result(loop, llama_dir):
    loop.start([job("a")], arrived=1)
    writes = until_finished(loop, "a")
    evs = events(writes)
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1))  # seq 0 (started) was the intake's
    assert evs[-1].type == "completed" and evs[-1].finish_reason == "length"
    assert isinstance(writes[0], Progress) and writes[0].first_token_at is not None
    expected = reference(llama_dir)
    final = writes[-1]
    assert json.loads(final.result["token_ids"]) == expected.token_ids
    assert final.result["text"] == expected.text == "".join(e.text for e in evs if e.type == "token")
    assert final.state == "succeeded" and evs[-1].usage.completion_tokens == 12


def streamed_until(llama_dir, cut: int, **params) -> Streamed:
    """What a client had of a run interrupted after `cut` tokens: the tokens and the text released by then."""
    engine = Engine(llama_dir, kv_cache_bytes=16 << 20, max_model_len=256)
    sampling = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **params})
    engine.add_request("first", PROMPT, sampling)
    tokens, text = [], ""
    while len(tokens) < cut:
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.new_text
    engine.abort("first")
    engine.step()
    return Streamed(tokens, text, 7)


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_job_continues_where_the_client_left_off(loop, llama_dir, cut):
    expected = reference(llama_dir)
    streamed = streamed_until(llama_dir, cut)
    loop.start([job("r", streamed)], arrived=1)
    writes = until_finished(loop, "r")
    evs = events(writes)
    assert evs[0].seq == 7 and [e.seq for e in evs] == list(range(7, 7 + len(evs)))
    assert streamed.text + "".join(e.text for e in evs if e.type == "token") == expected.text
    assert json.loads(writes[-1].result["token_ids"]) == expected.token_ids
    assert writes[-1].result["text"] == expected.text


def test_a_stop_string_across_the_resume_point_ends_the_job_there(loop, llama_dir):
    expected = reference(llama_dir, max_tokens=24)
    tokens = expected.token_ids
    llm = LLM(llama_dir, kv_cache_bytes=16 << 20, max_model_len=256)
    tok = llm.tokenizer
    # A stop string made of the end of token 4's text and the start of token 5's: it is complete
    # only once the resumed run generates token 5.
    head = tok.decode(tokens[:5], skip_special_tokens=True)
    full = tok.decode(tokens[:6], skip_special_tokens=True)
    stop = head[-2:] + full[len(head):][:2]
    if len(stop) < 3 or expected.text.find(stop) != len(head) - 2:
        pytest.skip("this tiny model's text has no usable straddling stop string")
    streamed_text = tok.decode(tokens[:5], skip_special_tokens=True)[: len(head) - 2]  # held back: could start a stop
    loop.start([job("s", Streamed(tokens[:5], streamed_text, 6), max_tokens=24, stop=[stop])], arrived=1)
    writes = until_finished(loop, "s")
    final = events(writes)[-1]
    assert final.type == "completed" and final.finish_reason == "stop" and final.stop_reason == stop
    assert writes[-1].result["text"] == expected.text[: expected.text.index(stop)]


def test_cancel_writes_the_cancelled_event_and_a_lost_job_writes_nothing(loop):
    loop.start([job("c", max_tokens=1000), job("l", max_tokens=1000)], arrived=2)
    loop.abort("c")
    writes = until_finished(loop, "c")
    assert events(writes)[-1].type == "cancelled" and writes[-1].state == "cancelled"
    loop.abort("l", lost=True)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and "l" in loop.runs:
        time.sleep(0.01)
    assert "l" not in loop.runs
    while not loop.writes.empty():
        write = loop.writes.get()
        assert not (isinstance(write, Finish | HandBack) and write.job_id == "l")


def test_hand_back_all_returns_every_running_job_without_counting_the_attempt(loop):
    loop.start([job("h1", max_tokens=1000), job("h2", max_tokens=1000)], arrived=2)
    loop.hand_back_all()
    ends = [until_finished(loop, j)[-1] for j in ("h1", "h2")]
    assert all(isinstance(w, HandBack) and w.attempts == 0 for w in ends)


def test_a_job_past_its_execution_timeout_is_timed_out(loop):
    # The tiny model fills its 256-token context in well under 50 ms on a quiet machine: the
    # timeout must run out within the first steps, whatever the machine's speed.
    loop.start([job("t", timeout_s=0.001, max_tokens=100_000)], arrived=1)
    writes = until_finished(loop, "t")
    final = events(writes)[-1]
    assert final.type == "timed_out" and final.code == ErrorCode.EXECUTION_TIMEOUT


def test_bad_jobs_fail_alone_with_a_stable_code(loop):
    too_long = job("long", prompt="fox " * 400)  # over max_model_len=256
    loop.start([job("ok"), too_long], arrived=2)
    failed = until_finished(loop, "long")
    assert events(failed)[-1].type == "failed" and events(failed)[-1].code == ErrorCode.PROMPT_TOO_LONG
    ok = until_finished(loop, "ok")
    assert events(ok)[-1].type == "completed"



@pytest.fixture
def lane_loop(engine):
    yield from running_loop(engine)


def test_a_background_job_hands_its_tokens_over_in_groups_and_keeps_every_one(lane_loop, llama_dir):
    """Its tokens come as one event per group, seqs without gaps, and equal the reference's."""
    GROUP = BACKGROUND_FLUSH_TOKENS  # noqa: N806

    lane_loop.start([job("bg", max_tokens=20, priority="low")], arrived=1)
    writes = until_finished(lane_loop, "bg")
    assert all(w.background for w in writes)
    first, *middle, final = writes
    assert len(first.events) == 1 and first.first_token_at is not None  # the first token goes at once
    assert middle and all(len(w.events) == 1 and len(w.events[0].token_ids) == GROUP for w in middle)  # one event each
    evs = events(writes)
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1)) and evs[-1].type == "completed"
    tokens = [t for e in evs if e.type == "token" for t in e.token_ids]
    assert tokens == list(reference(llama_dir, max_tokens=20).token_ids)


def test_background_jobs_arriving_with_a_live_one_all_run_and_a_live_job_is_never_grouped(lane_loop, llama_dir):
    lane_loop.start([job("live"), job("bg1", priority="low"), job("bg2", priority="low")], arrived=3)
    expected = list(reference(llama_dir).token_ids)
    by_job: dict[str, list] = {"live": [], "bg1": [], "bg2": []}
    deadline = time.monotonic() + 30
    while not all(w and isinstance(w[-1], Finish) for w in by_job.values()) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            write = lane_loop.writes.get(timeout=0.1)
            by_job[write.job_id].append(write)
    for job_id, writes in by_job.items():
        assert [t for e in events(writes) if e.type == "token" for t in e.token_ids] == expected
        if job_id == "live":
            assert not any(w.background for w in writes)
            assert all(len(w.events) == 1 for w in writes[:-1])  # a token per step, each at once


def test_hand_back_all_returns_background_jobs_still_waiting_to_be_admitted(lane_loop):
    lane_loop.start([job("live2", max_tokens=200), job("bg3", priority="low", max_tokens=200)], arrived=2)
    lane_loop.hand_back_all()
    ends = {job_id: until_finished(lane_loop, job_id)[-1] for job_id in ("live2", "bg3")}
    assert all(isinstance(w, HandBack) for w in ends.values())


def test_a_background_jobs_joined_token_events_keep_a_logprob_per_token(lane_loop):
    lane_loop.start([job("bgl", max_tokens=12, priority="low", logprobs=True, top_logprobs=2)], arrived=1)
    tokens = [e for e in events(until_finished(lane_loop, "bgl")) if e.type == "token"]
    assert len(tokens) < 12 and sum(len(e.token_ids) for e in tokens) == 12  # joined
    for e in tokens:
        assert [lp.token_id for lp in e.logprobs] == e.token_ids and all(len(lp.top) == 2 for lp in e.logprobs)


paced_loop = contextlib.contextmanager(running_loop)


def paused_s(loop) -> float:
    return loop.metrics.registry.get_sample_value("ferry_worker_background_paused_seconds_total")


@pytest.mark.parametrize("live_first", [True, False])
def test_background_work_is_paced_only_while_live_traffic_is_present(engine, llama_dir, live_first):
    """Every pause here is the cap (ratio 1e6): 0.1 s after each of a background job's steps while
    a live job ran within the window, none without one; the tokens are the same either way."""
    with paced_loop(engine, BackgroundPacing(ratio=1e6, window_s=60.0, max_pause_s=0.1)) as loop:
        if live_first:
            loop.start([job("live-p", max_tokens=2)], arrived=1)
            until_finished(loop, "live-p")
        loop.start([job("bg-p", max_tokens=12, priority="low")], arrived=1)
        tokens = [t for e in events(until_finished(loop, "bg-p")) if e.type == "token" for t in e.token_ids]
        assert tokens == list(reference(llama_dir).token_ids)
        if live_first:
            assert paused_s(loop) >= 0.1 * 10  # 12 steps (a prefill, 11 decodes), a pause before each but the first
        else:
            assert paused_s(loop) == 0


def test_a_live_arrival_ends_a_background_pause(engine):
    """Pauses of up to 60 s: a live job started during one, or a cancel, ends it long before."""
    with paced_loop(engine, BackgroundPacing(ratio=1e9, window_s=600.0, max_pause_s=60.0)) as loop:
        loop.start([job("live-a", max_tokens=1)], arrived=1)
        until_finished(loop, "live-a")
        loop.start([job("bg-a", max_tokens=4, priority="low")], arrived=1)
        first = loop.writes.get(timeout=30)  # the background job's first token: a pause follows its step
        assert first.job_id == "bg-a"
        time.sleep(0.2)
        started = time.monotonic()
        loop.start([job("live-b", max_tokens=2)], arrived=1)
        until_finished(loop, "live-b")
        assert time.monotonic() - started < 30  # the pause (60 s) was cut short
        time.sleep(0.2)  # bg-a is paused again: live-b ran within the window
        started = time.monotonic()
        loop.abort("bg-a")
        assert events(until_finished(loop, "bg-a"))[-1].type == "cancelled"
        assert time.monotonic() - started < 30  # its cancelled event went out at once


def test_a_burst_of_background_jobs_does_not_hold_back_a_live_jobs_first_token(engine, llama_dir):
    """20 background jobs handed over with a live one: their prompts arrive as token ids (rendered
    by the intake), and the engine serves the live prompt first: its first token is in the first
    step's writes; every job's tokens are the reference's."""
    batches: queue.SimpleQueue = queue.SimpleQueue()
    loop = EngineLoop(engine, "w1", WorkerMetrics(), batches.put)
    loop.thread.start()
    try:
        names = [f"burst{i}" for i in range(20)]
        loop.start([job("live-q", max_tokens=3)] + [job(name, max_tokens=3, priority="low") for name in names],
                   arrived=len(names) + 1)
        first_step = batches.get(timeout=30)
        assert any(isinstance(w, Progress) and w.job_id == "live-q" and w.first_token_at for w in first_step)
        finished, tokens = set(), {name: [] for name in ["live-q", *names]}
        step, deadline = first_step, time.monotonic() + 60
        while True:
            for w in step:
                tokens[w.job_id] += [t for e in w.events if e.type == "token" for t in e.token_ids]
                if isinstance(w, Finish):
                    finished.add(w.job_id)
            if len(finished) == len(tokens) or time.monotonic() > deadline:
                break
            with contextlib.suppress(queue.Empty):
                step = batches.get(timeout=0.1)
                continue
            step = []
        expected = list(reference(llama_dir, max_tokens=3).token_ids)
        assert all(got == expected for got in tokens.values())
    finally:
        loop.stop.set()
        loop.thread.join(10)
