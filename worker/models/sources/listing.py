"""What a source offers for one reference: the files serving needs, with the sizes and digests
the downloaded copy is checked against."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ferry.worker.models.sources.refs import ModelRef

# The files a checkpoint directory needs to be served, at its top level (no subfolders): weights,
# their index, configs, tokenizer, chat template. Anything else in a repo (other weight formats,
# README, images, ONNX exports) is never downloaded.
SERVING_FILES = (
    "*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)
# A PEFT LoRA adapter's files (worker/models/lora_adapter.py).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def serving_files(names: list[str]) -> list[str]:
    """The names (relative to the model's root) a checkpoint directory is served from; a folder
    that has no config.json but exactly one .gguf file is served from that file, and a LoRA
    adapter's folder (adapter_config.json, no config.json) from its two files."""
    top = [n for n in names if "/" not in n]
    if "config.json" not in top and "adapter_config.json" in top:
        return [n for n in ADAPTER_FILES if n in top]
    if "config.json" not in top:
        ggufs = [n for n in top if n.lower().endswith(".gguf")]
        return ggufs if len(ggufs) == 1 else []
    return sorted(n for n in top if any(fnmatch.fnmatchcase(n, p) for p in SERVING_FILES))


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file to download, as the source describes it."""

    name: str  # its path in the model's directory (and in the cache entry)
    key: str  # where the source has it: the S3 key, or the file's path in the Hub repo
    size: int  # bytes; the downloaded copy must have exactly as many
    sha256: str | None = None  # hex, checked after download when the source gives it (Hub LFS files)
    etag: str | None = None  # S3: every ranged GET asks for this ETag, so all ranges are of one version


@dataclass(frozen=True, slots=True)
class Listing:
    """A reference resolved at the source: one immutable version of its files."""

    ref: ModelRef
    version: str  # the Hub commit sha; for S3 a digest of the objects' names, sizes and ETags
    files: tuple[RemoteFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def key(self) -> str:
        """The cache entry's directory name."""
        return self.ref.cache_key(self.version)
