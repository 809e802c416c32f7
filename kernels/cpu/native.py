"""The `cpu` backend: native kernels for what the PyTorch reference does slowly on a CPU.

- attention for short query runs (decode, speculative verification: at most `SHORT_QUERY_MAX`
  tokens per sequence), read straight from the block pool (`csrc/paged_attention_cpu.cpp`);
  longer prefill chunks are compute-bound and stay on the reference's SDPA path;
- RMSNorm with the residual add, rotary + KV write, silu * up: one pass each instead of 6-12
  small ops (`csrc/fused_ops_cpu.cpp`), which at decode batch sizes is mostly dispatch overhead;
- the float32 matrix products, with each weight packed once at load into column panels that
  a register-blocked kernel streams (`csrc/linear_cpu.cpp`): BLAS repacks W on every call and,
  at decode batch sizes (a few to a few dozen rows), reaches half the FMA units' rate;
- the same products with weights kept in GGUF block formats (`quantized.py`'s
  `QuantizedWeight`), dequantized in registers (`csrc/quantized_linear_cpu.cpp`): a batch-1 step
  reads a fifth to a sixth of float32's bytes.

The sources are compiled once per machine with torch's C++ extension builder (g++ and ninja;
about a minute) into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), then load in milliseconds. Where they cannot be built (no
compiler), or for an input they do not cover, the PyTorch reference runs (one warning).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ferry.kernels import reference
from ferry.kernels.cpu.quantized import QuantizedParts, QuantizedWeight
from ferry.kernels.metadata import AttentionMetadata
from ferry.kernels.stack_layer import StackLayer

log = logging.getLogger(__name__)

SHORT_QUERY_MAX = 16  # query tokens per sequence up to which the native kernel beats gather + SDPA
_SOURCES = [
    Path(__file__).resolve().parent / "csrc" / name  # resolved: one checkout reached two ways is one build
    for name in (
        "bindings.cpp",
        "paged_attention_cpu.cpp",
        "fused_ops_cpu.cpp",
        "linear_cpu.cpp",
        "quantized_linear_cpu.cpp",
        "quantized_linear_vnni.cpp",
        "quantized_linear_amx.cpp",
        "quantized_linear_int16_avx2.cpp",
        "quantized_rows_cpu.cpp",
        "decoder_stack_cpu.cpp",
        "stream_sum_cpu.cpp",
    )
]
# Instruction-set flags by what this CPU can run (torch's own dispatch level), not -march=native:
# a shared extension cache must not hold code another machine cannot execute.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

# AVX512_VNNI (vpdpwssd) runs the quantized product on int16 activations
# (csrc/quantized_linear_vnni.cpp). torch's level does not say whether a CPU has it, so the kernel
# reads the CPU's flags, builds with -mavx512vnni only where they list it, and names its cache
# entry after it: a machine without it builds and loads its own entry, never this one.
_VNNI_FLAGS = ["-mavx512vnni"]
# AMX-INT8 (Sapphire Rapids and later) runs the many-rows quantized product on the tile unit
# (csrc/quantized_linear_amx.cpp), in a cache entry of its own the same way. GCC never emits tile
# instructions by itself, so the flags reach only that kernel's intrinsics.
_AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split())
    except OSError:
        pass
    return set()


def _cpu_has_vnni() -> bool:
    return "avx512_vnni" in _cpu_flags()


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX's tile and int8 units (Sapphire Rapids and later)."""
    return {"amx_tile", "amx_int8"} <= _cpu_flags()


