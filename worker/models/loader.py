"""Find a model directory (converting a GGUF file into one) and load its safetensors weights through one
name-mapping table."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ferry.kernels.ops import QuantizedParts, pack_quantized_weight, quantize_int8_weight, quantized_experts
from ferry.worker.models.bundled import bundled_model_file
from ferry.worker.models.config import (
    ModelArch,
    UnsupportedModelError,
    partial_rotary_order,
    reorder_rotary_rows,
    rope_cos_sin_cache,
)
from ferry.worker.models.errors import ModelNotFoundError, ModelSourceError
from ferry.worker.models.expert_weights import ExpertPart, expert_dest, expert_slices, map_expert_name, router_name
from ferry.worker.models.fallback import load_fallback_model
from ferry.worker.models.gguf import GGUFCheckpoint, GGUFTensor, raw_blocks
from ferry.worker.models.gguf_cache import converted_checkpoint
from ferry.worker.models.llama import LlamaModel
from ferry.worker.models.quantization import KEPT_TYPES, NO_QUANTIZATION, Quantization
from ferry.worker.models.safetensors_stream import ArrivingSafetensors
from ferry.worker.models.sharding import (
    UNSHARDED,
    Shard,
    TensorParallelError,
    checkpoint_index,
    local_arch,
    mlp_intermediate_size,
)
from ferry.worker.models.sources import fetch_model, incoming_files, parse_ref, wait_for_file
from ferry.worker.models.sources.arriving import arriving_file

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_model_path(model: str | os.PathLike, cache_dir: str | os.PathLike) -> Path:
    """The Hugging Face checkpoint directory to load for `model`:

    - `hf://org/name[@revision]` or `s3://bucket/prefix/` (a GGUF inside either too): downloaded
      once per node into `cache_dir` (worker/models/sources/), then as below;
    - a `.gguf` file, or a directory holding exactly one `.gguf` and no config.json: its conversion
      in `cache_dir` (made on first use, see gguf_cache.py);
    - a local directory with config.json, as is;
    - the name of a model that ships in an installed package (`smollm2-135m-instruct`, see
      bundled.py), unless a path of that name exists: its GGUF, converted as above;
    - a hub id (`org/name`): from the local Hugging Face cache when it is there (no network),
      else downloaded as `hf://org/name`."""
    model = local_model(model, cache_dir)
    gguf = gguf_file(model)
    if gguf is not None:
        return converted_checkpoint(gguf, Path(cache_dir).expanduser())
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(f"model directory {path} has no config.json and no .gguf file")
    name = str(model)
    if re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", name) and not path.exists():
        try:
            from huggingface_hub import snapshot_download

            cached = Path(snapshot_download(name, local_files_only=True))
        except Exception as exc:  # huggingface_hub raises several types for "not cached"
            if "/" not in name:
                raise ModelNotFoundError(f"model {name!r} is not a local directory and not in the local Hugging Face "
                                         f"cache: {exc.__class__.__name__}") from None
            return _downloaded_hub_id(name, cache_dir)
        if (cached / "config.json").is_file():
            return cached
    raise ModelNotFoundError(
        f"model {name!r} not found: give a local directory with config.json and safetensors weights, "
        "a .gguf file, a bundled model name (smollm2-135m-instruct), a hub id, hf://org/name or s3://bucket/prefix/"
    )


def local_model(model: str | os.PathLike, cache_dir: str | os.PathLike,
                max_bytes: int | None = None) -> str | os.PathLike:
    """`model` itself, or for an `hf://` / `s3://` reference its copy in the node's cache (downloaded
    now unless already there; `max_bytes` caps the cache): a checkpoint directory or a .gguf file."""
    ref = parse_ref(str(model))
    return model if ref is None else fetch_model(ref, Path(cache_dir).expanduser(), max_bytes)


def _downloaded_hub_id(name: str, cache_dir: str | os.PathLike) -> Path:
    try:
        local = fetch_model(parse_ref(f"hf://{name}"), Path(cache_dir).expanduser())
    except ModelSourceError as exc:
        raise ModelSourceError(f"model {name!r} is not in the local Hugging Face cache, and {exc}") from None
    return resolve_model_path(local, cache_dir)


def gguf_file(model: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The GGUF file `model` names (a `.gguf` file, a directory holding exactly one `.gguf` and
    no config.json, or a bundled model's name when no path of that name exists), resolved; None
    for anything else. An `hf://` or `s3://` reference is looked up in `cache_dir`'s copy."""
    if cache_dir is not None:
        model = local_model(model, cache_dir)
    path = Path(model).expanduser()
    if not path.exists() and (bundled := bundled_model_file(str(model))) is not None:
        return bundled.resolve()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} not found")
        return path.resolve()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"model directory {path} holds several GGUF files ({names}): name one of them")
    return ggufs[0].resolve() if ggufs else None


