"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

The interpreter must be on before triton is first imported: triton's own helpers (`tl.sum`,
`tl.zeros`, ...) are decorated at import, and by the time this file loads, the root conftest
has imported transformers, which imports triton. So the kernels run in one spawned child
process that sets TRITON_INTERPRET=1 first (`run` below); the tests compare there and a failed
assertion comes back with the child's traceback.

With TRITON_INTERPRET=0 on a machine with a GPU, `run` calls in-process on CUDA tensors, which
tests the compiled kernels instead.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.kernels.util import enable_interpreter

COMPILED = os.environ.get("TRITON_INTERPRET") == "0"


@pytest.fixture(scope="session")
def device() -> str:
    if not COMPILED:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    return "cuda"


@pytest.fixture(scope="session")
def run(device) -> Iterator[Callable]:
    """run(fn, *args, **kwargs): call a module-level function where the kernels can execute."""
    if COMPILED:
        yield lambda fn, *args, **kwargs: fn(*args, **kwargs)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=enable_interpreter) as pool:
        yield lambda fn, *args, **kwargs: pool.submit(fn, *args, **kwargs).result()
