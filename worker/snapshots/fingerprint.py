"""Whether KV computed by one engine is valid in another: one sha256 over everything that decides it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ferry.worker.engine import Engine
from ferry.worker.models.loader import weight_files

_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # weight data hashed per file


def fingerprint(engine: Engine) -> str:
    """sha256 of the model's config, weight files (names, sizes, header and data samples), the Hub
    commit it was downloaded at, dtype, quantization, block size, KV layout, tensor-parallel size
    and the prefix cache's key salt. A snapshot restores only into an engine with the same fingerprint."""
    config = json.loads((engine.model_dir / "config.json").read_text())
    config.pop("transformers_version", None)  # re-saving with another library release changes nothing
    layout = engine.prefix_blocks.layout
    parts = {
        "config": config,
        "weights": [
            {"name": p.name, "size": p.stat().st_size, "sha256": _safetensors_sample_sha256(p)}
            for p in weight_files(engine.model_dir)
        ],
        "dtype": str(engine.dtype),
        "block_size": engine.block_size,
        "kv_layout": layout.axes,
        "kv_block_shape": list(layout.block_shape),
        "model_salt": engine.model_salt,  # block keys are salted with it
    }
    source = engine.model_dir / "source.json"  # a model downloaded from the Hub: the commit it came from
    if source.is_file() and (meta := json.loads(source.read_text())).get("scheme") == "hf":
        parts["revision"] = meta["version"]
    if engine.quantization != "none":  # an unquantized engine's fingerprint stays what it was
        parts["quantization"] = engine.quantization
    if engine.tensor_parallel_size > 1:  # other partial sums, other KV bits: blocks stay within one layout
        parts["tensor_parallel_size"] = engine.tensor_parallel_size
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _safetensors_sample_sha256(path: Path) -> str:
    """sha256 of a safetensors file's header plus samples of its tensor data.

    The header (u64 length + JSON) names every tensor with dtype, shape and offsets; fine-tunes
    of one base model share it, so a few spread-out slices of the data are hashed too: cheap
    (about 1 MiB read per file) and different for any two trained checkpoints."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little")
        digest.update(head + f.read(header_len))
        data_start = 8 + header_len
        span = max(size - data_start - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            f.seek(data_start + span * i // max(_SAMPLES - 1, 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()
