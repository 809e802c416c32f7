"""Per-step metadata shared by every layer: attention's, and which LoRA adapter each row uses.

The model runner builds one `AttentionMetadata` per engine step; every layer passes the same
object to `kernels.paged_attention`. Likewise one `LoraMapping` per step, passed by every
adapted projection to `kernels.add_lora`. The Triton backend reads the device tensors; the PyTorch
reference (the CPU path) additionally derives a gather plan once per step from the host-side
lists and caches it on the object, so 30 layers do not re-plan 30 times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the backends import this module; their plan types are named here for readers only
    from ferry.kernels.cpu.native import ShortQueryPlan
    from ferry.kernels.reference import GatherPlan
    from ferry.kernels.triton.paged_attention_kernel import TritonPlan


@dataclass
class BackendPlans:
    """What each attention backend derives from one step's metadata, once for all layers."""

    # the reference's gather plans: by min_query_len, and by (min_query_len, window) for a windowed layer
    torch: dict[int | tuple[int, int], GatherPlan] = field(default_factory=dict)
    cpu: ShortQueryPlan | None = None  # the native backend's split into short and long query runs
    triton: TritonPlan | None = None  # the Triton kernel's work lists
    # Scratch buffers the reference reuses; the model runner passes one dict for its lifetime, so
    # they outlive the step (a bare call gets a dict for this step only).
    workspace: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths into the flat batch
    seq_lens: torch.Tensor  # [num_seqs] int32: context length of each sequence incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32: pool block ids, padded with 0
    block_size: int  # tokens per KV block
    query_lens_host: list[int]  # host copy of the query lengths (no device sync when planning)
    seq_lens_host: list[int]  # host copy of seq_lens
    max_query_len: int
    max_seq_len: int
    plans: BackendPlans = field(default_factory=BackendPlans)  # per-backend plans, built lazily

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from host lists: one entry per sequence, query tokens are the last
        `query_lens[i]` positions of a context of `seq_lens[i]` tokens."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q < 1 or q > s:
                raise ValueError(f"each query length must be in [1, seq_len]; got {q} for seq_len {s}")
            if len(table) * block_size < s:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s} tokens")
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), max_blocks),
            block_size=block_size,
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


_MAX_PADDING = 2.0  # a padded grid is used while it holds at most this many places per adapted row


def _padded_grid(adapted: torch.Tensor, segments: list[tuple[int, int, int]], device):
    """LoraMapping.padded for these groups, or None where the grid would be mostly padding (one
    adapter with many rows beside others with few)."""
    slots, width = segments[-1][0] + 1, max(count for _, _, count in segments)
    if slots * width > _MAX_PADDING * adapted.numel():
        return None
    rows = torch.zeros(slots * width, dtype=torch.int64)  # spare places read row 0 (their result is dropped)
    valid = torch.empty(adapted.numel(), dtype=torch.int64)
    for slot, start, count in segments:
        rows[slot * width : slot * width + count] = adapted[start : start + count]
        valid[start : start + count] = torch.arange(slot * width, slot * width + count)
    return slots, width, rows.to(device), valid.to(device)


@dataclass
class LoraMapping:
    """Which LoRA slot each row of a flat batch uses this step (-1: none, the base model alone).

    Built once per step from a host list; `slot_of_row` serves the Triton kernels (each row reads
    its own slot's weights), `groups` the grouped CPU path (one product per slot present)."""

    slot_of_row: torch.Tensor  # [num_tokens] int64 on the batch's device; -1 where the row has no adapter
    groups: list[tuple[int, torch.Tensor]]  # (slot, row indices [n] int64 on device) per slot present, rows ascending
    all_rows_one_slot: int | None  # the slot when every row uses that same slot (no gather/scatter needed), else None
    # Every row with an adapter, grouped by slot ([n] int64 on device: the groups' rows end to end),
    # and each group's (slot, start, count) in it: the CPU path gathers and scatters once per product
    adapted_rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    # The same rows as one [slots, width] grid for batched products, where padding it costs little
    # (slots 0 .. the highest present, `width` rows each, the spare places filled with row 0):
    # `padded_rows` [slots * width] rows of x, `padded_valid` [n] each adapted row's place in it
    padded: tuple[int, int, torch.Tensor, torch.Tensor] | None = None  # (slots, width, padded_rows, padded_valid)

    @classmethod
    def build(cls, slot_of_row: list[int], device: torch.device | str = "cpu") -> LoraMapping:
        """Groups in ascending slot order. The rows of every group are slices of one device tensor,
        so a step costs two host-to-device copies however many slots it mixes."""
        if any(slot < -1 for slot in slot_of_row):
            raise ValueError(f"a LoRA slot is -1 (no adapter) or a slot index, got {min(slot_of_row)}")
        host = torch.tensor(slot_of_row, dtype=torch.int64)  # [num_tokens]
        order = torch.argsort(host, stable=True)  # rows by slot, ascending rows within a slot
        counts = torch.bincount(host + 1).tolist()  # counts[s + 1]: rows of slot s; counts[0]: rows with none
        order_dev = order.to(device)
        first = counts[0] if counts else 0
        groups, segments, start = [], [], first
        for slot, count in enumerate(counts[1:]):
            if count:
                groups.append((slot, order_dev[start : start + count]))
                segments.append((slot, start - first, count))
                start += count
        one_slot = groups[0][0] if len(groups) == 1 and groups[0][1].numel() == len(slot_of_row) else None
        padded = _padded_grid(order[first:], segments, device) if len(segments) > 1 else None
        return cls(host.to(device), groups, one_slot, order_dev[first:], segments, padded)

    @property
    def active(self) -> bool:
        """Some row uses an adapter (else `add_lora` has nothing to do)."""
        return bool(self.groups)