def parse_dtype(dtype: str | torch.dtype, config_dtype: torch.dtype | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of float32, bfloat16, float16")
        return dtype
    if dtype == "auto":
        return config_dtype if config_dtype in DTYPES.values() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of float32, bfloat16, float16 or auto")
    return DTYPES[dtype]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (via the index) or single. In a node cache
    entry still downloading, those it will hold too (open each after `wait_for_file`)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    incoming = {model_dir / name for name in incoming_files(model_dir) if name.endswith(".safetensors")}
    single = model_dir / "model.safetensors"
    if single.is_file() or single in incoming:
        return [single]
    files = sorted({*model_dir.glob("*.safetensors"), *incoming})
    if files:
        return files
    raise ModelNotFoundError(f"no safetensors weights in {model_dir} (Ferry loads only safetensors)")


# Checkpoint name -> (Ferry parameter, part). A part names the slice of a fused parameter;
# None means the tensor maps one to one.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", "gate"),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", "up"),
}
_RENAMED = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",  # Gemma 2/3's sandwich norms
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    "self_attn.q_norm.weight": "self_attn.q_norm",
    "self_attn.k_norm.weight": "self_attn.k_norm",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def map_name(name: str) -> tuple[str, str | ExpertPart | None] | None:
    """Map a checkpoint tensor name to (Ferry parameter name, fused part), or None to skip it.
    An expert's tensor maps to its stacked parameter, its part an ExpertPart (expert_weights.py)."""
    if _IGNORED.search(name):
        return None
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name  # checkpoints of the bare decoder have no "model." prefix
    if name in _RENAMED:
        return _RENAMED[name], None
    match = _LAYER.match(name)
    if match is None:
        return None
    layer, rest = match.groups()
    if (expert := map_expert_name(layer, rest)) is not None:
        return expert
    rest = router_name(rest)
    for suffix in ("weight", "bias"):
        module = rest.removesuffix("." + suffix)
        if module != rest and module in _FUSED:
            target, part = _FUSED[module]
            return f"layers.{layer}.{target}.{suffix}", part
    return f"layers.{layer}.{_RENAMED.get(rest, rest)}", None


_FUSED_PARTS = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up"),
                "mlp.shared_expert.gate_up_proj": ("gate", "up")}


def _slices(
    arch: ModelArch, shard: Shard, target: str, part: str | ExpertPart | None
) -> Iterator[tuple[str | ExpertPart | None, tuple[slice, ...]]]:
    """(part, index into the checkpoint tensor) for each piece of it this rank reads. A tensor a
    checkpoint stores already fused (Phi-3's qkv_proj and gate_up_proj) is read part by part, so
    each rank takes its own q, k, v (gate, up) rows from it as from separate tensors."""
    if isinstance(part, ExpertPart):
        yield from expert_slices(arch, shard, target, part)
        return
    module = target.split(".", 2)[-1].rsplit(".", 1)[0]  # layers.{i}.<module>.{weight,bias}
    if part is not None or module not in _FUSED_PARTS:
        index = checkpoint_index(arch, shard, target, part)
        if index is not None:  # None: a part of the model another rank holds
            yield part, index
        return
    for piece in _FUSED_PARTS[module]:
        rows = _shard_rows(arch, piece, target)  # the piece's rows in the whole fused tensor
        local = checkpoint_index(arch, shard, target, piece) or (slice(0, rows.stop - rows.start),)
        yield piece, (slice(rows.start + local[0].start, rows.start + local[0].stop),)


