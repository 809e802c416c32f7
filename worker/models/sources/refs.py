"""Model references that name weights somewhere else than this machine.

    hf://org/name[@revision]            a Hugging Face Hub repository (revision: branch, tag or commit)
    hf://org/name/file.Q4_K_M.gguf[@rev] one GGUF file in a Hub repository
    org/name                            the same as hf://org/name (as vLLM takes it), after the local HF cache
    s3://bucket/prefix/                 every serving file under the prefix (any S3 API)
    s3://bucket/prefix/x.gguf           one GGUF object

Anything else (a path, a bundled model's name) is not a reference: `parse_ref` returns None.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_HUB_REPO = re.compile(r"[\w.\-]+/[\w.\-]+")
_BARE_HUB_ID = re.compile(r"[A-Za-z0-9][\w\-]*(\.[\w\-]+)*/[\w.\-]+")


class BadReferenceError(ValueError):
    """A string that says hf:// or s3:// but is not a well-formed reference."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """One parsed reference; `text` is how the user wrote it (logs and errors quote it)."""

    scheme: str  # "hf" | "s3"
    repo: str  # hf: "org/name"; s3: the bucket
    path: str  # hf: a GGUF file in the repo or ""; s3: the key prefix ("" = the whole bucket) or a .gguf key
    revision: str | None  # hf: branch, tag or commit (None: the default branch); s3: always None
    text: str

    @property
    def gguf(self) -> bool:
        """The reference names one GGUF file rather than a checkpoint directory."""
        return self.path.lower().endswith(".gguf")

    @property
    def served_name(self) -> str:
        """The name a worker serves it under by default, as for a local path: its last component."""
        return (self.path.rstrip("/") or self.repo).rsplit("/", 1)[-1]

    @property
    def source(self) -> str:
        """The reference without its revision: every cached copy of it, whatever revision, shares it."""
        return f"{self.scheme}://{self.repo}" + (f"/{self.path}" if self.path else "")

    def cache_key(self, version: str) -> str:
        """A directory name for this reference at `version` (a Hub commit, or a digest of the S3
        objects' ETags): readable, safe on any filesystem, unique through a digest."""
        readable = re.sub(r"[^\w.\-]+", "--", self.source.split("://", 1)[1]).strip("-")[:80]
        digest = hashlib.sha256(f"{self.source}\n{version}".encode()).hexdigest()[:16]
        return f"{self.scheme}--{readable}--{digest}"


def parse_ref(text: str, bare_hub_ids: bool = False) -> ModelRef | None:
    """The reference `text` makes, None when it is not one (a local path or bundled name). With
    `bare_hub_ids`, `org/name` counts as `hf://org/name` (the caller checks local paths first)."""
    text = str(text)
    if text.startswith("hf://"):
        return _hub(text, text[len("hf://"):])
    if text.startswith("s3://"):
        bucket, _, prefix = text[len("s3://"):].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,62}", bucket):
            raise BadReferenceError(f"model reference {text!r}: {bucket!r} is not an S3 bucket name")
        return ModelRef("s3", bucket, prefix.lstrip("/"), None, text)
    if bare_hub_ids and _BARE_HUB_ID.fullmatch(text.partition("@")[0]):
        return _hub(text, text)
    return None


def _hub(text: str, rest: str) -> ModelRef:
    rest, _, revision = rest.partition("@")
    parts = rest.strip("/").split("/")
    repo, path = "/".join(parts[:2]), "/".join(parts[2:])
    if not _HUB_REPO.fullmatch(repo):
        raise BadReferenceError(f"model reference {text!r}: use hf://org/name[@revision] or hf://org/name/file.gguf")
    if path and not path.lower().endswith(".gguf"):
        raise BadReferenceError(f"model reference {text!r}: a file inside a Hub repository must be a .gguf file")
    if "@" in text and not revision:
        raise BadReferenceError(f"model reference {text!r}: an empty revision after '@'")
    return ModelRef("hf", repo, path, revision or None, text)
