"""The CPU attention backend: native decode/verify attention straight from the block pool.

`csrc/paged_attention_cpu.cpp` is compiled once per machine with torch's C++ extension builder
(g++ and ninja; about a minute) into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), then loaded in milliseconds. Sequences with a short query run
(decode, speculative verification: at most `SHORT_QUERY_MAX` tokens) go through it; longer
prefill chunks are compute-bound and stay on the reference's SDPA path. Where the extension
cannot be built (no compiler), everything falls back to the PyTorch reference, with one warning.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SHORT_QUERY_MAX = 16  # query tokens per sequence up to which the native kernel beats gather + SDPA
_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# Instruction-set flags by what this CPU can run (torch's own dispatch level), not -march=native:
# a shared extension cache must not hold code another machine cannot execute.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

_lock = threading.Lock()
_module = None
_failed = False


def load():
    """The compiled extension, building it on first use; None where it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            from torch.utils import cpp_extension

            # The builder runs `ninja` from PATH; the pip-installed one sits beside this Python.
            bin_dir = str(Path(sys.executable).parent)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

            isa = torch.backends.cpu.get_cpu_capability()
            log.info("loading native CPU attention (%s; the first load on a machine compiles it: about a minute)", isa)
            _module = cpp_extension.load(
                name=f"ferry_paged_attention_cpu_{isa.lower()}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-fopenmp-simd", *_ISA_FLAGS.get(isa, [])],
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
            _failed = True
            log.warning("native CPU attention unavailable (%s); using the PyTorch reference", exc)
    return _module


def available() -> bool:
    return load() is not None


def _short_sequences(meta: AttentionMetadata) -> tuple[torch.Tensor, bool]:
    """This step's sequences with a short query run (native), and whether any others exist."""
    cached = meta.backend_cache.get("cpu")
    if cached is None:
        short = [i for i, q in enumerate(meta.query_lens_host) if q <= SHORT_QUERY_MAX]
        cached = (torch.tensor(short, dtype=torch.int64), len(short) < meta.num_seqs)
        meta.backend_cache["cpu"] = cached
    return cached


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`."""
    module = load()
    if module is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, out)
    q = q.contiguous()
    if out is None or not out.is_contiguous():
        out = torch.empty_like(q)
    short, has_long = _short_sequences(meta)
    if short.numel():
        module.paged_attention_short(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, short, scale, out
        )
    if has_long:  # long prefill chunks are compute-bound: the reference's SDPA does them well
        reference.attend(q, k_cache, v_cache, meta, scale, out, min_query_len=SHORT_QUERY_MAX + 1)
    return out


if __name__ == "__main__":  # `python -m kernels.cpu_native`: build now (make setup does), say what happened
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    print(
        f"native CPU attention: {'built, ' + module.__file__ if module else 'unavailable (the PyTorch reference runs)'}"
    )
