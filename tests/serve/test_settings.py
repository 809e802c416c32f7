"""FERRY_* reach the engine as its own validated config: one declaration, the flat names kept."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ferry.worker.engine.config import EngineConfig
from ferry.worker.serve.settings import DEFAULT_MODEL, WorkerSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("FERRY_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_engine_defaults_are_the_engines_own():
    engine = WorkerSettings().engine
    assert isinstance(engine, EngineConfig)
    assert engine == EngineConfig(model=DEFAULT_MODEL)  # no default re-declared: the device picks the token budget
    assert engine.max_num_batched_tokens is None and engine.speculative is None


def test_flat_variables_reach_the_engine(clean_env, tmp_path):
    for name, value in {"MODEL": str(tmp_path), "DTYPE": "bfloat16", "MAX_NUM_SEQS": "8", "BLOCK_SIZE": "32",
                        "MAX_NUM_BATCHED_TOKENS": "2048", "KV_CACHE_BYTES": "1048576", "MAX_MODEL_LEN": "512",
                        "ENABLE_PREFIX_CACHING": "false", "DEVICE": "cpu", "SEED": "7"}.items():
        clean_env.setenv(f"FERRY_{name}", value)
    engine = WorkerSettings().engine
    assert (engine.model, engine.dtype, engine.max_num_seqs, engine.block_size) == (str(tmp_path), "bfloat16", 8, 32)
    assert (engine.max_num_batched_tokens, engine.kv_cache_bytes, engine.max_model_len) == (2048, 1 << 20, 512)
    assert (engine.enable_prefix_caching, engine.device, engine.seed) == (False, "cpu", 7)


def test_a_partial_engine_config_serves_the_default_model(clean_env):
    clean_env.setenv("FERRY_MAX_NUM_SEQS", "4")
    engine = WorkerSettings().engine
    assert (engine.model, engine.max_num_seqs) == (DEFAULT_MODEL, 4)
    assert WorkerSettings(engine={"dtype": "float16"}).engine.model == DEFAULT_MODEL


def test_the_engines_checks_apply(clean_env):
    clean_env.setenv("FERRY_BLOCK_SIZE", "3")
    with pytest.raises(ValidationError, match="block_size must be a power of two"):
        WorkerSettings()


def test_tensor_parallel_size_from_the_environment(clean_env):
    assert WorkerSettings().engine.tensor_parallel_size == 1
    clean_env.setenv("FERRY_TENSOR_PARALLEL_SIZE", "4")
    assert WorkerSettings().engine.tensor_parallel_size == 4
    assert "FERRY_TENSOR_PARALLEL_SIZE" in WorkerSettings.variable_names()
    clean_env.setenv("FERRY_TENSOR_PARALLEL_SIZE", "0")
    with pytest.raises(ValidationError, match="tensor_parallel_size must be an integer >= 1"):
        WorkerSettings()


def test_speculation_is_off_by_default_and_without_a_method(clean_env):
    clean_env.setenv("FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS", "3")
    assert WorkerSettings().engine.speculative is None


def test_ngram_settings(clean_env):
    clean_env.setenv("FERRY_SPECULATIVE_METHOD", "ngram")
    clean_env.setenv("FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS", "3")
    clean_env.setenv("FERRY_SPECULATIVE_PROMPT_LOOKUP_MAX", "5")
    spec = WorkerSettings().engine.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)


def test_a_misspelt_speculative_setting_is_refused_not_ignored(clean_env):
    clean_env.setenv("FERRY_SPECULATIVE_METHOD", "ngram")
    clean_env.setenv("FERRY_SPECULATIVE_NUM_TOKENS", "3")  # the short name of earlier releases
    with pytest.raises(ValueError, match="unknown setting FERRY_SPECULATIVE_NUM_TOKENS"):
        WorkerSettings()


def test_draft_without_a_model_is_rejected(clean_env):
    clean_env.setenv("FERRY_SPECULATIVE_METHOD", "draft")
    with pytest.raises(ValidationError, match="draft_model"):
        WorkerSettings()


def test_the_engine_configs_own_key_names_work_too(clean_env):
    clean_env.setenv("FERRY_SPECULATIVE_METHOD", "ngram")
    clean_env.setenv("FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS", "6")
    clean_env.setenv("FERRY_SPECULATIVE_PROMPT_LOOKUP_MAX", "7")
    clean_env.setenv("FERRY_SPECULATIVE_PROMPT_LOOKUP_MIN", "2")
    clean_env.setenv("FERRY_SPECULATIVE_MEASURE_SPEEDUP", "false")
    clean_env.setenv("FERRY_SPECULATIVE_DISABLE_BY_BATCH_SIZE", "32")
    spec = WorkerSettings().engine.speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (6, 7, 2)
    assert spec.measure_speedup is False and spec.disable_by_batch_size == 32


def test_draft_settings(clean_env, tmp_path):
    clean_env.setenv("FERRY_SPECULATIVE_METHOD", "draft")
    clean_env.setenv("FERRY_SPECULATIVE_DRAFT_MODEL", str(tmp_path))
    spec = WorkerSettings().engine.speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens, spec.measure_speedup) == (
        "draft",
        str(tmp_path),
        4,
        True,
    )


def test_code_passes_the_engine_config_nested(clean_env, tmp_path):
    settings = WorkerSettings(
        engine={"model": str(tmp_path), "speculative": {"method": "ngram", "num_speculative_tokens": 2}}
    )
    assert settings.engine.speculative.num_speculative_tokens == 2 and settings.served_model_name == tmp_path.name


def test_the_log_level_comes_from_ferry_log_level(clean_env, monkeypatch):
    import logging

    monkeypatch.setenv("FERRY_LOG_LEVEL", "warning")
    settings = WorkerSettings()
    assert settings.log_level == "WARNING" and logging.getLevelName(settings.log_level) == logging.WARNING
    monkeypatch.setenv("FERRY_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="log_level"):
        WorkerSettings()


@pytest.mark.parametrize("variables, expected", [
    ({}, ".ferry/models"),
    ({"FERRY_MODEL_CACHE": "/node/models"}, "/node/models"),
    ({"FERRY_MODEL_CACHE_DIR": "/a", "FERRY_MODEL_CACHE": "/b"}, "/a"),
    ({"FERRY_MODEL_CACHE_DIR": "", "FERRY_MODEL_CACHE": "/b"}, "/b"),  # empty: unset
])
def test_the_worker_and_its_early_download_name_the_same_model_cache(clean_env, variables, expected):
    from ferry.worker.serve import early_start

    for name, value in variables.items():
        clean_env.setenv(name, value)
    started = []
    clean_env.setattr(early_start, "start_early", lambda model, cache_dir, max_bytes: started.append(cache_dir))
    early_start.start(["--model", "s3://bucket/model/"])
    assert started == [expected] == [WorkerSettings().engine.model_cache_dir]