def _shard_rows(arch: ModelArch, part: str, target: str) -> slice:
    """Rows of a fused parameter `target` (qkv_proj, a gate_up_proj) that checkpoint part `part` fills."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = mlp_intermediate_size(arch, target)
    return {
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, inter),
        "up": slice(inter, 2 * inter),
    }[part]


def load_model(
    model_dir: Path,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: Quantization = NO_QUANTIZATION,
    shard: Shard = UNSHARDED,
):
    """Build the model on `device` in `dtype` and fill every parameter from the checkpoint
    (a GGUF's kept blocks from the file itself, see worker/models/quantization.py). With a
    tensor-parallel `shard`, the rank's own part of the model (worker/models/sharding.py),
    read from the checkpoint slice by slice."""
    if shard.size > 1 and quantization.method != "none":
        raise TensorParallelError(f"quantization={quantization.method!r} is served at tensor_parallel_size=1 only")
    if arch.implementation == "transformers":
        if shard.size > 1 or quantization.method != "none":
            raise UnsupportedModelError(f"{arch.architecture} runs on the transformers fallback, which serves "
                                        "float weights at tensor_parallel_size=1 only")
        for path in weight_files(model_dir):
            wait_for_file(path)
        return load_fallback_model(model_dir, arch, dtype, device)
    with torch.device("meta"):
        model = LlamaModel(arch, max_positions, shard)
    model = model.to_empty(device=device).to(dtype)
    # The rotary table stays float32 whatever the weights' dtype (as in transformers).
    model.cos_sin = rope_cos_sin_cache(arch.rope, arch.head_dim, max_positions).to(device)
    if model.cos_sin_local is not None:  # Gemma 3's sliding layers' table
        model.cos_sin_local = rope_cos_sin_cache(arch.gemma.local_rope, arch.head_dim, max_positions).to(device)
    kept = {} if quantization.gguf is None else gguf_kept_weights(quantization.gguf, arch)
    model.keep_quantized(kept)
    params = dict(model.named_parameters())
    local = local_arch(arch, shard)
    # Each parameter must be covered fully: count the elements each part fills.
    filled: dict[str, int] = {name: 0 for name in params}
    for name, target, part, tensor in checkpoint_tensors(model_dir, arch, shard, skip=set(kept)):
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {arch.architecture} as configured")
        dest = params[target].data
        if isinstance(part, ExpertPart):
            dest = expert_dest(dest, local, part)
        elif part is not None:
            dest = dest[_shard_rows(local, part, target)]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} on this rank, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)  # converts to the parameter's dtype as it copies (no intermediate tensor)
        filled[target] += tensor.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
    if arch.rope.rotary_dim:
        _reorder_for_partial_rotary(model, local)
    if arch.gemma is not None:
        _fold_gemma_norms(model)
    if quantization.method == "int8":
        model.keep_quantized(int8_weights(model))
    model.pack_weights()
    model.eval()
    return model


@torch.no_grad()
def _fold_gemma_norms(model: LlamaModel) -> None:
    """Gemma's RMSNorms scale by 1 + w (in float32): every norm weight becomes 1 + w, so Ferry's
    rms_norm (weight times the normalised x) computes theirs. Exact in float32; in 16-bit dtypes
    1 + w is rounded to the dtype (transformers multiplies in float32 before rounding)."""
    for name, param in model.named_parameters():
        if name == "norm" or name.endswith(("layernorm", "q_norm", "k_norm")):
            param.data.copy_((1.0 + param.data.float()).to(param.dtype))


@torch.no_grad()
def _reorder_for_partial_rotary(model: LlamaModel, local: ModelArch) -> None:
    """Each q and k head's dims in the order the whole-head rotary kernels need under partial
    rotary (config.partial_rotary_order): rows of q/k weights and biases, and q/k norm weights."""
    order = partial_rotary_order(local.head_dim, local.rope.rotary_dim)
    for layer in model.layers:
        attn = layer.self_attn
        for tensor in (attn.qkv_proj.weight, attn.qkv_proj.bias):
            if isinstance(tensor, torch.Tensor):  # not: no bias, or a GGUF's kept blocks (reordered as packed)
                reorder_rotary_rows(tensor.data, local)
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None:
                norm.data.copy_(norm.data[order])


def open_weights(path: Path):
    """A safetensors file to read tensors from (safe_open's calls). One that a download in this
    process is writing now is read tensor by tensor as its bytes arrive (sources/arriving.py); one
    another process downloads is waited for whole (sources/node_cache.py)."""
    arriving = arriving_file(path)
    if arriving is not None:
        return ArrivingSafetensors(arriving)
    wait_for_file(path)
    return safe_open(str(path), framework="pt", device="cpu")


def checkpoint_tensors(
    model_dir: Path, arch: ModelArch, shard: Shard = UNSHARDED, skip: set[str] = frozenset()
) -> Iterator[tuple[str, str, str | None, torch.Tensor]]:
    """(checkpoint name, parameter, fused part, tensor) for every tensor the rank's model takes
    from the checkpoint, except parameters in `skip`. Only the rank's slice of each tensor is read
    (safetensors' get_slice reads those bytes alone): a rank never holds a whole sharded tensor."""
    files = weight_files(model_dir)
    with tqdm(total=len(files), desc="loading weights", unit="file", disable=len(files) < 2) as bar:
        for path in files:
            with open_weights(path) as f:
                for name in f.keys():
                    mapped = map_name(name)
                    if mapped is None:
                        continue
                    target, fused_part = mapped
                    if (target == "lm_head" and arch.tie_word_embeddings) or target in skip:
                        continue  # tied (the embedding is the head), or held quantized
                    for part, index in _slices(arch, shard, target, fused_part):
                        yield name, target, part, f.get_slice(name)[index] if index else f.get_tensor(name)
            bar.update()


def gguf_kept_weights(checkpoint: GGUFCheckpoint, arch: ModelArch) -> dict[str, object]:
    """The model's matrices that stay in the file's blocks (KEPT_TYPES), by parameter name. A
    fused parameter (q/k/v, gate/up) qualifies when all its parts are in kept types: one packed
    weight where they share a type, else its parts side by side (`QuantizedParts`: llama.cpp's
    Q4_K_M stores some layers' v in more bits than q and k). A layer's experts (`mlp.experts.w13`,
    `.w2`) qualify when every expert's pieces do (`kernels.quantized_experts`). The rest are
    loaded dequantized."""
    parts: dict[str, dict[str | None, GGUFTensor]] = {}
    experts: dict[str, dict[int, dict[str | None, GGUFTensor]]] = {}  # target -> expert -> piece -> tensor
    for tensor in checkpoint.tensors:
        mapped = map_name(tensor.name)
        if mapped is None or len(tensor.shape) != 2:
            continue
        target, part = mapped
        if isinstance(part, ExpertPart):
            experts.setdefault(target, {}).setdefault(part.expert, {})[part.piece] = tensor
        else:
            parts.setdefault(target, {})[part] = tensor
    kept = {}
    for target, shards in parts.items():
        order = sorted(shards, key=lambda s: 0 if s is None else _shard_rows(arch, s, target).start)
        reorder = bool(arch.rope.rotary_dim) and target.endswith("self_attn.qkv_proj.weight")
        if reorder and len(order) != 1:
            continue  # separate q/k/v parts under partial rotary: loaded dequantized (no such files yet)
        matrix = _kept_matrix([shards[s] for s in order], arch if reorder else None)
        if matrix is not None:
            kept[target] = matrix
    for target, by_expert in experts.items():
        if sorted(by_expert) != list(range(arch.moe.num_experts)):
            continue  # not every expert: the loader names what is missing
        matrices = [_kept_matrix([pieces[p] for p in sorted(pieces, key=lambda p: p == "up")])
                    for _, pieces in sorted(by_expert.items())]
        if all(m is not None for m in matrices):
            kept[target] = quantized_experts(matrices)
    return kept


def _kept_matrix(tensors: list[GGUFTensor], rotary_arch: ModelArch | None = None):
    """One matrix from these tensors' rows in order, kept in their blocks, or None where a type is
    not kept. rotary_arch: reorder q/k rows for partial rotary (a fused qkv in one tensor)."""
    qtypes = {t.qtype for t in tensors}
    if not qtypes <= KEPT_TYPES:
        return None
    if len(qtypes) > 1:
        return QuantizedParts(tuple(pack_quantized_weight(raw_blocks(t), t.qtype.name, t.shape[0], t.shape[1])
                                    for t in tensors))
    blocks = torch.cat([raw_blocks(t) for t in tensors])  # [out, bytes per row]: the parts' rows in order
    if rotary_arch is not None:  # Phi-3's fused q/k/v under partial rotary
        reorder_rotary_rows(blocks, rotary_arch)
    return pack_quantized_weight(blocks, tensors[0].qtype.name, blocks.shape[0], tensors[0].shape[1])


_ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # [experts, hidden], [1, hidden]


def int8_weights(model: LlamaModel) -> dict[str, object]:
    """Every float matrix of the model (projections, embeddings, an untied head, each expert's)
    quantized to int8 blocks, except those whose width is not a multiple of the 32-weight block
    and the MoE routers (tiny, and a rounded logit can flip a near-tie to another expert:
    llama.cpp keeps them float too)."""
    kept = {}
    for name, param in model.named_parameters():
        if param.dim() not in (2, 3) or name.endswith(_ROUTERS):
            continue
        if param.shape[-1] % 32:
            log.info("int8: %s %s stays float (width not a multiple of 32)", name, list(param.shape))
        elif param.dim() == 2:
            kept[name] = quantize_int8_weight(param)
        else:  # a layer's stacked experts [E, out, in]
            kept[name] = quantized_experts([quantize_int8_weight(expert) for expert in param])
    return kept
