"""The dispatch in `kernels/ops.py`: CPU tensors go to the `cpu` backend by default and to
Triton or the pure reference when asked to."""

from __future__ import annotations

import os

import pytest
import torch

from ferry.kernels import ops, reference
from tests.kernels.triton.test_paged_attention import BATCHES, make_case


def check_forced_backends(device) -> None:
    from ferry.kernels import triton as triton_ops

    q, k_cache, v_cache, meta = make_case(*BATCHES["mixed"], num_heads=4, num_kv_heads=2, device=device, seed=21)
    saved = os.environ.get("FERRY_ATTENTION_BACKEND")
    try:
        for backend, module in (("triton", triton_ops), ("torch", reference)):
            os.environ["FERRY_ATTENTION_BACKEND"] = backend
            assert ops.backend_for(q) == backend
            dispatched = ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
            assert torch.equal(dispatched, module.paged_attention(q, k_cache, v_cache, meta, 0.125))
    finally:
        if saved is None:
            os.environ.pop("FERRY_ATTENTION_BACKEND", None)
        else:
            os.environ["FERRY_ATTENTION_BACKEND"] = saved


def test_forced_backends(device, run):
    run(check_forced_backends, device)


def test_default_and_invalid_backend(monkeypatch):
    monkeypatch.delenv("FERRY_ATTENTION_BACKEND", raising=False)
    assert ops.backend_for(torch.zeros(1)) == "cpu"
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FERRY_ATTENTION_BACKEND"):
        ops.backend_for(torch.zeros(1))


def test_a_pinned_backend_holds_for_the_forward_pass_and_nests(monkeypatch):
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "torch")
    x = torch.zeros(1)
    with ops.pinned_backend(x) as backend:
        assert backend == "torch"
        monkeypatch.delenv("FERRY_ATTENTION_BACKEND")  # read once at entry: no effect inside
        assert ops.backend_for(x) == "torch"
        with ops.pinned_backend(x) as inner:  # a nested pass keeps the outer choice
            assert inner == "torch"
        assert ops.backend_for(x) == "torch"
    assert ops.backend_for(x) == "cpu"  # unpinned again: the environment decides


def test_pinned_backend_is_per_thread(monkeypatch):
    import threading

    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", "torch")
    seen = []
    with ops.pinned_backend(torch.zeros(1)):
        monkeypatch.delenv("FERRY_ATTENTION_BACKEND")
        thread = threading.Thread(target=lambda: seen.append(ops.backend_for(torch.zeros(1))))
        thread.start()
        thread.join()
    assert seen == ["cpu"]  # another thread's calls are not pinned by this one's pass
