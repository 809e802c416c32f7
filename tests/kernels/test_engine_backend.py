"""End to end: the engine's greedy output is the same with the Triton kernels as with the
PyTorch reference (tiny Llama and Qwen2-MoE, fp32, Triton under the interpreter)."""

from __future__ import annotations

import os

import torch

# Prompt lengths: a one-token prompt, one that fills exactly two blocks, and one longer than
# the step's token budget, so the steps mix decode tokens with chunked prefill.
PROMPT_LENGTHS = [1, 32, 40]


def greedy_tokens(
    model_dir: str, backend: str, device: str, kernel_name: str = "paged_attention"
) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt, and how many times the Triton kernel `kernel_name` ran."""
    from ferry.kernels import triton as triton_ops
    from ferry.worker.engine import LLM, SamplingParams

    saved = os.environ.get("FERRY_ATTENTION_BACKEND")
    os.environ["FERRY_ATTENTION_BACKEND"] = backend
    kernel = getattr(triton_ops, kernel_name)
    calls = 0

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return kernel(*args, **kwargs)

    setattr(triton_ops, kernel_name, counted)
    try:
        gen = torch.Generator().manual_seed(5)
        llm = LLM(model_dir, device=device, max_model_len=128, kv_cache_bytes=1 << 20, max_num_batched_tokens=24)
        vocab = len(llm.tokenizer)
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return [out.token_ids for out in outputs], calls
    finally:
        setattr(triton_ops, kernel_name, kernel)
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


def test_triton_fused_moe_matches_torch_greedy(tiny_model_factory, device, run):
    model_dir = str(tiny_model_factory("qwen2_moe"))
    expected, _ = run(greedy_tokens, model_dir, "torch", device, "fused_moe")
    tokens, moe_calls = run(greedy_tokens, model_dir, "triton", device, "fused_moe")
    assert moe_calls > 0
    assert tokens == expected
