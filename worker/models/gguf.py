"""A GGUF file (llama.cpp's format) read as the Hugging Face checkpoint Ferry already loads.

`read_gguf` parses and checks a file without touching tensor data: the architecture and its
hyper-parameters from the `general.*` / `{arch}.*` metadata, every tensor mapped to its HF name
through one table, and each name and shape checked against what the HF config implies.
`write_checkpoint` then writes the checkpoint: config.json (an ordinary LlamaConfig, Qwen2Config, Qwen3Config,
Phi3Config, MixtralConfig, Qwen2/3-MoE config (experts: gguf_experts.py) or Gemma 2/3 config (gguf_gemma.py)),
generation_config.json, the tokenizer transformers builds from the file's metadata (chat
template included), and the weights, dequantized tensor by tensor with `gguf.quants.dequantize`.
Where and when that happens is `gguf_cache.py`'s job.

llama.cpp's converter reorders the q and k rows of llama-arch models (Mistral files are llama
too): within each head it interleaves the two rotary halves, for its rotate-adjacent-pairs
kernel. `_unpermute_rows` restores transformers' layout, first half then second half. Qwen2
and Qwen3 files keep the rotate-halves layout and are not reordered.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ferry.worker.models.config import UnsupportedModelError
from ferry.worker.models.gguf_experts import is_moe, map_expert_tensor, moe_config_kwargs, on_disk_names
from ferry.worker.models.gguf_gemma import GEMMA_FAMILY, GEMMA_MODELS, gemma_config_kwargs, refuse_vision

log = logging.getLogger(__name__)


class GGUFError(ValueError):
    """A file that is not a complete, readable GGUF, or whose tensors do not make up its model."""


@dataclass(frozen=True, slots=True)
class _Family:
    config_class: type[PretrainedConfig]
    model_class: type  # built on the meta device to list the tensors and shapes a config implies
    permuted_qk: bool  # llama.cpp reordered the q/k rows for its rotary kernel
    layer_names: dict[str, str] = field(default_factory=dict)  # the family's own GGUF key -> HF module
    norm_offset: float = 0.0  # added to every `*norm.weight`: -1 for Gemma (llama.cpp stores w + 1)


_FAMILIES = {
    "llama": _Family(LlamaConfig, LlamaForCausalLM, permuted_qk=True),
    "qwen2": _Family(Qwen2Config, Qwen2ForCausalLM, permuted_qk=False),
    "qwen3": _Family(Qwen3Config, Qwen3ForCausalLM, permuted_qk=False),
    # Phi-3: q/k/v in one tensor, and ffn_up holds gate then up (as the HF checkpoint stores them).
    "phi3": _Family(Phi3Config, Phi3ForCausalLM, permuted_qk=False,
                    layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    # mixture of experts (gguf_experts.py); a llama file with experts is Mixtral (_MIXTRAL)
    "qwen2moe": _Family(Qwen2MoeConfig, Qwen2MoeForCausalLM, permuted_qk=False),
    "qwen3moe": _Family(Qwen3MoeConfig, Qwen3MoeForCausalLM, permuted_qk=False),
    **{arch: _Family(*classes, **GEMMA_FAMILY) for arch, classes in GEMMA_MODELS.items()},  # gguf_gemma.py
}
_MIXTRAL = _Family(MixtralConfig, MixtralForCausalLM, permuted_qk=True)

# GGUF tensor name -> HF name. Layer tensors are `blk.{i}.<key>.{weight,bias}` in the file and
# `model.layers.{i}.<value>.{weight,bias}` in the checkpoint.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# F16 and BF16 values are exact in their own torch dtype and are stored so (half the bytes);
# F32 and every quantized type are stored as the float32 values `dequantize` gives.
_STORED_DTYPE = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
_SHARD_BYTES = 2 << 30  # safetensors shard size: a conversion holds at most one shard in memory
_REQUIRED = object()


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file and where it goes in the checkpoint."""

    name: str  # HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
    gguf_name: str  # e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # HF shape, [out, in] for a matrix (GGUF lists dimensions the other way round)
    qtype: GGMLQuantizationType
    data: np.ndarray  # the file's bytes for it (a memmap): whole blocks for quantized types
    permuted_heads: int | None  # llama q/k: heads whose rows llama.cpp interleaved; None otherwise
    offset: float = 0.0  # added to the file's values (_Family.norm_offset)


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    """A parsed and checked GGUF: everything `write_checkpoint` needs."""

    path: Path
    config: PretrainedConfig  # `architectures` and `dtype` set; what config.json will hold
    tensors: list[GGUFTensor]  # in file order
    eos_token_ids: list[int]  # end-of-generation ids the file names: eos, then eot and eom
    bos_token_id: int | None
    has_tokenizer: bool  # the file describes a tokenizer (tokenizer.ggml.model)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Parse and check a GGUF file, reading its metadata only.

    Raises GGUFError for a file that is not a complete GGUF or lacks tensors its model needs,
    UnsupportedModelError for an architecture, option or tensor type Ferry does not implement."""
    path = Path(path)
    reader = _open(path)
    arch = _metadata(reader, path, "general.architecture")
    refuse_vision(path, arch, {t.name for t in reader.tensors})
    family = _FAMILIES.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; Ferry reads {', '.join(_FAMILIES)} "
            "(Mistral GGUFs are llama)"
        )
    if _metadata(reader, path, "split.count", 1) > 1:
        raise UnsupportedModelError(f"{path}: split GGUF files are not supported; merge the parts into one file first")
    _check_tensor_types(reader, path)
    moe = is_moe(arch, lambda key, default=_REQUIRED: _metadata(reader, path, f"{arch}.{key}", default))
    if arch == "llama" and moe:
        family = _MIXTRAL
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    config = _hf_config(reader, path, arch, family, names, vocab_size=int(embedding.shape[1]), moe=moe)
    tensors, unknown = _map_tensors(reader, family, config, arch if moe else None)
    if unknown:
        raise UnsupportedModelError(
            f"{path}: tensors Ferry has no place for in a {arch} model: {', '.join(unknown[:8])}"
        )
    _check_shapes(path, family, config, tensors, arch if moe else None)
    eos = [_metadata(reader, path, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensors=tensors,
        eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
        bos_token_id=_metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        has_tokenizer="tokenizer.ggml.model" in reader.fields,
    )


def dequantized(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values in HF layout: `gguf.quants.dequantize` (float32), q/k rows restored,
    held as F16/BF16 where the file stored it so, float32 otherwise."""
    values = np.require(dequantize(tensor.data, tensor.qtype), np.float32, requirements="CW")  # own, writable copy
    out = torch.from_numpy(values + tensor.offset if tensor.offset else values).reshape(tensor.shape)
    if tensor.permuted_heads is not None:
        out = _unpermute_rows(out, tensor.permuted_heads)
    return out.to(_STORED_DTYPE.get(tensor.qtype, torch.float32))


