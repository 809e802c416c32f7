"""How many bytes one rank's KV pool may take (`EngineConfig.kv_cache_bytes` is that budget, per rank)."""

from __future__ import annotations

import os

import torch

from ferry.worker.models.kv_split import KVSplit

_CPU_KV_CAP_BYTES = 4 << 30  # default KV budget on CPU at most 4 GiB ...
_CPU_KV_RAM_SHARE = 0.2  # ... and at most this share of RAM (both split between the ranks that share it)
_GPU_KV_FREE_SHARE = 0.85  # on CUDA: this share of the memory left after loading the weights


def kv_budget_bytes(
    kv_cache_bytes: int | None,
    device: torch.device,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    bytes_per_block: int,
    ranks_per_host: int = 1,
) -> int:
    """`kv_cache_bytes` when given; else on CUDA a share of this device's free memory, and on the CPU
    what every running sequence at full length needs, capped by the RAM this rank's share of it."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _GPU_KV_FREE_SHARE)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # No use reserving more than every running sequence at full length needs.
    full = -(-max_model_len // block_size) * bytes_per_block * max_num_seqs
    return int(min(_CPU_KV_CAP_BYTES / ranks_per_host, _CPU_KV_RAM_SHARE * ram / ranks_per_host, full))


def split_pool(num_blocks: int, split: KVSplit | None, block_size: int, max_num_seqs: int,
               step_tokens: int) -> tuple[int, int]:
    """(main pool blocks, windowed pool blocks) from a budget of `num_blocks` blocks of every layer.

    A hybrid model's windowed pool needs at most what every running sequence's window and one
    step's tokens take (about window / block_size + 2 blocks each, plus the step's); it gets that
    (or the whole count, if less), and the bytes it leaves go to the full layers' pool. One pool
    for every layer: (num_blocks, 0)."""
    if split is None:
        return num_blocks, 0
    window_need = max_num_seqs * (-(-split.window // block_size) + 2) + -(-step_tokens // block_size)
    num_window = min(num_blocks, window_need)
    full, windowed = len(split.full_layers), len(split.window_layers)
    return num_blocks + (num_blocks - num_window) * windowed // full, num_window
