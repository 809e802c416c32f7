"""Snapshots of a tensor-parallel engine: every rank's heads are saved, restored into the same
layout, and refused (a cold start with one warning) by an engine with another layout."""

from __future__ import annotations

import logging

import torch

from ferry.worker.engine import Engine
from ferry.worker.snapshots import SnapshotStats, restore_snapshot, save_snapshot
from tests.snapshots.util import BLOCK_BYTES, BS, generate

PROMPT = list(range(7, 47))  # 40 tokens: 10 full blocks of 4


def _engine(llama_dir, size: int) -> Engine:
    return Engine(llama_dir, block_size=BS, max_model_len=128, kv_cache_bytes=64 * BLOCK_BYTES // size,
                  tensor_parallel_size=size)


def test_saved_at_two_ranks_restores_at_two_and_is_foreign_at_one(llama_dir, tmp_path, caplog):
    url = (tmp_path / "snapshots").as_uri()
    single = _engine(llama_dir, 1)
    reference, _ = generate(single, PROMPT)
    first = _engine(llama_dir, 2)
    try:
        tokens, _ = generate(first, PROMPT)
        assert tokens == reference
        info = save_snapshot(first, url)
        assert info.blocks == 11
        keys = list(first.kv.cached)
        saved = first.prefix_blocks.read(keys)  # [layers, 2, blocks, kv heads (both ranks'), slots, head dim]
        assert saved.shape[3] == 2 and first.runner.kv_cache.shape[3] == 1
        # Rank 0 holds kv head 0; the other came from rank 1 (and is no copy of it).
        ids = torch.tensor([first.kv.cached[k] for k in keys])
        assert torch.equal(saved[:, :, :, :1], first.runner.kv_cache.index_select(2, ids))
        assert not torch.equal(saved[:, :, :, 1], saved[:, :, :, 0])
        # The same layout's KV is close to one rank's (partial sums in another order), head by head.
        one_rank = single.prefix_blocks.read(keys)
        torch.testing.assert_close(saved, one_rank, rtol=1e-4, atol=1e-4)
    finally:
        first.close()

    second = _engine(llama_dir, 2)
    try:
        stats = SnapshotStats()
        restore_snapshot(second, url, stats)
        assert stats.restores == {"ok": 1}
        assert torch.equal(second.prefix_blocks.read(keys), saved)
        again, cached = generate(second, PROMPT)
        assert (again, cached) == (reference, 36)
    finally:
        second.close()

    caplog.set_level(logging.WARNING, logger="ferry.worker.snapshots.restore")
    stats = SnapshotStats()
    restore_snapshot(_engine(llama_dir, 1), url, stats)
    assert stats.restores == {"foreign": 1}
    warnings = [r.getMessage() for r in caplog.records if r.name == "ferry.worker.snapshots.restore"]
    assert len(warnings) == 1 and "tensor_parallel_size 1" in warnings[0]