def raw_blocks(tensor: GGUFTensor) -> torch.Tensor:  # [out, bytes per row] uint8
    """A quantized matrix's bytes as the file stores them, one row of blocks per output row, in HF
    row order (llama q/k rows restored: the blocks run along a row, so reordering rows is exact)."""
    rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(tensor.shape[0], -1))  # own copy
    if tensor.permuted_heads is not None:
        rows = _unpermute_rows(rows, tensor.permuted_heads)
    return rows


def write_checkpoint(checkpoint: GGUFCheckpoint, out_dir: Path) -> None:
    """Write the HF checkpoint into `out_dir` (existing and empty): config, generation config,
    tokenizer, and the weights as safetensors shards with an index."""
    checkpoint.config.save_pretrained(out_dir)
    eos = checkpoint.eos_token_ids
    if eos or checkpoint.bos_token_id is not None:
        eos_token_id = eos[0] if len(eos) == 1 else (eos or None)
        GenerationConfig(bos_token_id=checkpoint.bos_token_id, eos_token_id=eos_token_id).save_pretrained(out_dir)
    if checkpoint.has_tokenizer:
        _write_tokenizer(checkpoint.path, out_dir)
    else:
        log.warning("%s describes no tokenizer: prompts must be token ids", checkpoint.path)
    _write_weights(checkpoint.tensors, out_dir)


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:  # what numpy and the reader raise on bad bytes
        raise GGUFError(f"{path}: not a readable GGUF file (truncated or not GGUF): {exc}") from exc


def _metadata(reader: GGUFReader, path: Path, key: str, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFError(f"{path}: GGUF metadata lacks {key}")
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise UnsupportedModelError(f"{path}: {key} holds a list (per-layer values); Ferry needs one value")
    value = field.contents()
    if field.types[0] == GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))  # the shortest decimal of the stored float32: 1e-05, not 9.99e-06
    return value


