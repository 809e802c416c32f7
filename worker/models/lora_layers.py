"""LoRA slots inside the model: each adaptable projection holds `max_loras` adapters' A and B in
device memory, and one flat batch mixes rows of different adapters and rows of none.

A projection fusing several checkpoint tensors (q|k|v, gate|up) holds each part's slots apart,
and each part adds into its own columns of the fused output:

    lora_a_{i} [slots, R, in]          part i's A in rows [0, r)
    lora_b_{i} [slots, part rows, R]   part i's B in columns [0, r)

Ranks below R stay zero-padded. Every row of a step has a slot (`LoraContext.mapping`, set by
the model runner before the forward pass; -1: the base model alone) and `kernels.ops.add_lora`
adds each row's own adapter's update to the base product (BGMV/SGMV). Under tensor
parallelism a rank holds its shard of each adapter, cut like the base weights: B's rows of a
column-parallel projection (q/k/v, gate/up), A's columns of a row-parallel one (o, down), whose
partial updates then join the base's partial sums in the layer's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ferry.kernels import ops
from ferry.kernels.metadata import LoraMapping
from ferry.worker.models.config import ModelArch, reorder_rotary_rows
from ferry.worker.models.lora_adapter import PROJECTIONS, LoraWeights
from ferry.worker.models.sharding import Shard, checkpoint_index, local_arch


@dataclass(slots=True)
class LoraContext:
    """What every LoraLinear of one model reads in a forward pass: the step's row -> slot mapping."""

    mapping: LoraMapping | None = None  # None or not .active: no row uses an adapter this step
    active_slots: frozenset[int] = field(default_factory=frozenset)

    def set(self, mapping: LoraMapping | None) -> None:
        self.mapping = mapping
        self.active_slots = frozenset(slot for slot, _ in mapping.groups) if mapping is not None else frozenset()

    @property
    def active(self) -> bool:
        return self.mapping is not None and self.mapping.active


