"""Shared fixtures: tiny models are built once per session."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tiny_models import make_model

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
