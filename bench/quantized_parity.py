"""Accuracy of the quantized engine on the real SmolLM2-135M-Instruct GGUF (the bundled Q4_1, or
`--variant Q4_K_M` etc. made by llama.cpp's quantizer): greedy tokens and
held-out perplexity of `quantization="gguf"` (the file's blocks, multiplied by the native kernels
with activations rounded per block to int16, on AVX512_VNNI or AVX2 alike) against `quantization="none"` (the
same file dequantized to float32).

Reported: how many of 20 prompts produce the same `--tokens` greedy tokens (default 64, EOS
ignored), the first differing position of each that does not, and the two perplexities with
their relative difference (the issue's bar: within 0.5%).

    python -m bench.quantized_parity
    python -m bench.quantized_parity --variant Q4_K_M
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.common import write_result
from bench.gguf_variants import REPO, bench_model

PROMPTS = [
    f"{topic} Answer in a few sentences."
    for topic in (
        "What is the capital of France?",
        "Explain how a ferry crosses a river.",
        "Write a haiku about autumn leaves.",
        "Why is the sky blue?",
        "List three uses of copper.",
        "How does a refrigerator keep food cold?",
        "Describe the water cycle.",
        "What is a prime number?",
        "Give advice to a new programmer.",
        "Summarize the plot of a detective story.",
        "How do bees make honey?",
        "What causes the seasons on Earth?",
        "Write a short poem about the sea.",
        "Explain what a database index is.",
        "How do you bake bread at home?",
        "What is the difference between weather and climate?",
        "Describe a busy train station in the morning.",
        "Why do cats purr?",
        "How does a bicycle stay upright?",
        "What should a traveller pack for a week in the mountains?",
    )
]
HELD_OUT = (
    "The river was wide and slow in the summer, and the ferry crossed it twelve times a day. "
    "Each morning the ferryman checked the ropes, swept the deck and counted the life jackets. "
    "Travellers came with bicycles, baskets of vegetables and, once, a goat that refused to board. "
    "In the evening, when the last crossing was done, he wrote the day's fares in a small notebook "
    "and watched the lights of the town come on across the water."
)


def perplexity(llm, text: str) -> float:
    """exp(mean negative log-likelihood) of `text` in one prefill, through the engine's runner."""
    from ferry.worker.engine.model_runner import SeqChunk

    eng = llm.engine
    ids = eng.encode(text)
    blocks = list(range(-(-len(ids) // eng.block_size)))
    logits = eng.runner.forward([SeqChunk(ids, 0, blocks, num_logits=len(ids))])
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item())


def main(argv: list[str] | None = None) -> None:
    from ferry.worker.engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    parser.add_argument("--variant", default=None, help="the bundled file in this llama.cpp type (Q4_K_M, ...)")
    parser.add_argument("--tools-python", default=str(REPO / ".venv-tools" / "bin" / "python"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model = str(bench_model(args.model, args.variant, args.tools_python))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outputs, ppl = {}, {}
    for quantization in ("none", "gguf"):
        llm = LLM(model, quantization=quantization, max_model_len=512, kv_cache_bytes=64 << 20)
        outputs[quantization] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        ppl[quantization] = perplexity(llm, HELD_OUT)
        del llm
    differing = {
        i: next(k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
        for i, (x, y) in enumerate(zip(outputs["gguf"], outputs["none"], strict=True))
        if x != y
    }
    from ferry.kernels.cpu import native

    module = native.load()
    result = {
        "settings": {"model": str(model), "tokens": args.tokens, "prompts": len(PROMPTS)},
        "vnni": bool(module and module.linear_quantized_vnni()),
        "amx": bool(module and module.linear_quantized_amx()),  # products of 24+ rows on the tile unit: the same floats
        "same_greedy_tokens": len(PROMPTS) - len(differing),
        "first_difference_by_prompt": differing,
        "perplexity_fp32": ppl["none"],
        "perplexity_gguf": ppl["gguf"],
        "perplexity_relative_change": ppl["gguf"] / ppl["none"] - 1,
    }
    print(f"same greedy tokens: {result['same_greedy_tokens']}/{len(PROMPTS)} prompts ({args.tokens} tokens)")
    change = 100 * result["perplexity_relative_change"]
    print(f"perplexity fp32 {ppl['none']:.4f}, gguf {ppl['gguf']:.4f} ({change:+.3f}%)")
    suite = "quantized_parity" + (f"_{args.variant.lower()}" if args.variant else "")
    suite += "" if result["vnni"] else "_avx2"
    print(f"wrote {write_result(suite, result)}")


if __name__ == "__main__":
    main()
