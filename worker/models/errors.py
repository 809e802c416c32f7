"""Errors of model lookup, shared by the loader and the bundled-model finder."""

from __future__ import annotations


class ModelNotFoundError(ValueError):
    """The model name is not a local checkpoint, GGUF file, bundled model or hub id present in the local cache."""


class ModelSourceError(ModelNotFoundError):
    """Weights named by an hf:// or s3:// reference could not be fetched: the message names the
    reference and the cause (no such repo, revision, bucket or key; no credentials; a truncated
    object; a full disk). Nothing of the attempt is left in the model cache."""


class SourceUnreachableError(ModelSourceError):
    """The Hub or the S3 endpoint did not answer at all (a copy already cached may still serve)."""
