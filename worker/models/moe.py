"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) of one decoder layer.

A router (`gate`, [num_experts, hidden]) scores each token; its softmax's top-k experts run, and
their outputs are summed with the top-k probabilities as weights (renormalised to 1 where the
model says so). The experts are held stacked, as transformers holds them: `w13` [E, 2 * I, H]
(gate rows then up rows) and `w2` [E, H, I]; `kernels.ops.fused_moe` groups the tokens by expert
so each expert runs one product per projection per step. With tensor parallelism every rank
holds every expert cut to its share of the features (worker/models/sharding.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ferry.kernels import ops
from ferry.worker.models.config import MoeConfig
from ferry.worker.models.sharding import Shard


class Experts(nn.Module):
    """Every expert's gated MLP, stacked. `keep()` holds a projection in quantized blocks (a GGUF
    file's, or int8 made at load); `pack()` swaps the float stacks left for the cpu backend's
    per-expert packed matrices where that backend runs them. Either way the bytes are held once,
    as buffers."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @torch.no_grad()
    def keep(self, name: str, experts) -> None:
        """Hold projection `name` ("w13" or "w2") as `experts` (`kernels.quantized_experts`),
        dropping its float stack. Call before pack()."""
        if name not in ("w13", "w2"):
            raise ValueError(f"an experts module holds w13 and w2, not {name!r}")
        delattr(self, name)
        self._hold(name, experts)

    @torch.no_grad()
    def pack(self) -> bool:
        floats = [name for name in ("w13", "w2") if isinstance(getattr(self, name), torch.Tensor)]
        # A projection kept quantized makes this layer a cpu-path layer: its float one then goes
        # through the same per-expert product even where no packed product runs it.
        unpacked_ok = len(floats) < 2
        packed = {name: ops.pack_experts(getattr(self, name), unpacked_ok) for name in floats}
        if not packed or any(p is None for p in packed.values()):
            return False
        for name, experts in packed.items():
            delattr(self, name)
            self._hold(name, experts)
        return True

    def _hold(self, name: str, experts) -> None:
        setattr(self, name, experts)
        for i, held in enumerate(experts.held_tensors):  # counted by buffers(), like a weight
            self.register_buffer(f"{name}_packed_{i}", held, persistent=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoe(nn.Module):
    """One rank's experts of a layer (`moe` is the rank's local MoeConfig), plus Qwen2-MoE's shared
    expert: an ordinary gated MLP on every token (`shared_expert`, built by the decoder without
    its own all-reduce), scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden_size: int, moe: MoeConfig, shard: Shard, shared_expert: nn.Module | None) -> None:
        super().__init__()
        self.shard = shard
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router, whole on every rank
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, top_k] float32 weights, [T, top_k] int64 experts): softmax over the router's
        logits in float32, its top k, renormalised where the model says so (transformers' order)."""
        probs = torch.softmax(ops.linear(x, self.gate.weight).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self.experts(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        if self.shard.size > 1:  # each rank summed its share of every expert's features
            dist.all_reduce(out)
        return out
