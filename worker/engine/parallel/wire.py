"""What rank 0 sends the other ranks: their start-up spec once, then one message per step.

A message is an int64 header `[op, payload length]` and an int64 payload, both broadcast from
rank 0 over the control group (gloo, CPU tensors, whatever the model's device). A step's payload
is its flat batch metadata, once per step and never per layer:

    [num_chunks, (num_tokens, start, num_block_ids, num_window_block_ids, num_logits, long_rope, lora_slot,
                  *token_ids, *block_ids, *window_block_ids) per chunk]

from which every rank builds the same `ModelInput` (`ModelRunner.prepare`) on its own device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ferry.worker.engine.model_runner import SeqChunk
from ferry.worker.models.config import ModelArch


class Op(enum.IntEnum):
    STOP = 0  # leave the group and exit
    STEP = 1  # run the decoder over the batch in the payload
    # payload: block ids (a hybrid model's: then as many windowed-pool ids, `ModelRunner.read_blocks`);
    # each rank sends rank 0 its heads of them (a snapshot save)
    READ_BLOCKS = 2
    WRITE_BLOCKS = 3  # payload: as READ_BLOCKS'; rank 0 then broadcasts their KV, each rank keeps its heads
    # payload: [slot, *utf-8 bytes of an adapter directory]: each rank puts its shard in the slot (no bytes: empty it)
    LORA = 4


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a spawned rank needs to load its shard and size its KV pool (pickled once, at spawn)."""

    model_dir: str  # the resolved HF checkpoint directory
    arch: ModelArch  # the whole model's (each rank derives its shard's)
    dtype: torch.dtype
    device_type: str  # "cpu", or "cuda": rank r runs on cuda:r
    max_model_len: int
    block_size: int
    kv_cache_bytes: int | None  # the per-rank KV budget, or None for the device's default
    max_num_seqs: int
    size: int  # tensor_parallel_size
    num_threads: int  # intra-op threads of each rank (the engine process's own count)
    store_port: int  # rank 0's TCPStore, where the group meets
    timeout_s: float  # a collective that waits longer than this has a dead or hung rank
    lora_slots: tuple[int, int] | None = None  # (max_loras, max_lora_rank) with LoRA enabled


def pack_chunks(chunks: list[SeqChunk]) -> torch.Tensor:
    """One step's chunks as the flat int64 payload above."""
    flat = [len(chunks)]
    for c in chunks:
        flat += (len(c.token_ids), c.start, len(c.block_ids), len(c.window_block_ids), c.num_logits,
                 int(c.long_rope), c.lora_slot)
        flat += c.token_ids
        flat += c.block_ids
        flat += c.window_block_ids
    return torch.tensor(flat, dtype=torch.int64)


def pack_lora(slot: int, directory: str | None) -> torch.Tensor:
    """Op.LORA's payload: the slot, then the adapter directory's path as bytes (none: empty the slot)."""
    return torch.tensor([slot, *(directory or "").encode()], dtype=torch.int64)


def unpack_lora(payload: torch.Tensor) -> tuple[int, str | None]:
    slot, *path = payload.tolist()
    return slot, bytes(path).decode() if path else None


def unpack_chunks(payload: torch.Tensor) -> list[SeqChunk]:
    flat = payload.tolist()
    chunks, i = [], 1
    for _ in range(flat[0]):
        num_tokens, start, num_blocks, num_window_blocks, num_logits, long_rope, lora_slot = flat[i : i + 7]
        i += 7
        tokens = flat[i : i + num_tokens]
        i += num_tokens
        blocks = flat[i : i + num_blocks]
        i += num_blocks
        chunks.append(SeqChunk(tokens, start, blocks, num_logits, long_rope=bool(long_rope), lora_slot=lora_slot,
                               window_block_ids=flat[i : i + num_window_blocks]))
        i += num_window_blocks
    return chunks
