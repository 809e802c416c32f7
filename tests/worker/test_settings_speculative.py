"""FERRY_SPECULATIVE_* reach the engine as a validated speculative config."""

from __future__ import annotations

import pytest

from worker.engine.config import SpeculativeConfig
from worker.settings import WorkerSettings


def test_speculation_is_off_by_default(monkeypatch):
    monkeypatch.delenv("FERRY_SPECULATIVE_METHOD", raising=False)
    assert WorkerSettings().engine_kwargs()["speculative"] is None


def test_ngram_settings(monkeypatch):
    monkeypatch.setenv("FERRY_SPECULATIVE_METHOD", "ngram")
    monkeypatch.setenv("FERRY_SPECULATIVE_NUM_TOKENS", "3")
    monkeypatch.setenv("FERRY_SPECULATIVE_NGRAM_MAX", "5")
    spec = SpeculativeConfig.of(WorkerSettings().engine_kwargs()["speculative"])
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)


def test_draft_without_a_model_is_rejected(monkeypatch):
    monkeypatch.setenv("FERRY_SPECULATIVE_METHOD", "draft")
    monkeypatch.delenv("FERRY_SPECULATIVE_DRAFT_MODEL", raising=False)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig.of(WorkerSettings().engine_kwargs()["speculative"])
