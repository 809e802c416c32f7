"""End to end: the engine's greedy output is the same with the Triton kernels as with the
PyTorch reference (tiny Llama, fp32, Triton under the interpreter)."""

from __future__ import annotations

import os

import torch

# Prompt lengths: a one-token prompt, one that fills exactly two blocks, and one longer than
# the step's token budget, so the steps mix decode tokens with chunked prefill.
PROMPT_LENGTHS = [1, 32, 40]


def greedy_tokens(model_dir: str, backend: str, device: str) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt, and how many times the Triton paged attention ran."""
    from ferry.kernels import triton as triton_ops
    from ferry.worker.engine import LLM, SamplingParams

    saved = os.environ.get("FERRY_ATTENTION_BACKEND")
    os.environ["FERRY_ATTENTION_BACKEND"] = backend
    kernel = triton_ops.paged_attention
    calls = 0

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return kernel(*args, **kwargs)

    triton_ops.paged_attention = counted
    try:
        gen = torch.Generator().manual_seed(5)
        llm = LLM(model_dir, device=device, max_model_len=128, kv_cache_bytes=1 << 20, max_num_batched_tokens=24)
        vocab = len(llm.tokenizer)
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return [out.token_ids for out in outputs], calls
    finally:
        triton_ops.paged_attention = kernel
        if saved is None:
            os.environ.pop("FERRY_ATTENTION_BACKEND", None)
        else:
            os.environ["FERRY_ATTENTION_BACKEND"] = saved


def test_triton_backend_matches_torch_greedy(llama_dir, device, run):
    expected, triton_calls = run(greedy_tokens, str(llama_dir), "torch", device)
    assert triton_calls == 0 and all(len(tokens) == 8 for tokens in expected)
    tokens, triton_calls = run(greedy_tokens, str(llama_dir), "triton", device)
    assert triton_calls > 0
    assert tokens == expected
