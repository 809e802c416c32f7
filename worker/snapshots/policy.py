"""Which cached blocks a snapshot keeps, and which of a snapshot's blocks an engine takes back.

Both work on whole chains from the root: a block is useless without its prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from ferry.worker.engine.kv_cache import ROOT_KEY, CachedBlock
from ferry.worker.snapshots.format import BlockRecord


def select_blocks(cached: list[CachedBlock], max_blocks: int) -> list[CachedBlock]:
    """The cached blocks worth keeping: whole chains from the root, by hits then recency.

    Only blocks whose every ancestor is cached qualify. Blocks are taken best first, each with
    its not-yet-taken ancestors, while the chain fits in `max_blocks`. Parents come before children."""
    by_key = {meta.key: meta for meta in cached}
    rooted = _rooted_keys(by_key)
    ranked = sorted(rooted, key=lambda k: (-by_key[k].hits, -by_key[k].last_used))
    chosen: dict[bytes, None] = {}  # insertion-ordered set
    for key in ranked:
        if len(chosen) >= max_blocks:
            break
        chain = []
        while key != ROOT_KEY and key not in chosen:
            chain.append(key)
            key = by_key[key].parent_key
        if len(chosen) + len(chain) <= max_blocks:
            chosen.update(dict.fromkeys(reversed(chain)))
    return [by_key[k] for k in chosen]


def _rooted_keys(by_key: dict[bytes, CachedBlock]) -> set[bytes]:
    """Keys whose chain back to the root is entirely cached."""
    good: set[bytes] = set()
    bad: set[bytes] = set()
    for start in by_key:
        path, key = [], start
        while True:
            if key == ROOT_KEY or key in good:
                good.update(path)
                break
            if key in bad or key not in by_key:
                bad.update(path)
                break
            path.append(key)
            key = by_key[key].parent_key
    return good


def plan_import(records: list[BlockRecord], room: int, is_cached: Callable[[bytes], bool]) -> list[BlockRecord]:
    """The records to import, parents first: each whose key is not cached yet and whose parent is
    the root, cached or imported too, at most `room` of them (imports never evict)."""
    plan: list[BlockRecord] = []
    planned: set[bytes] = set()
    for record in records:  # parents come first in a manifest
        key, parent = bytes.fromhex(record.key), bytes.fromhex(record.parent_key)
        if is_cached(key):
            continue  # already here; its children may still attach to it
        if len(plan) < room and (parent == ROOT_KEY or parent in planned or is_cached(parent)):
            plan.append(record)
            planned.add(key)
    return plan


def keys_digest(keys: Iterable[bytes]) -> str:
    """One digest of a set of block keys: a save is skipped when the cached set has not changed."""
    return hashlib.sha256(b"".join(sorted(keys))).hexdigest()
