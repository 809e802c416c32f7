"""Where a mixture-of-experts checkpoint's expert tensors go in Ferry's stacked experts
(worker/models/moe.py: `mlp.experts.w13` [E, 2 * I, H], gate rows then up rows; `mlp.experts.w2`
[E, H, I]), and which slice of each a tensor-parallel rank reads.

Checkpoints name each expert's matrices: Mixtral `block_sparse_moe.experts.{e}.w1` (gate), `w3`
(up), `w2` (down); Qwen2/3-MoE `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`. transformers 5
holds them stacked in memory (`mlp.experts.gate_up_proj` [E, 2 * I, H], `down_proj` [E, H, I]),
and a checkpoint saved that way is read as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ferry.worker.models.config import ModelArch
from ferry.worker.models.sharding import Shard, checkpoint_index

W13, W2 = "mlp.experts.w13", "mlp.experts.w2"

_PER_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PIECES = {"w1": (W13, "gate"), "gate_proj": (W13, "gate"), "w3": (W13, "up"), "up_proj": (W13, "up"),
           "w2": (W2, None), "down_proj": (W2, None)}
_STACKED = {"mlp.experts.gate_up_proj": W13, "mlp.experts.down_proj": W2}


@dataclass(frozen=True, slots=True)
class ExpertPart:
    """What one checkpoint tensor fills of a stacked expert parameter: one expert's matrix
    (`expert`), or all of them (None: the tensor is stacked [E, ...] itself); of w13, the gate or
    the up rows (`piece`), or for a stacked gate_up both, read piece by piece."""

    expert: int | None
    piece: str | None


def map_expert_name(layer: str, rest: str) -> tuple[str, ExpertPart] | None:
    """(Ferry parameter, part) for an expert tensor `rest` of layer `layer`; None for any other."""
    if (match := _PER_EXPERT.match(rest)) is not None:
        target, piece = _PIECES[match.group(2)]
        return f"layers.{layer}.{target}", ExpertPart(int(match.group(1)), piece)
    if rest in _STACKED:
        return f"layers.{layer}.{_STACKED[rest]}", ExpertPart(None, None)
    return None


def router_name(rest: str) -> str:
    """Mixtral's router `block_sparse_moe.gate.weight` under Ferry's name (`mlp.gate.weight`)."""
    return "mlp." + rest.removeprefix("block_sparse_moe.") if rest.startswith("block_sparse_moe.gate.") else rest


def expert_slices(arch: ModelArch, shard: Shard, target: str, part: ExpertPart):
    """(part, index into the checkpoint tensor) for each piece of it this rank reads: the rank's
    share of each expert's features (sharding.checkpoint_index on one expert's matrix), with a
    leading `:` over the experts of a stacked tensor."""
    lead = (slice(None),) if part.expert is None else ()
    pieces = [part.piece] if part.piece is not None or target.endswith(W2) else ["gate", "up"]
    for piece in pieces:
        index = checkpoint_index(arch, shard, target, piece) or (slice(None),)
        if piece is not None and part.piece is None:  # a stacked gate_up: the piece's rows within it
            rows = _piece_rows(arch, piece)
            index = (slice(rows.start + (index[0].start or 0), rows.start + (index[0].stop or rows.stop - rows.start)),)
        yield ExpertPart(part.expert, piece), lead + index


def expert_dest(param: torch.Tensor, local: ModelArch, part: ExpertPart) -> torch.Tensor:
    """The view of a stacked expert parameter that a checkpoint piece fills on this rank."""
    dest = param if part.expert is None else param[part.expert]
    if part.piece is None:
        return dest
    rows = _piece_rows(local, part.piece)
    return dest.narrow(dest.dim() - 2, rows.start, rows.stop - rows.start)


def _piece_rows(arch: ModelArch, piece: str) -> slice:
    inter = arch.moe.intermediate_size
    return slice(0, inter) if piece == "gate" else slice(inter, 2 * inter)
