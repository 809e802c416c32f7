"""One Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3, Phi-3, and with mixture-of-experts
MLPs Mixtral, Qwen2-MoE, Qwen3-MoE: worker/models/moe.py; Gemma 2/3's sandwich-norm layers:
GemmaDecoderLayer) over a paged KV cache.

The model sees one flat batch per step: every scheduled token of every request, one row each.
q/k/v and gate/up are fused into single projections (fewer, larger matrix products); the
checkpoint's separate tensors are copied into slices of them by `loader.py`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ferry.kernels import ops
from ferry.kernels.ops import AttentionMetadata, QuantizedParts, QuantizedWeight
from ferry.worker.models.config import ModelArch, rope_cos_sin_cache
from ferry.worker.models.kv_split import WindowedKV, kv_split, layer_kv
from ferry.worker.models.lora_layers import LoraContext, LoraLinear
from ferry.worker.models.moe import Experts, SparseMoe
from ferry.worker.models.sharding import UNSHARDED, Shard, local_arch


def _linear(layer: nn.Linear | PackedLinear | LoraLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's product through the kernel dispatch (a packed layer's through the CPU kernel;
    with LoRA slots, plus each row's adapter update)."""
    if isinstance(layer, LoraLinear):
        return layer(x)
    return ops.linear(x, layer.weight, layer.bias)


class PackedLinear(nn.Module):
    """An nn.Linear whose weight only the CPU product reads: packed once for it
    (`kernels.pack_linear_weight`) or kept quantized (`kernels.QuantizedWeight`). The [out, in]
    tensor itself is dropped, so the weights are held once."""

    def __init__(self, weight, bias: torch.Tensor | None) -> None:  # a native PackedWeight, QuantizedWeight or -Parts
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        for i, held in enumerate(_held_tensors(weight)):  # counted by buffers(), like a weight
            self.register_buffer("packed" if i == 0 else f"packed_{i}", held, persistent=False)
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        form = self.weight.qtype if isinstance(self.weight, (QuantizedWeight, QuantizedParts)) else "packed"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {form}"


def swap_in_packed_linears(root: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Replace every plain nn.Linear under `root` by a PackedLinear where the kernel dispatch packs
    its weight (float32 on the cpu backend). Returns (parent, attribute, the original) per swap."""
    swapped = []
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            packed = ops.pack_linear_weight(child.weight.detach())
            if packed is not None:
                setattr(parent, name, PackedLinear(packed, child.bias))
                swapped.append((parent, name, child))
    return swapped


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized (a GGUF's, often also the tied LM head): a lookup
    dequantizes only the rows asked for."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("packed", weight.tiles, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.out_features}, {self.weight.in_features}, {self.weight.qtype}"


def _held_tensors(weight) -> list[torch.Tensor]:
    if isinstance(weight, QuantizedParts):
        return [part.tiles for part in weight.parts]
    return [weight.tiles if isinstance(weight, QuantizedWeight) else weight.panels]


def _all_reduce(partial: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A row-parallel product's partial sums (one per rank) -> the whole product, on every rank."""
    if shard.size > 1:
        dist.all_reduce(partial)
    return partial


class Attention(nn.Module):
    """One rank's heads (`arch` is the rank's local_arch): q/k/v column-parallel, o_proj row-parallel."""

    def __init__(self, arch: ModelArch, shard: Shard, window: int | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.window = window  # sliding-window attention over the last `window` positions; None: full
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5 if arch.gemma is None else arch.gemma.query_pre_attn_scalar**-0.5
        self.softcap = None if arch.gemma is None else arch.gemma.attn_logit_softcap
        self.eps = arch.rms_norm_eps
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias and shard.rank == 0)
        if arch.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(arch.head_dim))
            self.k_norm = nn.Parameter(torch.ones(arch.head_dim))
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        cos_sin: torch.Tensor,  # [max_positions, head_dim] float32
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = _linear(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)[0]
            k = ops.rms_norm(k, self.k_norm, self.eps)[0]
        q = ops.rotary_and_write_kv(q, k, v, positions, cos_sin, True, k_cache, v_cache, slot_mapping)
        options = {} if self.softcap is None else {"softcap": self.softcap}
        if self.window is not None and self.window < meta.max_seq_len:
            options["window"] = self.window
        # (else every context fits the window: full attention is the same)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, **options)
        return _all_reduce(_linear(self.o_proj, out.reshape(num_tokens, self.q_size)), self.shard)


class MLP(nn.Module):
    """One rank's share of the features (`arch` is the rank's local_arch): gate/up column-parallel,
    down_proj row-parallel. `intermediate_size` other than the arch's: a MoE model's shared
    expert, whose partial sums its SparseMoe all-reduces with the experts' (`reduce` False)."""

    def __init__(
        self, arch: ModelArch, shard: Shard, intermediate_size: int | None = None, reduce: bool = True
    ) -> None:
        super().__init__()
        self.shard = shard if reduce else Shard(shard.rank, 1)
        self.intermediate_size = intermediate_size or arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * self.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, arch.hidden_size, bias=arch.mlp_bias and shard.rank == 0)
        self.act_and_mul = ops.silu_and_mul if arch.gemma is None else ops.gelu_tanh_and_mul  # Gemma: GeGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = _linear(self.down_proj, self.act_and_mul(_linear(self.gate_up_proj, x)))
        return _all_reduce(hidden, self.shard)


