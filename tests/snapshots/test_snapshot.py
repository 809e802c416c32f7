"""Snapshots through the file:// store: round trip, selection policy, and every way a restore can fail."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from ferry.worker.common.objectstore import FileStore, StoreError, open_store
from ferry.worker.engine.kv_cache import ROOT_KEY, CachedBlock
from ferry.worker.snapshots import (
    POINTER,
    SnapshotCollector,
    SnapshotError,
    SnapshotStats,
    list_snapshots,
    read_manifest,
    restore_snapshot,
    save_snapshot,
    select_blocks,
)
from tests.snapshots.util import BS, free_port, generate

PROMPT = list(range(7, 47))  # 40 tokens: 10 full blocks of 4
OTHER = list(range(100, 130))


@pytest.fixture
def url(tmp_path):
    return (tmp_path / "snapshots").as_uri()


def warm_engine(make_engine, *prompts, **kwargs):
    engine = make_engine(**kwargs)
    outputs = [generate(engine, p) for p in prompts or [PROMPT]]
    return engine, outputs


def cold_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "ferry.worker.snapshots.restore" and r.levelno == logging.WARNING
    ]


def test_round_trip_restores_blocks_kv_and_outputs(make_engine, restored_engine, url):
    engine, [(tokens, cached)] = warm_engine(make_engine)
    assert cached == 0
    info = save_snapshot(engine, url)
    # 40 prompt + 6 generated tokens, the last one never computed: 45 tokens of KV = 11 full blocks.
    assert (info.blocks, info.tokens) == (11, 44)
    assert info.bytes > 11 * 2048 and info.key.startswith("snapshots/")

    restored, restored_stats = restored_engine(url)
    assert restored_stats.restores == {"ok": 1}
    assert restored.kv_usage().num_cached_free_blocks == 11
    assert restored.kv_usage().num_used_blocks == 0
    # Same keys, same KV, bit for bit.
    for key, block in engine.kv.cached.items():
        twin = restored.kv.cached[key]
        assert torch.equal(engine.runner.kv_cache[:, :, block], restored.runner.kv_cache[:, :, twin])
        assert restored.kv.block_meta[twin].token_ids == engine.kv.block_meta[block].token_ids
    again, cached = generate(restored, PROMPT)
    assert cached == 36  # 9 of 10 full blocks: the last prompt token is recomputed
    assert again == tokens


def test_round_trip_through_llm(llama_dir, url):
    from ferry.worker.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = dict(block_size=BS, kv_cache_bytes=64 * 2048, max_model_len=128)
    first = LLM(llama_dir, **kwargs)
    [cold] = first.generate([PROMPT], params, use_tqdm=False)
    info = save_snapshot(first.engine, url)
    assert info.url == url and info.blocks == 10

    second = LLM(llama_dir, **kwargs)
    assert restore_snapshot(second.engine, url).blocks == 10
    [warm] = second.generate([PROMPT], params, use_tqdm=False)
    assert warm.num_cached_tokens == 36 and warm.token_ids == cold.token_ids


def test_round_trip_of_a_hybrid_model_carries_both_pools(tiny_model_factory, url):
    """Gemma 2 (every other layer a 16-token window, its KV in a pool of its own) past its window:
    the snapshot carries every layer's KV of the blocks both pools hold, and a fresh engine decodes
    the prompt from them as the first one did."""
    from ferry.worker.engine import LLM, SamplingParams
    from ferry.worker.engine.hybrid_kv import HybridKVCacheManager

    model_dir = tiny_model_factory("gemma2", head_dim=16, num_layers=4, sliding_window=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = LLM(str(model_dir), block_size=BS, max_model_len=128)
    assert isinstance(first.engine.kv, HybridKVCacheManager)
    [cold] = first.generate([PROMPT], params, use_tqdm=False)
    info = save_snapshot(first.engine, url)
    assert info.blocks == 10  # 43 tokens of KV: 10 full blocks, each in both pools

    second = LLM(str(model_dir), block_size=BS, max_model_len=128)
    assert restore_snapshot(second.engine, url).blocks == 10
    [warm] = second.generate([PROMPT], params, use_tqdm=False)
    assert warm.num_cached_tokens == 36 and warm.token_ids == cold.token_ids


def test_empty_or_unchanged_cache_writes_nothing(make_engine, restored_engine, url):
    engine, stats = make_engine(), SnapshotStats()
    assert save_snapshot(engine, url, stats=stats) is None  # an idle worker never replaces a useful snapshot
    generate(engine, PROMPT)
    assert save_snapshot(engine, url, only_if_changed=True, stats=stats) is not None
    assert save_snapshot(engine, url, only_if_changed=True, stats=stats) is None
    restored, restored_stats = restored_engine(url)
    assert save_snapshot(restored, url, only_if_changed=True, stats=restored_stats) is None  # exactly what it restored
    generate(restored, OTHER)
    assert save_snapshot(restored, url, only_if_changed=True, stats=restored_stats).blocks == 11 + 8


def test_keeps_the_last_n_snapshots(make_engine, tmp_path):
    engine, _ = warm_engine(make_engine)
    store = FileStore(tmp_path / "s")
    keys = [save_snapshot(engine, store, keep=2).key for _ in range(4)]
    assert list(list_snapshots(store)) == keys[-2:]
    assert json.loads(store.read_bytes(POINTER))["snapshot"] == keys[-1]


def test_multiple_shards_and_byte_budget(make_engine, restored_engine, url):
    engine, _ = warm_engine(make_engine, PROMPT, OTHER)
    assert len(engine.kv.cached) == 11 + 8
    info = save_snapshot(engine, url, max_bytes=12 * 2048, shard_bytes=5 * 2048)
    assert info.blocks == 12
    _, manifest = read_manifest(open_store(url))
    assert [s.num_blocks for s in manifest.shards] == [5, 5, 2]
    # Whole chains only: every exported block's parent is exported before it.
    seen = {ROOT_KEY.hex()}
    for record in manifest.blocks:
        assert record.parent_key in seen
        seen.add(record.key)
    restored, restored_stats = restored_engine(url)
    assert restored.kv_usage().num_cached_free_blocks == 12


class FailingStore(FileStore):
    """A real file store whose disk fills up when the manifest is written."""

    def write_bytes(self, name: str, data: bytes) -> None:
        if name.endswith("manifest.json"):
            raise StoreError(f"cannot write {name}: No space left on device")
        super().write_bytes(name, data)


def test_failed_save_leaves_the_previous_snapshot_intact(make_engine, restored_engine, tmp_path):
    engine, _ = warm_engine(make_engine)
    good = save_snapshot(engine, FileStore(tmp_path))
    generate(engine, OTHER)
    stats = SnapshotStats()
    with pytest.raises(SnapshotError, match="previous one is intact"):
        save_snapshot(engine, FailingStore(tmp_path), stats=stats)
    assert stats.saves == {"failed": 1}
    assert list(list_snapshots(FileStore(tmp_path))) == [good.key]  # the partial one is gone
    restored, restored_stats = restored_engine(tmp_path.as_uri())
    assert restored.kv_usage().num_cached_free_blocks == good.blocks


def test_import_fills_only_free_blocks_with_whole_chains(make_engine, restored_engine, url):
    engine, _ = warm_engine(make_engine, PROMPT, OTHER)
    save_snapshot(engine, url)
    small, small_stats = restored_engine(url, num_blocks=16, max_model_len=64)
    usage = small.kv_usage()
    assert usage.num_cached_free_blocks == 16 and usage.num_blocks == 16
    for meta in small.kv.block_meta:
        assert meta.parent_key == ROOT_KEY or meta.parent_key in small.kv.cached


# --- the policy ----------------------------------------------------------------------------------


def chain(name: str, hits: list[int], start_time: float) -> list[CachedBlock]:
    blocks, parent = [], ROOT_KEY
    for i, h in enumerate(hits):
        key = f"{name}{i}".encode().ljust(32, b".")
        blocks.append(CachedBlock(key, parent, (i,) * BS, hits=h, last_used=start_time + i))
        parent = key
    return blocks


def test_select_blocks_takes_hot_whole_chains_parents_first():
    hot = chain("a", [5, 5, 1], 100.0)
    warm = chain("b", [2, 2], 50.0)
    orphan = CachedBlock(b"x".ljust(32, b"."), b"gone".ljust(32, b"."), (0,) * BS, hits=99)
    cached = hot + warm + [orphan]
    names = lambda picked: [m.key.rstrip(b".").decode() for m in picked]
    assert names(select_blocks(cached, 10)) == ["a0", "a1", "b0", "b1", "a2"]
    assert names(select_blocks(cached, 3)) == ["a0", "a1", "b0"]  # b1 and a2 do not fit
    assert names(select_blocks(cached, 0)) == []
    # A hot tail brings its cold ancestors along.
    tail_hot = chain("c", [0, 0, 9], 10.0)
    assert names(select_blocks(tail_hot, 3)) == ["c0", "c1", "c2"]
    assert names(select_blocks(tail_hot, 2)) == ["c0", "c1"]


# --- failures: cold start, one warning, a metric -------------------------------------------------


def test_missing_pointer_starts_cold(make_engine, restored_engine, url, caplog):
    engine, engine_stats = restored_engine(url)
    assert engine_stats.restores == {"missing": 1}
    assert len(cold_warnings(caplog)) == 1 and "latest.json not found" in cold_warnings(caplog)[0]
    assert engine.kv_usage().num_cached_free_blocks == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_shard_starts_cold(make_engine, restored_engine, tmp_path, damage, caplog):
    engine, _ = warm_engine(make_engine)
    info = save_snapshot(engine, tmp_path.as_uri())
    shard = tmp_path / info.key / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 100]
    shard.write_bytes(bytes(data))
    restored, restored_stats = restored_engine(tmp_path.as_uri())
    assert restored_stats.restores == {"corrupt": 1}
    assert cold_warnings(caplog) == [cold_warnings(caplog)[0]] and "sha256" in cold_warnings(caplog)[0]
    assert restored.kv_usage().num_cached_free_blocks == 0  # nothing half-imported


def test_tampered_manifest_starts_cold(make_engine, restored_engine, tmp_path):
    engine, _ = warm_engine(make_engine)
    info = save_snapshot(engine, tmp_path.as_uri())
    manifest = tmp_path / info.key / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"hits":0', b'"hits":1', 1))
    assert restored_engine(tmp_path.as_uri())[1].restores == {"corrupt": 1}


def test_other_weights_or_block_size_is_foreign(make_engine, restored_engine, tiny_model_factory, url, caplog):
    engine, _ = warm_engine(make_engine)
    save_snapshot(engine, url)
    # Same config, same tensor names and shapes, other values: a fine-tune of the same base.
    other, other_stats = restored_engine(url, model_dir=tiny_model_factory("llama", seed=1))
    assert other_stats.restores == {"foreign": 1}
    wider, wider_stats = restored_engine(url, block_size=8)
    assert wider_stats.restores == {"foreign": 1}
    assert len(cold_warnings(caplog)) == 2 and "another model" in cold_warnings(caplog)[0]
    assert other.kv_usage().num_cached_free_blocks == wider.kv_usage().num_cached_free_blocks == 0


def test_unreachable_s3_starts_cold(make_engine, restored_engine, s3_env, caplog):
    s3_env.setenv("FERRY_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    engine, engine_stats = restored_engine("s3://ferry-snapshots/model")
    assert engine_stats.restores == {"unreachable": 1}
    assert len(cold_warnings(caplog)) == 1 and "unreachable" in cold_warnings(caplog)[0]
    generate(engine, PROMPT, max_tokens=1)  # and it serves


def test_metrics_expose_restore_outcomes(make_engine, restored_engine, url):
    engine, engine_stats = restored_engine(url)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: engine_stats))
    text = generate_latest(registry).decode()
    assert 'ferry_snapshot_restores_total{outcome="missing"} 1.0' in text
    assert 'ferry_snapshot_restores_total{outcome="ok"} 0.0' in text
    assert "ferry_snapshot_saved_bytes_total 0.0" in text
