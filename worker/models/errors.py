"""Errors of model lookup, shared by the loader and the bundled-model finder."""

from __future__ import annotations


class ModelNotFoundError(ValueError):
    """The model name is not a local checkpoint, GGUF file, bundled model or hub id present in the local cache."""
