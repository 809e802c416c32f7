"""Which KV pool each layer of a hybrid model uses: full-attention layers one, sliding-window layers another.

A model whose layers mix full attention with a sliding window (Gemma 2/3, Qwen2 past
`max_window_layers`) keeps each kind's KV in a pool of its own, so the windowed layers' blocks can
be released once every query has passed them while the full layers keep theirs
(`worker.engine.hybrid_kv` manages the blocks). A layer reads and writes its pool at its index
among the layers of its kind, through that pool's slot mapping and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels.ops import AttentionMetadata
from ferry.worker.models.config import ModelArch


@dataclass(frozen=True, slots=True)
class KVSplit:
    full_layers: tuple[int, ...]  # layers attending over the whole context: the main pool, in this order
    window_layers: tuple[int, ...]  # sliding-window layers: the windowed pool, in this order
    window: int  # the widest of the windowed layers' windows: blocks before it are released

    def pool_index(self, layer: int) -> tuple[bool, int]:
        """(whether `layer` is windowed, its index in its pool)."""
        if layer in self.window_layers:
            return True, self.window_layers.index(layer)
        return False, self.full_layers.index(layer)


def may_release_behind_windows(arch: ModelArch, has_draft: bool) -> bool:
    """Whether KV blocks behind the windows may be released at all: not with a draft model (it
    shares the block tables) or LongRoPE (it recomputes a sequence from its first token at the switch)."""
    return not has_draft and arch.rope.long_inv_freq is None


def kv_split(arch: ModelArch) -> KVSplit | None:
    """The split of a model with both kinds of layers; None where every layer is one kind."""
    windows = arch.layer_windows
    window_layers = tuple(i for i, w in enumerate(windows) if w is not None)
    if not window_layers or len(window_layers) == len(windows):
        return None
    full_layers = tuple(i for i, w in enumerate(windows) if w is None)
    return KVSplit(full_layers, window_layers, max(w for w in windows if w is not None))


@dataclass(slots=True)
class WindowedKV:
    """One step's view of the windowed layers' pool, beside the main pool the model is given."""

    split: KVSplit
    pool: torch.Tensor  # [windowed layers, 2, window blocks, kv heads, block size, head dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64: each token's slot in this pool
    meta: AttentionMetadata  # the same sequences, with this pool's block tables


def layer_kv(layer: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, meta: AttentionMetadata,
             windowed: WindowedKV | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(k cache, v cache, slot mapping, metadata) layer `layer` attends with. Without `windowed`
    every layer has its place in `kv_cache`; with it, `kv_cache` holds the full layers only."""
    if windowed is None:
        return kv_cache[layer, 0], kv_cache[layer, 1], slot_mapping, meta
    is_windowed, index = windowed.split.pool_index(layer)
    if is_windowed:
        pool = windowed.pool
        return pool[index, 0], pool[index, 1], windowed.slot_mapping, windowed.meta
    return kv_cache[index, 0], kv_cache[index, 1], slot_mapping, meta
