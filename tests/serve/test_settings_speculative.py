"""FERRY_SPECULATIVE_* reach the engine as a validated speculative config."""

from __future__ import annotations

import pytest

from worker.engine.config import SpeculativeConfig
from worker.serve.settings import WorkerSettings


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


def test_the_engine_configs_own_key_names_work_too(monkeypatch):
    monkeypatch.setenv("FERRY_SPECULATIVE_METHOD", "ngram")
    monkeypatch.setenv("FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS", "6")
    monkeypatch.setenv("FERRY_SPECULATIVE_PROMPT_LOOKUP_MAX", "7")
    monkeypatch.setenv("FERRY_SPECULATIVE_PROMPT_LOOKUP_MIN", "2")
    monkeypatch.setenv("FERRY_SPECULATIVE_MEASURE_SPEEDUP", "false")
    monkeypatch.setenv("FERRY_SPECULATIVE_DISABLE_BY_BATCH_SIZE", "32")
    spec = SpeculativeConfig.of(WorkerSettings().engine_kwargs()["speculative"])
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (6, 7, 2)
    assert spec.measure_speedup is False and spec.disable_by_batch_size == 32
    # In code, the fields keep their own names.
    assert WorkerSettings(speculative_num_tokens=2).speculative_num_tokens == 2


def test_draft_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_SPECULATIVE_METHOD", "draft")
    monkeypatch.setenv("FERRY_SPECULATIVE_DRAFT_MODEL", str(tmp_path))
    spec = SpeculativeConfig.of(WorkerSettings().engine_kwargs()["speculative"])
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens, spec.measure_speedup) == ("draft", str(tmp_path), 4, True)