class LoraLinear(nn.Module):
    """A projection (nn.Linear or PackedLinear, called through the kernel dispatch) plus its
    adapters' low-rank updates for the rows that use one. Each part of a fused projection (q, k,
    v; gate, up) has its own slots, `lora_a_{i}` [slots, R, in] and `lora_b_{i}` [slots, part
    rows, R], and adds into its own columns of the output: a step reads only the parts some
    adapter in it adapts, and no B is padded out to the whole fused width."""

    def __init__(self, base: nn.Module, context: LoraContext, in_features: int, part_rows: list[int],
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.part_rows = part_rows  # this rank's output rows of each part, in order
        self.part_starts = [sum(part_rows[:i]) for i in range(len(part_rows))]
        for i, rows in enumerate(part_rows):
            self.register_buffer(f"lora_a_{i}", torch.zeros(max_loras, max_rank, in_features, dtype=dtype,
                                                            device=device), persistent=False)
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, rows, max_rank, dtype=dtype, device=device),
                                 persistent=False)
        self.part_used = [[False] * max_loras for _ in part_rows]  # [part][slot]: that slot's adapter adapts it

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        y = ops.linear(x, self.base.weight, self.base.bias)
        context = self.context
        if not context.active:
            return y
        whole = len(self.part_rows) == 1
        for i, (start, rows, used) in enumerate(zip(self.part_starts, self.part_rows, self.part_used, strict=True)):
            if any(used[s] for s in context.active_slots):
                columns = y if whole else y[:, start:start + rows]  # this part's outputs (a view: added in place)
                ops.add_lora(columns, x, getattr(self, f"lora_a_{i}"), getattr(self, f"lora_b_{i}"), context.mapping)
        return y

    @torch.no_grad()
    def write(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` := one (A [r, in], B [part rows, r]) per part, this rank's shard (None: the
        adapter leaves that part alone). Ranks below R stay zero."""
        for i, pair in enumerate(pairs):
            a_slot, b_slot = getattr(self, f"lora_a_{i}")[slot], getattr(self, f"lora_b_{i}")[slot]
            a_slot.zero_()
            b_slot.zero_()
            if pair is not None:
                a, b = pair
                a_slot[:a.shape[0]].copy_(a)
                b_slot[:, :b.shape[1]].copy_(b)
            self.part_used[i][slot] = pair is not None

    def clear(self, slot: int) -> None:
        self.write(slot, [None] * len(self.part_rows))


def attach_lora(model, max_loras: int, max_rank: int) -> LoraContext:
    """Wrap every adaptable projection of a native LlamaModel in a LoraLinear with empty slots
    (after pack_weights: the native decode stack keeps the base weights it packed and runs the
    steps no adapter row is in). Returns the context the model runner sets each step."""
    context = LoraContext()
    for layer in model.layers:
        for projection in PROJECTIONS:
            parent_name, child_name = projection.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, child_name, None)
            if base is None:  # a mixture-of-experts layer's mlp: no dense projections
                continue
            in_features, rows = _local_shape(parent, projection)
            setattr(parent, child_name, LoraLinear(base, context, in_features, rows, max_loras, max_rank,
                                                   model.norm.dtype, model.norm.device))
    model.lora = context
    return context


def _local_shape(parent: nn.Module, projection: str) -> tuple[int, list[int]]:
    """(in_features, this rank's rows of each part) of one projection, from its module's sizes."""
    if projection == "self_attn.qkv_proj":
        return parent.qkv_proj.in_features, [parent.q_size, parent.kv_size, parent.kv_size]
    if projection == "self_attn.o_proj":
        return parent.q_size, [parent.o_proj.out_features]
    if projection == "mlp.gate_up_proj":
        inter = parent.intermediate_size
        return parent.gate_up_proj.in_features, [inter, inter]
    return parent.intermediate_size, [parent.down_proj.out_features]


@torch.no_grad()
def write_slot(model, slot: int, weights: LoraWeights, arch: ModelArch, shard: Shard) -> None:
    """Put an adapter (the whole model's tensors) into slot `slot` of every projection, cut to
    `shard`'s part; `arch` is the whole model's."""
    local = local_arch(arch, shard)
    for i, layer in enumerate(model.layers):
        for projection, parts in PROJECTIONS.items():
            parent_name, child_name = projection.split(".")
            module = getattr(getattr(layer, parent_name), child_name, None)
            if not isinstance(module, LoraLinear):
                continue
            target = f"layers.{i}.{projection}.weight"
            pairs = [_shard_pair(weights.pairs.get((i, projection, part)), arch, shard, target, part)
                     for part in parts]
            if projection == "self_attn.qkv_proj" and arch.rope.rotary_dim:
                pairs = _rotary_order(pairs, module.part_rows, local)
            module.write(slot, pairs)


def clear_slot(model, slot: int) -> None:
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.clear(slot)


def _rotary_order(pairs: list, part_rows: list[int], local: ModelArch) -> list:
    """q and k parts' B rows in the order the base's q/k rows were put in at load (partial rotary:
    config.reorder_rotary_rows, which reorders the q and k heads of a fused q/k/v row block)."""
    out = list(pairs)
    for i in (0, 1):  # q, k
        if pairs[i] is None:
            continue
        a, b = pairs[i]
        fused = b.new_zeros(sum(part_rows), b.shape[1])  # [q + 2 kv, r]
        start = sum(part_rows[:i])
        fused[start:start + part_rows[i]] = b
        reorder_rotary_rows(fused, local)
        out[i] = (a, fused[start:start + part_rows[i]])
    return out


def _shard_pair(pair, arch: ModelArch, shard: Shard, target: str, part: str | None):
    """This rank's (A, B) of a pair: the base weight's index (sharding.checkpoint_index) cuts B's
    rows for a column-parallel part, A's columns for a row-parallel projection."""
    if pair is None:
        return None
    index = checkpoint_index(arch, shard, target, part)
    if not index:
        return pair.a, pair.b
    if part is not None:
        return pair.a, pair.b[index[0]]
    return pair.a[:, index[1]], pair.b
