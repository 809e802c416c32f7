"""Tensor-parallel sharding of the Llama-family decoder (Megatron-style): what rank r of N holds.

- q heads [r*H/N, (r+1)*H/N): rows of q_proj (and its bias), columns of o_proj;
- kv heads [r*Hkv/N, (r+1)*Hkv/N) of k_proj and v_proj when N divides Hkv; when Hkv < N (N a
  multiple of Hkv) the one kv head its q heads read, r // (N / Hkv), held by N / Hkv ranks
  (replicated, as vLLM does): grouped-query attention never crosses a rank;
- intermediate rows [r*I/N, (r+1)*I/N) of gate_proj and up_proj, the same columns of down_proj;
  likewise for every expert of a mixture-of-experts layer (its own I) and a shared expert: each
  rank holds all experts, each cut to its share of their features, so routing needs no
  communication and the experts' partial sums join the layer's one all-reduce;
- everything else whole: embeddings, LM head, RMSNorm weights (q/k norms are per head_dim).

q/k/v and gate/up are column-parallel: a rank's product is its own heads' (features') output,
no communication. o_proj and down_proj are row-parallel: a rank's product is a partial sum over
its columns, all-reduced once each per layer; their biases are added by rank 0 alone.
Each rank's KV pool holds its kv heads of every block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferry.worker.models.config import ModelArch


class TensorParallelError(ValueError):
    """A tensor-parallel size that cannot apply to this model or machine."""


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's place in the tensor-parallel group."""

    rank: int = 0  # 0 is the engine's own process: it samples, and adds the row-parallel biases
    size: int = 1  # tensor_parallel_size: 1 is the unsharded model


UNSHARDED = Shard()


def check_divisible(arch: ModelArch, size: int) -> None:
    """TensorParallelError unless `arch` splits over `size` ranks as the module docstring says."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {size}")
    if arch.num_heads % size:
        raise TensorParallelError(
            f"num_attention_heads={arch.num_heads} is not divisible by tensor_parallel_size={size}"
        )
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        raise TensorParallelError(
            f"num_key_value_heads={arch.num_kv_heads} neither divides nor is divisible by tensor_parallel_size={size}"
        )
    sizes = {"intermediate_size": arch.intermediate_size}
    if arch.moe is not None:
        sizes["moe_intermediate_size"] = arch.moe.intermediate_size
        sizes["shared_expert_intermediate_size"] = arch.moe.shared_intermediate_size
    for field, value in sizes.items():
        if value % size:
            raise TensorParallelError(f"{field}={value} is not divisible by tensor_parallel_size={size}")


def local_arch(arch: ModelArch, shard: Shard) -> ModelArch:
    """The shapes one rank's layers have: its heads and its share of the MLP."""
    if shard.size == 1:
        return arch
    moe = arch.moe and replace(
        arch.moe,
        intermediate_size=arch.moe.intermediate_size // shard.size,
        shared_intermediate_size=arch.moe.shared_intermediate_size // shard.size,
    )
    return replace(
        arch,
        num_heads=arch.num_heads // shard.size,
        num_kv_heads=max(arch.num_kv_heads // shard.size, 1),
        intermediate_size=arch.intermediate_size // shard.size,
        moe=moe,
    )


def mlp_intermediate_size(arch: ModelArch, target: str) -> int:
    """The feature count of the MLP that parameter `target` belongs to: an expert's, a shared
    expert's, or the dense MLP's."""
    if arch.moe is not None and ".mlp.experts." in target:
        return arch.moe.intermediate_size
    if arch.moe is not None and ".mlp.shared_expert." in target:
        return arch.moe.shared_intermediate_size
    return arch.intermediate_size


def first_kv_head(arch: ModelArch, shard: Shard) -> int:
    """The first of the rank's kv heads (in the unsharded model's numbering)."""
    if arch.num_kv_heads >= shard.size:
        return shard.rank * (arch.num_kv_heads // shard.size)
    return shard.rank // (shard.size // arch.num_kv_heads)


def holds_kv_heads(arch: ModelArch, shard: Shard) -> bool:
    """Whether this rank is the first holder of its kv heads (the one snapshots read them from)."""
    if arch.num_kv_heads >= shard.size:
        return True
    return shard.rank % (shard.size // arch.num_kv_heads) == 0


def checkpoint_index(arch: ModelArch, shard: Shard, target: str, part: str | None) -> tuple[slice, ...] | None:
    """The index into a checkpoint tensor (safetensors' get_slice) that this rank reads for
    parameter `target` (a fused `part`: q, k, v, gate, up); () for the whole tensor; None when
    the rank holds no part of it (a row-parallel bias on ranks other than 0)."""
    if shard.size == 1:
        return ()
    local = local_arch(arch, shard)
    d = arch.head_dim
    q = slice(shard.rank * local.num_heads * d, (shard.rank + 1) * local.num_heads * d)
    kv_start = first_kv_head(arch, shard) * d
    kv = slice(kv_start, kv_start + local.num_kv_heads * d)
    features = mlp_intermediate_size(local, target)
    mlp = slice(shard.rank * features, (shard.rank + 1) * features)
    if part is not None:  # column-parallel: the rank's output rows (weight and bias alike)
        return ({"q": q, "k": kv, "v": kv, "gate": mlp, "up": mlp}[part],)
    if target.endswith(("self_attn.o_proj.bias", "down_proj.bias")):
        return () if shard.rank == 0 else None
    if target.endswith("self_attn.o_proj.weight"):  # row-parallel: the rank's input columns
        return (slice(None), q)
    if target.endswith(("down_proj.weight", "mlp.experts.w2")):
        return (slice(None), mlp)
    return ()