_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled extension, building it on first use; None where it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils import cpp_extension

            # The builder runs `ninja` from PATH; the pip-installed one sits beside this Python.
            bin_dir = str(Path(sys.executable).parent)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

            isa = torch.backends.cpu.get_cpu_capability()
            flags = list(_ISA_FLAGS.get(isa, []))
            vnni = isa == "AVX512" and _cpu_has_vnni()
            amx = vnni and cpu_has_amx()
            if vnni:
                flags += _VNNI_FLAGS
            if amx:
                flags += _AMX_FLAGS
            name = f"ferry_cpu_kernels_{isa.lower()}{'_vnni' if vnni else ''}{'_amx' if amx else ''}"
            torch_version = torch.__version__.replace("+", "-")
            # One build directory per checkout: torch rebuilds whenever the source paths differ from
            # the last build's, so two checkouts sharing one directory rebuilt each other's in turn.
            checkout = hashlib.sha256(str(_SOURCES[0].parent).encode()).hexdigest()[:8]
            build_dir = Path(cpp_extension.get_default_build_root()) / f"{name}-torch{torch_version}-{checkout}"
            log.info("loading native CPU kernels (%s; the first load on a machine compiles it: about a minute)", isa)
            with _exclusive_build(build_dir):
                _module = cpp_extension.load(
                    name=name,
                    sources=[str(path) for path in _SOURCES],
                    # -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled
                    # here; without it every kernel would run on one thread.
                    extra_cflags=["-O3", "-fopenmp", *flags],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
            _failed = True
            log.warning("native CPU kernels unavailable (%s); using the PyTorch reference", exc)
    return _module


@contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """One process at a time builds or loads from `build_dir`. torch's builder waits for as long as
    its `lock` file exists, and a process killed while building leaves that file behind: every
    later start would hang. An OS lock is released however its process dies, so under it a
    `lock` file found is stale and goes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / "ferry.flock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def available() -> bool:
    return load() is not None


@dataclass(frozen=True, slots=True)
class ShortQueryPlan:
    """One step's sequences split by query length: the native kernel takes the short runs."""

    short: torch.Tensor  # [n] int64: sequences with at most SHORT_QUERY_MAX query tokens
    has_long: bool  # whether any other sequence exists (the reference computes those)


def _short_sequences(meta: AttentionMetadata) -> ShortQueryPlan:
    if meta.plans.cpu is None:
        short = [i for i, q in enumerate(meta.query_lens_host) if q <= SHORT_QUERY_MAX]
        meta.plans.cpu = ShortQueryPlan(torch.tensor(short, dtype=torch.int64), len(short) < meta.num_seqs)
    return meta.plans.cpu


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`. The native kernel walks only the blocks a
    sliding window touches and caps the logits in place (window 0 / softcap 0.0 = off there)."""
    reference.check_attention_options(window, softcap)
    module = load()
    if module is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
    if not _heads_contiguous(q):
        q = q.contiguous()
    if out is None or not out.is_contiguous():
        out = torch.empty_like(q)
    plan = _short_sequences(meta)
    short, has_long = plan.short, plan.has_long
    if short.numel():
        module.paged_attention_short(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            short,
            scale,
            out,
            0 if window is None else int(window),
            0.0 if softcap is None else float(softcap),
        )
    if has_long:  # long prefill chunks are compute-bound: the reference's SDPA does them well
        reference.attend(
            q, k_cache, v_cache, meta, scale, out, min_query_len=SHORT_QUERY_MAX + 1, window=window, softcap=softcap
        )
    return out


def _heads_contiguous(t: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] whose rows may be strided (a view into a fused projection)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]; updated in place to x + residual
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm`, except that the residual stream is added into `residual` in place
    (the caller passes a tensor it will not read again)."""
    module = load()
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden) if x.dim() != 2 else x
    native = (
        module is not None
        and weight.dtype == x.dtype
        and rows.stride(-1) == 1
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()))
    )
    if not native:
        return reference.rms_norm(x, weight, eps, residual)
    residual_rows = None if residual is None else residual.view(-1, hidden)
    out = module.rms_norm(rows, residual_rows, weight, eps).view(x.shape)
    return out, (x if residual is None else residual)


def rotary_and_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32
    is_neox: bool,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> torch.Tensor:
    """Rotary on q and k, then k and v into the pool; returns the rotated q. The native path
    rotates q and k in place (views into this layer's fresh qkv projection)."""
    module = load()
    native = (
        module is not None
        and is_neox
        and _heads_contiguous(q)
        and _heads_contiguous(k)
        and _heads_contiguous(v)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.stride(-1) == 1
        and positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.dtype == k.dtype == v.dtype == k_cache.dtype
    )
    if not native:
        q, k = reference.rotary(q, k, positions, cos_sin_cache, is_neox)
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    module.rotary_write_kv(q, k, v, positions.contiguous(), cos_sin_cache, k_cache, v_cache, slot_mapping.contiguous())
    return q


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """An nn.Linear weight [out_features, in_features], float32, in `linear_packed`'s layout:
    panels [ceil(out_features / 16), in_features, 16], panels[p, k, c] = W[16 p + c, k]."""

    panels: torch.Tensor
    out_features: int
    in_features: int


_packed_supported: bool | None = None  # whether the packed product was built (asked once, not per call)


def _packed_module():
    global _packed_supported
    module = load()
    if _packed_supported is None:
        _packed_supported = module is not None and module.linear_packed_supported()
    return module if _packed_supported else None


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` packed for `linear`, or None where the packed product cannot run it (not a
    float32 CPU matrix, or no AVX2 build): the caller keeps the tensor and gets F.linear."""
    module = _packed_module()
    if module is None or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    out_features, in_features = weight.shape
    return PackedWeight(module.pack_linear_weight(weight.detach()), out_features, in_features)


def linear(
    x: torch.Tensor,  # [..., in_features]
    weight: torch.Tensor | PackedWeight | QuantizedWeight | QuantizedParts,  # [out_features, in_features], or packed
    bias: torch.Tensor | None = None,  # [out_features]
    out: torch.Tensor | None = None,  # [rows, out_features] contiguous float32: written instead of a new tensor
) -> torch.Tensor:  # [..., out_features]
    """F.linear; with a packed weight, the native register-blocked product; with a quantized one,
    the fused-dequantization product (F.linear on its dequantized weights where no native build
    runs it), part by part for a fused weight whose parts differ in type. `out` (x 2-D): the native
    products write their rows there directly (a row range of one buffer for many products),
    the others copy into it."""
    if isinstance(weight, QuantizedWeight):
        return _linear_quantized(x, weight, bias, out)
    if isinstance(weight, QuantizedParts):
        result = torch.cat([_linear_quantized(x, part, None) for part in weight.parts], dim=-1)
        return _into(result if bias is None else result + bias, out)
    if not isinstance(weight, PackedWeight):
        return _into(F.linear(x, weight, bias), out)
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1 or rows.dtype != torch.float32:
        rows = rows.float().contiguous()
    result = _packed_module().linear_packed(rows, weight.panels, weight.out_features, bias, out)
    return result.view(*x.shape[:-1], weight.out_features)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return result if out is None else out.copy_(result)


_quantized_supported: bool | None = None  # whether the quantized product was built (asked once)


def _quantized_module():
    global _quantized_supported
    module = load()
    if _quantized_supported is None:
        _quantized_supported = module is not None and module.linear_quantized_supported()
    return module if _quantized_supported else None


def _linear_quantized(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    module = _quantized_module()
    if module is None:
        return _into(F.linear(x.float(), weight.dequantize(), bias), out)
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1 or rows.dtype != torch.float32:
        rows = rows.float().contiguous()
    result = module.linear_quantized(rows, weight.tiles, weight.qtype, weight.out_features, bias, out)
    return result.view(*x.shape[:-1], weight.out_features)


def embedding(
    ids: torch.Tensor,  # [...] int64
    weight: torch.Tensor | QuantizedWeight,  # [vocab, hidden]
) -> torch.Tensor:  # [..., hidden] float32 for a quantized table
    """F.embedding; for a table kept quantized (a tied LM head), only the rows asked for,
    dequantized natively to gguf's floats (`csrc/quantized_rows_cpu.cpp`)."""
    if not isinstance(weight, QuantizedWeight):
        return F.embedding(ids, weight)
    module = load()
    if module is None:
        return weight.dequantize_rows(ids)
    rows = module.quantized_rows(weight.tiles, weight.qtype, weight.out_features, ids.reshape(-1))
    return rows.view(*ids.shape, weight.in_features)


class DecoderStack:
    """Every decoder layer plus the final norm in one native call (`csrc/decoder_stack_cpu.cpp`),
    for steps whose sequences all have short query runs: decode and speculative verification.
    At batch 1 the per-layer kernel calls from Python (several hundred) are a large share of a
    float32 step; here the same kernels run back to back, so outputs do not change. Other steps (a prefill
    chunk longer than `SHORT_QUERY_MAX`) keep the per-layer path: `forward` returns None."""

    def __init__(self, native, num_layers: int) -> None:
        self._native = native
        self.num_layers = num_layers

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] float32: the embeddings (not written)
        positions: torch.Tensor,  # [num_tokens] int64
        cos_sin: torch.Tensor,  # [max_positions, head_dim] float32
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        cos_sin_local: torch.Tensor | None = None,  # the local-rope layers' table
        # A split model's windowed layers' pool [windowed layers, 2, blocks, kv heads, block size, head dim],
        # its [num_tokens] slot mapping and metadata (the same sequences, its block tables); kv_cache
        # then holds the other layers
        window_pool: torch.Tensor | None = None,
        window_slot_mapping: torch.Tensor | None = None,
        window_meta: AttentionMetadata | None = None,
    ) -> torch.Tensor | None:  # [num_tokens, hidden], final-normed; None: not a short-query step
        plan = _short_sequences(meta)
        short, has_long = plan.short, plan.has_long
        pools = [kv_cache] if window_pool is None else [kv_cache, window_pool]
        if has_long or x.dtype != torch.float32 or any(p.dtype != torch.float32 or not p.is_contiguous()
                                                       for p in pools):
            return None
        return self._native.forward(
            x,
            positions.contiguous(),
            cos_sin,
            kv_cache,
            slot_mapping.contiguous(),
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            short,
            meta.max_seq_len,
            cos_sin_local,
            window_pool,
            None if window_slot_mapping is None else window_slot_mapping.contiguous(),
            None if window_meta is None else window_meta.block_tables,
        )


def decoder_stack(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    final_norm: torch.Tensor,  # [hidden]
    layers: list[StackLayer],
) -> DecoderStack | None:
    """A `DecoderStack` over these layers (projections packed or quantized), or None where the
    native build lacks a product they need."""
    module = _packed_module()
    projections = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    quantized = (QuantizedWeight, QuantizedParts)
    if module is None or (any(isinstance(w, quantized) for w in projections) and _quantized_module() is None):
        return None
    native = module.DecoderStack(num_heads, num_kv_heads, head_dim, eps, scale, final_norm.detach().contiguous())
    for layer in layers:
        native.add_layer(
            layer.input_norm.detach().contiguous(),
            layer.post_attention_norm.detach().contiguous(),
            _optional(layer.q_norm),
            _optional(layer.k_norm),
            _projection(module, layer.qkv, layer.qkv_bias),
            _projection(module, layer.o, layer.o_bias),
            _projection(module, layer.gate_up, layer.gate_up_bias),
            _projection(module, layer.down, layer.down_bias),
            _optional(layer.pre_feedforward_norm),
            _optional(layer.post_feedforward_norm),
            layer.gelu,
            layer.softcap or 0.0,
            layer.window or 0,
            layer.local_rope,
            layer.windowed,
            layer.pool_index,
        )
    return DecoderStack(native, len(layers))


def _optional(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().contiguous()


def _projection(module, weight: PackedWeight | QuantizedWeight | QuantizedParts, bias: torch.Tensor | None):
    bias = None if bias is None else bias.detach().contiguous()
    if isinstance(weight, QuantizedParts):
        parts = [module.Projection(p.tiles, p.qtype, p.out_features, None) for p in weight.parts]
        return module.Projection.fused(parts, weight.out_features, bias)
    if isinstance(weight, QuantizedWeight):
        return module.Projection(weight.tiles, weight.qtype, weight.out_features, bias)
    return module.Projection(weight.panels, "F32", weight.out_features, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    module = load()
    if module is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return reference.silu_and_mul(gate_up)
    return module.silu_and_mul(gate_up)


if __name__ == "__main__":  # `python -m kernels.cpu.native`: build now (make setup does), say what happened
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    print(
        f"native CPU kernels: {'built, ' + module.__file__ if module else 'unavailable (the PyTorch reference runs)'}"
    )