def _mlp(arch: ModelArch, shard: Shard, layer: int) -> MLP | SparseMoe:
    moe = arch.moe
    if moe is None or layer not in moe.sparse_layers:
        return MLP(arch, shard)
    shared = MLP(arch, shard, moe.shared_intermediate_size, reduce=False) if moe.shared_intermediate_size else None
    return SparseMoe(arch.hidden_size, moe, shard, shared)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, shard: Shard, layer: int) -> None:
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.self_attn = Attention(arch, shard, arch.layer_windows[layer] if arch.layer_windows else None)
        self.mlp = _mlp(arch, shard, layer)
        self.input_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(arch.hidden_size))

    def forward(self, x, residual, positions, cos_sin, k_cache, v_cache, slot_mapping, meta):
        # residual carries the un-normalised stream; rms_norm adds the previous block's output to it.
        x, residual = ops.rms_norm(x, self.input_layernorm, self.eps, residual)
        x = self.self_attn(x, positions, cos_sin, k_cache, v_cache, slot_mapping, meta)
        x, residual = ops.rms_norm(x, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(x), residual


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 2/3's layer: sandwich norms. transformers' residual + post_attention_norm(attention)
    and residual + post_feedforward_norm(mlp) are the fused residual adds of the next norm (the
    pre-feedforward norm here, the next layer's input norm or the final norm after). Norm
    weights hold 1 + w (the loader adds the 1)."""

    def __init__(self, arch: ModelArch, shard: Shard, layer: int) -> None:
        super().__init__(arch, shard, layer)
        self.pre_feedforward_layernorm = nn.Parameter(torch.ones(arch.hidden_size))
        self.post_feedforward_layernorm = nn.Parameter(torch.ones(arch.hidden_size))

    def forward(self, x, residual, positions, cos_sin, k_cache, v_cache, slot_mapping, meta):
        x, residual = ops.rms_norm(x, self.input_layernorm, self.eps, residual)
        x = self.self_attn(x, positions, cos_sin, k_cache, v_cache, slot_mapping, meta)
        x = ops.rms_norm(x, self.post_attention_layernorm, self.eps)[0]
        x, residual = ops.rms_norm(x, self.pre_feedforward_layernorm, self.eps, residual)
        return ops.rms_norm(self.mlp(x), self.post_feedforward_layernorm, self.eps)[0], residual


class LlamaModel(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `compute_logits` only for sampled rows.

    With a `shard` of a tensor-parallel group the layers hold that rank's heads and features
    (worker/models/sharding.py); embeddings, norms and the LM head stay whole on every rank, and
    `forward` returns the same hidden states on all of them."""

    def __init__(self, arch: ModelArch, max_positions: int, shard: Shard = UNSHARDED) -> None:
        super().__init__()
        self.arch = arch
        self.shard = shard
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        local = local_arch(arch, shard)
        layer_class = DecoderLayer if arch.gemma is None else GemmaDecoderLayer
        self.layers = nn.ModuleList(layer_class(local, shard, i) for i in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(arch.vocab_size, arch.hidden_size))
        self.register_buffer("cos_sin", rope_cos_sin_cache(arch.rope, arch.head_dim, max_positions), persistent=False)
        # Gemma 3: the sliding layers' own rotary table (`layer_cos_sin` picks each layer's)
        local_rope = arch.gemma.local_rope if arch.gemma is not None else None
        local_table = None if local_rope is None else rope_cos_sin_cache(local_rope, arch.head_dim, max_positions)
        self.register_buffer("cos_sin_local", local_table, persistent=False)
        self._local_rope_layers = frozenset(arch.gemma.local_rope_layers if local_rope is not None else ())
        # Gemma: embeddings times sqrt(hidden_size), in the weights' dtype as transformers rounds it
        self.embed_scale = None if arch.gemma is None else arch.hidden_size**0.5
        self.lm_head_packed = None  # the head packed for the CPU product, once pack_weights() ran
        self.native_stack = None  # every layer as one native call for decode steps, once pack_weights() ran
        self.lora: LoraContext | None = None  # the step's adapter rows, once lora_layers.attach_lora() ran

    @property
    def lm_head_weight(self) -> torch.Tensor | QuantizedWeight:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def keep_quantized(self, weights: Mapping[str, QuantizedWeight]) -> None:
        """Hold these matrices quantized, dropping their float tensors. Names as in
        named_parameters(): a projection's `layers.{i}.<module>.weight`, `embed_tokens.weight`,
        `lm_head`, and a layer's experts `layers.{i}.mlp.experts.w13` / `.w2` (every expert's matrix,
        `kernels.quantized_experts`). Call before pack_weights()."""
        for name, weight in weights.items():
            if name == "embed_tokens.weight":
                self.embed_tokens = QuantizedEmbedding(weight)
            elif name == "lm_head":
                del self.lm_head  # a Parameter slot cannot hold a QuantizedWeight
                self.lm_head = weight
                self.register_buffer("lm_head_tiles", weight.tiles, persistent=False)
            else:
                parent, _, child = name.removesuffix(".weight").rpartition(".")
                module = self.get_submodule(parent)
                if isinstance(module, Experts):  # `layers.{i}.mlp.experts.w13` / `.w2`: every expert's
                    module.keep(child, weight)
                else:
                    setattr(module, child, PackedLinear(weight, getattr(module, child).bias))

    @torch.no_grad()
    def pack_weights(self) -> int:
        """Swap every projection for a PackedLinear where the kernel dispatch has a packed
        product for its weight (float32 on the cpu backend), and pack the LM head beside its
        tensor (the embedding lookup still reads a tied one). Call once the weights are loaded;
        returns the number of matrices packed."""
        count = len(swap_in_packed_linears(self))
        count += sum(module.pack() for module in self.modules() if isinstance(module, Experts))
        head = self.lm_head_weight
        self.lm_head_packed = ops.pack_linear_weight(head) if isinstance(head, torch.Tensor) else None
        self.native_stack = self._build_native_stack()
        return count + (self.lm_head_packed is not None)

    def _build_native_stack(self):
        """`kernels.decoder_stack` over the packed layers, or None where some projection stayed
        a plain tensor (not float32, or another backend) or the layers are sharded (the native
        stack runs every layer in one call, with no point between them for the all-reduces)."""
        if self.shard.size > 1 or not all(isinstance(layer.mlp, MLP) for layer in self.layers):
            return None  # (the native stack's layers have dense MLPs)
        projections = [
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for layer in self.layers
        ]
        if not all(isinstance(p, PackedLinear) for group in projections for p in group):
            return None
        split = kv_split(self.arch)  # where the runner keeps the windowed layers' KV apart
        layers = []
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(self.layers, projections, strict=True)):
            windowed, pool_index = split.pool_index(i) if split is not None else (False, i)
            gemma = isinstance(layer, GemmaDecoderLayer)
            layers.append(ops.StackLayer(
                input_norm=layer.input_layernorm,
                post_attention_norm=layer.post_attention_layernorm,
                q_norm=layer.self_attn.q_norm,
                k_norm=layer.self_attn.k_norm,
                qkv=qkv.weight,
                qkv_bias=qkv.bias,
                o=o.weight,
                o_bias=o.bias,
                gate_up=gate_up.weight,
                gate_up_bias=gate_up.bias,
                down=down.weight,
                down_bias=down.bias,
                pre_feedforward_norm=layer.pre_feedforward_layernorm if gemma else None,
                post_feedforward_norm=layer.post_feedforward_layernorm if gemma else None,
                gelu=layer.mlp.act_and_mul is ops.gelu_tanh_and_mul,
                softcap=layer.self_attn.softcap,
                local_rope=i in self._local_rope_layers,
                window=layer.self_attn.window,
                windowed=windowed,
                pool_index=pool_index,
            ))
        attn = self.layers[0].self_attn
        return ops.decoder_stack(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.arch.rms_norm_eps, attn.scale, self.norm, layers
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        windowed: WindowedKV | None = None,  # a hybrid model's windowed layers' pool; kv_cache then holds the full ones
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        with ops.pinned_backend(x) as backend:
            adapted = self.lora is not None and self.lora.active  # (the native stack has no adapter slots)
            if self.native_stack is not None and backend == "cpu" and not adapted:
                pools = {} if windowed is None else {"window_pool": windowed.pool,
                                                     "window_slot_mapping": windowed.slot_mapping,
                                                     "window_meta": windowed.meta}
                hidden = self.native_stack.forward(x, positions, self.cos_sin, kv_cache, slot_mapping, meta,
                                                   self.cos_sin_local, **pools)
                if hidden is not None:  # a decode / verification step: all layers in one call
                    return hidden
            for i, layer in enumerate(self.layers):
                k_cache, v_cache, slots, layer_meta = layer_kv(i, kv_cache, slot_mapping, meta, windowed)
                x, residual = layer(x, residual, positions, self.layer_cos_sin(i), k_cache, v_cache, slots, layer_meta)
            return ops.rms_norm(x, self.norm, self.arch.rms_norm_eps, residual)[0]

    def layer_cos_sin(self, layer: int) -> torch.Tensor:
        """The rotary table layer `layer` reads (Gemma 3's sliding layers: their own)."""
        return self.cos_sin_local if layer in self._local_rope_layers else self.cos_sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        head = self.lm_head_weight if self.lm_head_packed is None else self.lm_head_packed
        logits = ops.linear(hidden, head)
        cap = None if self.arch.gemma is None else self.arch.gemma.final_logit_softcap
        if cap is not None:  # Gemma: cap * tanh(logits / cap), in the logits' dtype as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
