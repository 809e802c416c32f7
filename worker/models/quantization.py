"""Which of a model's matrices stay quantized in memory (issue 25), decided once, before loading.

`EngineConfig.quantization` / `FERRY_QUANTIZATION`:

- None (the default): the format's own. A GGUF file with tensors in a kept type (KEPT_TYPES:
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), on the CPU in float32, is served as "gguf"
  (measured faster at batch 1 and 4-7x smaller: bench/README.md); anything else as "none".
- "none": float weights only; a GGUF file is served from its dequantized conversion.
- "gguf": a GGUF file's matrices in a kept type stay in their blocks and run through the
  fused-dequantization product (`kernels.QuantizedWeight`); every other type (F16, BF16, Q2_K,
  Q3_K, the IQ types) is dequantized to float32 as with "none". A fused projection (q/k/v,
  gate/up) whose parts are in different kept types keeps each part in its own (`QuantizedParts`:
  llama.cpp's Q4_K_M gives some layers' v more bits than q and k). The embedding table
  and the LM head stay as the file stores them: llama.cpp's converters already keep them at
  Q6_K/Q8_0 or better (SmolLM2's tied table is Q8_0 in its Q4_1 file), one quantized table serves
  both the lookup and the head, and the head's product is the largest of a step.
- "int8": weight-only int8 for a float checkpoint, quantized at load: every matrix whose width
  is a multiple of 32 (projections, embeddings, the head) in Q8_0 blocks (one fp16 scale per
  32 weights of a row), through the same product.

Quantized weights exist only on the CPU backend and compute in float32 (activations and
accumulation), so "gguf" and "int8" need `device="cpu"` and `dtype="float32"`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ferry.kernels.cpu.quantized import FORMATS
from ferry.worker.models.gguf import GGUFCheckpoint, read_gguf

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "gguf", "int8")
KEPT_TYPES = frozenset(GGMLQuantizationType[name] for name in FORMATS)  # what the product reads as is
_FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F64}
)


class QuantizationError(ValueError):
    """A quantization setting that cannot apply to this model, dtype or device."""


@dataclass(frozen=True, slots=True)
class Quantization:
    """What `load_model` does: keep a GGUF's blocks, quantize at load, or neither."""

    method: str  # "none" | "gguf" | "int8"
    gguf: GGUFCheckpoint | None = None  # "gguf": the parsed file whose blocks are kept


NO_QUANTIZATION = Quantization("none")


def check_quantization_name(value: str | None) -> None:
    """ValueError unless `value` is None or one of QUANTIZATIONS (EngineConfig's check)."""
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None (the format's default) or one of {QUANTIZATIONS}, got {value!r}")


def resolve_quantization(
    requested: str | None, gguf_path: Path | None, device: torch.device, dtype: torch.dtype
) -> Quantization:
    """The quantization to load with. `gguf_path`: the GGUF file the model names, or None.

    Raises QuantizationError for "gguf" on a model that is not a GGUF file, "int8" on a GGUF whose
    tensors are already quantized, and either on a device other than the CPU or a dtype other
    than float32."""
    check_quantization_name(requested)
    if requested == "none":
        return NO_QUANTIZATION
    if requested is None:
        if gguf_path is None or device.type != "cpu" or dtype != torch.float32:
            return NO_QUANTIZATION
        checkpoint = read_gguf(gguf_path)
        return Quantization("gguf", checkpoint) if _types(checkpoint) & KEPT_TYPES else NO_QUANTIZATION
    if device.type != "cpu":
        raise QuantizationError(
            f"quantization={requested!r} runs on the CPU only (no GPU path has been measured yet); "
            f"on {device} use quantization='none'"
        )
    if dtype != torch.float32:
        raise QuantizationError(
            f"quantization={requested!r} computes in float32 (activations and accumulation); "
            f"use dtype='float32', not {dtype}"
        )
    if requested == "gguf":
        if gguf_path is None:
            raise QuantizationError(
                "quantization='gguf' keeps a GGUF file's quantized tensors, and the model is not a GGUF file; "
                "use quantization='int8' to quantize a checkpoint at load"
            )
        checkpoint = read_gguf(gguf_path)
        converted = sorted(t.name for t in _types(checkpoint) - KEPT_TYPES - _FLOAT_TYPES)
        if converted:
            log.warning("%s: %s tensors are dequantized to float32 (kept quantized: %s)",
                        gguf_path.name, ", ".join(converted), ", ".join(FORMATS))
        return Quantization("gguf", checkpoint)
    if gguf_path is not None:
        quantized = sorted(t.name for t in _types(read_gguf(gguf_path)) - _FLOAT_TYPES)
        if quantized:
            raise QuantizationError(
                f"quantization='int8' quantizes float weights at load, and {gguf_path.name} is already "
                f"quantized ({', '.join(quantized)}): use quantization='gguf' (or 'none')"
            )
    return Quantization("int8")


def _types(checkpoint: GGUFCheckpoint) -> set[GGMLQuantizationType]:
    """The types of the file's matrices (norms are F32 in every file and never quantized)."""
    return {t.qtype for t in checkpoint.tensors if len(t.shape) == 2}