def _check_tensor_types(reader: GGUFReader, path: Path) -> None:
    """Fail before converting anything if `gguf.quants` cannot dequantize a type in the file."""
    for qtype in sorted({t.tensor_type for t in reader.tensors}):
        one_block = np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8)
        try:
            dequantize(one_block, qtype)
        except NotImplementedError:
            tensor = next(t.name for t in reader.tensors if t.tensor_type == qtype)
            raise UnsupportedModelError(
                f"{path}: tensor type {qtype.name} (of {tensor}) cannot be dequantized by the gguf package"
            ) from None


def _hf_config(
    reader, path: Path, arch: str, family: _Family, names: set[str], vocab_size: int, moe: bool
) -> PretrainedConfig:
    def meta(key: str, default=_REQUIRED):
        return _metadata(reader, path, f"{arch}.{key}", default)

    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    rotary_dim = meta("rope.dimension_count", head_dim)
    for key, value in (("attention.value_length", meta("attention.value_length", head_dim)),
                       ("rope.dimension_count", head_dim if arch == "phi3" else rotary_dim)):
        if value != head_dim:  # Phi-3's partial rotary (Phi-4-mini) is served: config.partial_rotary_order
            raise UnsupportedModelError(
                f"{path}: {arch}.{key} = {value} differs from the head size {head_dim}; "
                "Ferry rotates and attends over whole heads"
            )
    eos = _metadata(reader, path, "tokenizer.ggml.eos_token_id", None)
    kwargs = dict(
        architectures=[family.model_class.__name__],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=meta("context_length"),
        rope_parameters=_rope_parameters(meta, path),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_metadata(reader, path, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=_padding_id(reader, path, vocab_size),  # not Phi3Config's default 32000 on a smaller vocabulary
        dtype=_auto_dtype(reader),
    )
    if arch in ("llama", "qwen3", "qwen3moe"):  # Qwen2 always has q/k/v biases, Phi-3 none
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "qwen2moe":
        kwargs["qkv_bias"] = "blk.0.attn_q.bias" in names
    if moe:
        kwargs.update(moe_config_kwargs(arch, meta, path))
    if arch in GEMMA_MODELS:
        kwargs.update(gemma_config_kwargs(arch, meta, kwargs))
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    if arch == "phi3":
        kwargs["sliding_window"] = meta("attention.sliding_window", None)
        if _LONGROPE_TENSORS & names:  # Phi-3.5 / Phi-3-128k: llama.cpp keeps the factors as tensors
            kwargs["rope_parameters"] = _longrope_parameters(reader, path, meta, kwargs["rope_parameters"])
            kwargs["original_max_position_embeddings"] = kwargs["rope_parameters"]["original_max_position_embeddings"]
        if rotary_dim != head_dim:
            kwargs["rope_parameters"] = {**kwargs["rope_parameters"], "partial_rotary_factor": rotary_dim / head_dim}
    return family.config_class(**kwargs)


_LONGROPE_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}


def _longrope_parameters(reader: GGUFReader, path: Path, meta, rope: dict) -> dict:
    """transformers' longrope parameters from a Phi-3 GGUF: the two factor tensors (head_dim / 2
    each) and the original context length. The attention factor is left to transformers' default
    (from the two context lengths, which is what llama.cpp's converter stores) unless the file's
    differs from it."""
    factors = {t.name: [float(v) for v in np.asarray(t.data, dtype=np.float32)] for t in reader.tensors
               if t.name in _LONGROPE_TENSORS}
    if len(factors) != 2:
        raise GGUFError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short tensors")
    original = meta("rope.scaling.original_context_length")
    params = {"rope_type": "longrope", "rope_theta": rope["rope_theta"], "original_max_position_embeddings": original,
              "long_factor": factors["rope_factors_long.weight"], "short_factor": factors["rope_factors_short.weight"]}
    scale = meta("context_length") / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = meta("rope.scaling.attn_factor", None)
    if stored is not None and abs(stored - default) > 1e-6 * default:
        params["attention_factor"] = stored
    return params


def _padding_id(reader: GGUFReader, path: Path, vocab_size: int) -> int | None:
    pad = _metadata(reader, path, "tokenizer.ggml.padding_token_id", None)
    return pad if pad is not None and 0 <= pad < vocab_size else None


def _rope_parameters(meta, path: Path) -> dict:
    theta = meta("rope.freq_base", 10000.0)
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": meta("rope.scaling.factor")}
    raise UnsupportedModelError(
        f"{path}: rope scaling {kind!r} is not supported; Ferry reads none and linear from GGUF"
    )


