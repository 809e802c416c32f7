"""A worker prefers the LoRA adapters it holds (`worker.serve.lora_affinity`): a job read by a worker
that does not hold its adapter goes to a live peer that does and has room (its queue entry, lease
and all, through the peer's hand-off stream, which wakes the peer's blocked read), at most once, and
never to a full, stale, draining or other-model peer; a moved entry a reaper took meanwhile is
dropped by the peer, and a draining peer hands back what was moved to it. End to end: two worker
processes, each holding one adapter, serve a mixed burst each job on its adapter's holder."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis

from ferry.worker.protocol import Keys, enqueue_job
from ferry.worker.serve.lora_affinity import LoraAffinity, parse_peer, queue_allowance
from ferry.worker.serve.queue_reader import QueueReader
from ferry.worker.serve.writes import Delivery
from tests.serve.conftest import greedy, start_worker, wait_for, wait_ready, wait_terminal

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "tiny"

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_keys(request):
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(f"ferrytest-aff-{uuid.uuid4().hex[:8]}", shards=getattr(request, "param", 1))
    yield client, keys
    for key in client.scan_iter(f"{keys.prefix}:*"):
        client.delete(key)
    client.close()


def beat(client: redis.Redis, keys: Keys, worker_id: str, loras: list[str], jobs: int = 0, max_num_seqs: int = 4,
         model: str = MODEL, state: str = "ready", age_s: float = 0.0) -> None:
    """Write the heartbeat a worker would (`worker.serve.components.Heartbeat`)."""
    ts = time.time() - age_s
    client.hset(keys.worker(worker_id), mapping={
        "model": model, "state": state, "loras": json.dumps(loras), "jobs": str(jobs),
        "max_num_seqs": str(max_num_seqs), "ts": repr(ts)})
    client.zadd(keys.workers, {worker_id: ts})


def reader(client: redis.Redis, keys: Keys, worker_id: str) -> QueueReader:
    r = QueueReader(client, keys, MODEL, worker_id, lease_s=30.0, handoffs=True)
    r.ensure_groups()
    return r


def affinity(client: redis.Redis, keys: Keys, worker_id: str, held: list[str] = ()) -> LoraAffinity:
    return LoraAffinity(client, keys, MODEL, worker_id, lambda: list(held), refresh_s=0.0, max_age_s=5.0)


def hold(client: redis.Redis, keys: Keys, worker_id: str, n: int) -> list[str]:
    """`n` queue entries pending under `worker_id`, as the jobs it runs are; their entry ids."""
    stream = keys.queue(MODEL, "normal")
    client.xgroup_create(stream, keys.group, id="0", mkstream=True) if not client.exists(stream) else None
    ids = [client.xadd(stream, {"job_id": f"{worker_id}-{i}", "attempt": "1"}) for i in range(n)]
    client.xreadgroup(keys.group, worker_id, {stream: ">"}, count=n)
    return ids


def owner(client: redis.Redis, keys: Keys, d: Delivery) -> str | None:
    pending = client.xpending_range(d.stream, keys.group, d.entry_id, d.entry_id, 1)
    return pending[0]["consumer"] if pending else None


def read_jobs(r: QueueReader, n: int) -> list[Delivery]:
    return r.read(room=n, block_ms=0)


@pytest.mark.parametrize("redis_keys", [1, 2], indirect=True, ids=["one-shard", "two-shards"])
def test_a_job_moves_to_the_peer_holding_its_adapter_and_wakes_its_blocked_read(redis_keys):
    client, keys = redis_keys
    holder = redis.Redis.from_url(REDIS_URL, decode_responses=True, client_name="aff-holder")
    a, b = reader(holder, keys, "A"), reader(client, keys, "B")
    beat(client, keys, "A", ["sql"])
    job_id = enqueue_job(client, keys, greedy(prompt="hi", lora="sql")).job_id
    [d] = read_jobs(b, 1)

    woken: list[Delivery] = []
    thread = threading.Thread(target=lambda: woken.extend(a.read(room=4, block_ms=10_000)))
    thread.start()
    try:
        wait_for(lambda: any(c.get("name") == "aff-holder" and c["cmd"] == "xreadgroup" for c in client.client_list()),
                 10, "the holder's blocked read")
        chooser = affinity(client, keys, "B")
        assert chooser.choose([(d, job_id, "sql")]) == {job_id: "A"}
        assert chooser.move([(d, job_id, "A")]) == {job_id}
    finally:
        thread.join(15)
        holder.close()
    [got] = woken
    assert (got.stream, got.entry_id, got.fields["job_id"], got.handed) == (d.stream, d.entry_id, job_id, True)
    assert owner(client, keys, got) == "A"
    assert client.xlen(keys.handoff(MODEL, keys.shard_of(job_id), "A")) == 0  # its wake-up entry is settled


def test_a_job_stays_where_no_live_peer_with_room_holds_its_adapter(redis_keys):
    client, keys = redis_keys
    beat(client, keys, "full", ["sql"], max_num_seqs=4)
    hold(client, keys, "full", 4 + queue_allowance(4))  # its batch and its short queue
    beat(client, keys, "stale", ["sql"], age_s=30.0)
    beat(client, keys, "draining", ["sql"], state="draining")
    beat(client, keys, "other-model", ["sql"], model="big")
    beat(client, keys, "holds-poet", ["poet"])
    d = Delivery("s", "1-0", {})
    assert affinity(client, keys, "B").choose([(d, "j1", "sql"), (d, "j2", None), (d, "j3", "chat")]) == {}
    beat(client, keys, "holds-poet", ["poet", "sql"])
    assert affinity(client, keys, "B").choose([(d, "j1", "sql")]) == {"j1": "holds-poet"}


def test_a_job_is_moved_at_most_once_and_never_away_from_a_holder(redis_keys):
    client, keys = redis_keys
    beat(client, keys, "A", ["sql"])
    chooser = affinity(client, keys, "B", held=["sql"])
    assert chooser.choose([(Delivery("s", "1-0", {}), "j1", "sql")]) == {}  # held here: served here
    chooser = affinity(client, keys, "B")
    assert chooser.choose([(Delivery("s", "1-0", {}, handed=True), "j1", "sql"),
                           (Delivery("s", "2-0", {}, reclaimed=True), "j2", "sql")]) == {}


def test_a_peers_room_is_what_it_holds_now_moves_included(redis_keys):
    client, keys = redis_keys
    cap = 4 + queue_allowance(4)  # max_num_seqs and the short queue a full holder still takes
    beat(client, keys, "A", ["sql"], jobs=0, max_num_seqs=4)  # a beat's job count is stale: not read
    beat(client, keys, "C", ["sql"], max_num_seqs=4)
    a_entries = hold(client, keys, "A", cap - 2)
    hold(client, keys, "C", cap - 1)
    b = reader(client, keys, "B")
    for _ in range(6):
        enqueue_job(client, keys, greedy(prompt="hi", lora="sql"))
    read = [(d, d.fields["job_id"], "sql") for d in read_jobs(b, 6)]
    chooser = affinity(client, keys, "B")
    # the roomiest holder each time: A's 2 places and C's last one, then none left: served here
    moves = chooser.choose(read[:4])
    assert len(moves) == 3 and sorted(moves.values()) == ["A", "A", "C"]
    assert chooser.move([(d, j, moves[j]) for d, j, _ in read[:4] if j in moves]) == set(moves)
    client.xack(keys.queue(MODEL, "normal"), keys.group, a_entries[0])  # one of A's jobs ended
    assert chooser.choose(read[4:]) == {read[4][1]: "A"}  # what was moved to A holds its other places


def test_the_peer_drops_a_moved_entry_a_reaper_took_and_a_draining_peer_hands_back_the_rest(redis_keys):
    client, keys = redis_keys
    a, b = reader(client, keys, "A"), reader(client, keys, "B")
    reaper = QueueReader(client, keys, MODEL, "C", lease_s=0.0)
    jobs = [enqueue_job(client, keys, greedy(prompt="hi", lora="sql")).job_id for _ in range(2)]
    deliveries = read_jobs(b, 2)
    assert affinity(client, keys, "B").move([(d, j, "A") for d, j in zip(deliveries, jobs, strict=True)]) == set(jobs)
    time.sleep(0.01)  # the entries' idle time passes the reaper's zero lease
    reaped = reaper.reap(room=1, held=set())
    assert [d.entry_id for d in reaped] == [deliveries[0].entry_id] and owner(client, keys, deliveries[0]) == "C"
    left = a.handoffs()  # the drain's read: the reaped one is dropped, the other is A's to hand back
    assert [(d.entry_id, d.handed) for d in left] == [(deliveries[1].entry_id, True)]
    assert owner(client, keys, deliveries[1]) == "A"
    assert a.handoffs() == []


@pytest.mark.parametrize("redis_keys", [2], indirect=True)
def test_hand_offs_of_two_shards_with_the_same_entry_id_are_both_taken(redis_keys):
    # hand-off streams are per shard, and each gives its entries ids of its own: equal ids are two moves
    client, keys = redis_keys
    a = reader(client, keys, "A")
    moved = []
    for shard in (0, 1):
        stream = keys.queue(MODEL, "normal", shard)
        entry_id = client.xadd(stream, {"job_id": f"job-s{shard}", "attempt": "1"})
        client.xreadgroup(keys.group, "A", {stream: ">"})
        client.xadd(keys.handoff(MODEL, shard, "A"), {"job_id": f"job-s{shard}", "stream": stream,
                                                      "entry_id": entry_id}, id="5-0")
        moved.append((stream, entry_id))
    taken = a.handoffs()
    assert sorted((d.stream, d.entry_id) for d in taken) == sorted(moved)
    assert sorted(d.fields["job_id"] for d in taken) == ["job-s0", "job-s1"]  # each its own envelope


def test_a_move_of_an_entry_no_longer_ours_moves_nothing(redis_keys):
    client, keys = redis_keys
    b = reader(client, keys, "B")
    job_id = enqueue_job(client, keys, greedy(prompt="hi", lora="sql")).job_id
    [d] = read_jobs(b, 1)
    client.xclaim(d.stream, keys.group, "C", 0, [d.entry_id], justid=True)
    assert affinity(client, keys, "B").move([(d, job_id, "A")]) == set()
    assert owner(client, keys, d) == "C" and client.xlen(keys.handoff(MODEL, 0, "A")) == 0


def test_peer_heartbeats_that_do_not_describe_a_peer_are_skipped():
    now = time.time()
    good = {"model": MODEL, "state": "ready", "loras": '["sql"]', "jobs": "1", "max_num_seqs": "4", "ts": repr(now)}
    peer = parse_peer("A", good, MODEL, now, 5.0)
    assert (peer.loras, peer.max_num_seqs) == (frozenset({"sql"}), 4)
    for broken in ({"loras": "not json"}, {"max_num_seqs": "x"}, {"ts": "later"}, {"loras": "[]"}):
        assert parse_peer("A", {**good, **broken}, MODEL, now, 5.0) is None
    assert parse_peer("A", {k: v for k, v in good.items() if k != "max_num_seqs"}, MODEL, now, 5.0) is None


# --- two worker processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_two_workers_serve_each_job_on_the_worker_holding_its_adapter(llama_dir, redis_keys, tmp_path):
    from tests.lora_adapters import write_adapter

    client, keys = redis_keys
    sql = write_adapter(llama_dir, tmp_path / "sql", seed=0)
    poet = write_adapter(llama_dir, tmp_path / "poet", seed=1)
    workers = [start_worker(llama_dir, REDIS_URL, keys.prefix, tmp_path, FERRY_LORA_MODULES=f"{name}={path}")
               for name, path in (("sql", sql), ("poet", poet))]
    holder = {"sql": workers[0].worker_id, "poet": workers[1].worker_id}
    try:
        wait_ready(client, keys, workers)
        for name, worker_id in holder.items():  # from the first beat on: peers hand their jobs there at once
            assert json.loads(client.hget(keys.worker(worker_id), "loras")) == [name]
        names = ["sql", "poet"] * 3
        jobs = [enqueue_job(client, keys, greedy(prompt=f"job {i}", max_tokens=4, lora=n)).job_id
                for i, n in enumerate(names)]
        records = wait_terminal(client, keys, jobs, timeout=120)
        assert [r.state for r in records] == ["succeeded"] * len(jobs)
        assert [r.worker_id for r in records] == [holder[n] for n in names]
        assert all(r.attempts == 1 for r in records)  # a move is not a delivery: no attempt spent
    finally:
        for w in workers:
            w.sigterm()
        for w in workers:
            w.proc.wait(30)
