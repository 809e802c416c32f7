"""Counters of one worker's snapshot activity, and their Prometheus export (`ferry_snapshot_*`)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

RESTORE_OUTCOMES = ("ok", "missing", "foreign", "corrupt", "unreachable", "error")
SAVE_OUTCOMES = ("ok", "failed")


@dataclass(slots=True)
class SnapshotStats:
    restores: collections.Counter = field(default_factory=collections.Counter)  # outcome -> count
    saves: collections.Counter = field(default_factory=collections.Counter)  # "ok" | "failed" -> count
    restored_blocks: int = 0
    restored_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    last_restore_seconds: float = 0.0
    last_save_seconds: float = 0.0
    last_save_time: float = 0.0  # unix time of the last successful save
    last_keys_digest: str | None = None  # the cached set last saved or restored (skip unchanged saves)


class SnapshotCollector:
    """Prometheus collector: `registry.register(SnapshotCollector(lambda: stats))`."""

    def __init__(self, stats: Callable[[], SnapshotStats]) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats()
        restores = CounterMetricFamily(
            "ferry_snapshot_restores", "Snapshot restores at start-up by outcome", labels=["outcome"]
        )
        for outcome in RESTORE_OUTCOMES:
            restores.add_metric([outcome], s.restores[outcome])
        saves = CounterMetricFamily("ferry_snapshot_saves", "Snapshot saves by outcome", labels=["outcome"])
        for outcome in SAVE_OUTCOMES:
            saves.add_metric([outcome], s.saves[outcome])
        yield restores
        yield saves
        yield CounterMetricFamily(
            "ferry_snapshot_restored_blocks", "KV blocks restored from snapshots", value=s.restored_blocks
        )
        yield CounterMetricFamily("ferry_snapshot_restored_bytes", "Snapshot bytes downloaded and restored",
                                  value=s.restored_bytes)
        yield CounterMetricFamily("ferry_snapshot_saved_blocks", "KV blocks written to snapshots", value=s.saved_blocks)
        yield CounterMetricFamily("ferry_snapshot_saved_bytes", "Snapshot bytes written", value=s.saved_bytes)
        yield GaugeMetricFamily("ferry_snapshot_last_restore_duration_seconds", "Duration of the last restore",
                                value=s.last_restore_seconds)
        yield GaugeMetricFamily("ferry_snapshot_last_save_duration_seconds", "Duration of the last save",
                                value=s.last_save_seconds)
        yield GaugeMetricFamily("ferry_snapshot_last_save_timestamp_seconds", "Unix time of the last successful save",
                                value=s.last_save_time)