def _auto_dtype(reader: GGUFReader) -> str:
    """What `dtype="auto"` means for this file: float16 or bfloat16 when every matrix is stored in
    that type (norms are F32 in every llama.cpp file, so 1-D tensors do not count); float32 for
    anything quantized or mixed, the only dtype that holds dequantized values exactly."""
    types = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    return {
        frozenset({GGMLQuantizationType.F16}): "float16",
        frozenset({GGMLQuantizationType.BF16}): "bfloat16",
    }.get(frozenset(types), "float32")


def _map_tensors(
    reader: GGUFReader, family: _Family, config, moe_arch: str | None
) -> tuple[list[GGUFTensor], list[str]]:
    """The file's tensors under their HF names, and the names that have no HF counterpart. A MoE
    file's (`moe_arch`) stacked experts become one tensor per expert (gguf_experts.py)."""
    permuted = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors, unknown = [], []
    for t in reader.tensors:
        match = _LAYER_TENSOR.fullmatch(t.name)
        experts = None
        if moe_arch is not None and match is not None:
            def make(name, shape, data, t=t):
                return GGUFTensor(name, t.name, shape, t.tensor_type, data, None)
            experts = map_expert_tensor(t, moe_arch, *match.groups(), make)
        if experts is not None:
            tensors += experts
            continue
        if t.name in _GLOBAL_NAMES:
            name, heads = _GLOBAL_NAMES[t.name], None
        elif match is not None and (match[2] in family.layer_names or match[2] in _LAYER_NAMES):
            layer, key, kind = match.groups()
            name = f"model.layers.{layer}.{family.layer_names.get(key) or _LAYER_NAMES[key]}.{kind}"
            heads = permuted.get(key) if family.permuted_qk else None
        elif t.name in _LONGROPE_TENSORS and family.config_class is Phi3Config:
            continue  # read into the config's rope parameters
        else:
            unknown.append(t.name)
            continue
        shape = tuple(int(n) for n in reversed(t.shape))
        offset = family.norm_offset if t.name.endswith("norm.weight") else 0.0
        tensors.append(GGUFTensor(name, t.name, shape, t.tensor_type, t.data, heads, offset))
    return tensors, unknown


def _check_shapes(path: Path, family: _Family, config, tensors: list[GGUFTensor], moe_arch: str | None) -> None:
    """Every tensor the HF model of this config has, each with its shape, and no others."""
    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in family.model_class(config).state_dict().items()}
    if moe_arch is not None:  # transformers holds experts stacked; the checkpoint has them one by one
        expected = on_disk_names(expected, moe_arch)
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]  # the embedding serves as the head
    found = {t.name: t for t in tensors}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise GGUFError(f"{path}: lacks tensors its {config.architectures[0]} needs: {', '.join(missing[:8])}")
    extra = sorted(t.gguf_name for t in tensors if t.name not in expected)
    if extra:
        raise UnsupportedModelError(f"{path}: tensors its config has no place for: {', '.join(extra[:8])}")
    wrong = [f"{t.gguf_name} {t.shape} (expected {expected[t.name]})" for t in tensors if t.shape != expected[t.name]]
    if wrong:
        raise GGUFError(f"{path}: tensor shapes disagree with the metadata: {', '.join(wrong[:4])}")


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from llama.cpp's order (r0, r_h, r1, r_h+1, ... with h = head_dim / 2)
    back to transformers' (r0 .. r_h-1, then r_h .. r_2h-1). w: [num_heads * head_dim, ...]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_tokenizer(path: Path, out_dir: Path) -> None:
    try:
        # Straight to the tokenizer class: AutoTokenizer would first parse the whole file again for a config.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers' converters raise many types for a tokenizer they cannot build
        raise UnsupportedModelError(f"{path}: transformers cannot build the file's tokenizer: {exc}") from exc
    tokenizer.save_pretrained(out_dir)


def _write_weights(tensors: list[GGUFTensor], out_dir: Path) -> None:
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = shard_bytes = 0

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    for tensor in tqdm(tensors, desc="converting GGUF", unit="tensor"):
        values = dequantized(tensor)
        if shard and shard_bytes + values.nbytes > _SHARD_BYTES:
            flush()
            shard_bytes = 0
        shard[tensor.name] = values
        shard_bytes += values.nbytes
        total += values.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
