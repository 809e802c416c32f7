"""KV held per sequence by a sliding-window model (issue 36): a Mistral-shaped tiny model whose
every layer has a `--window`-token window generates 4x its window after a 16-token prompt; the
most KV blocks the sequence ever held, against its window and against the whole sequence (what
it held before blocks behind the window were released).

    python -m bench.window_kv                       # windows 64 and 256, block 16
    python -m bench.window_kv --windows 4096 --block 16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import write_result


def held_blocks(window: int, block: int, prompt_tokens: int = 16) -> dict:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from ferry.worker.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                               max_position_embeddings=prompt_tokens + 4 * window + 16)
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(Path(tmp))  # no tokenizer: prompts are token ids
        llm = LLM(tmp, block_size=block)
        params = SamplingParams(max_tokens=4 * window, temperature=0.0, ignore_eos=True)
        llm.engine.add_request("window", list(range(3, 3 + prompt_tokens)), params)
        held = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            held = max(held, llm.engine.kv_usage().num_used_blocks)
    tokens = prompt_tokens + 4 * window
    whole = -(-tokens // block)
    return {"window": window, "block_size": block, "sequence_tokens": tokens, "max_blocks_held": held,
            "held_over_window": round(held * block / window, 3), "blocks_without_release": whole,
            "without_release_over_window": round(whole * block / window, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", default="64,256", help="comma-separated window sizes")
    parser.add_argument("--block", type=int, default=16, help="tokens per KV block")
    args = parser.parse_args(argv)
    rows = [held_blocks(int(w), args.block) for w in args.windows.split(",")]
    for r in rows:
        print(f"window {r['window']}, block {r['block_size']}: a {r['sequence_tokens']}-token sequence held at most "
              f"{r['max_blocks_held']} blocks = {r['held_over_window']}x its window "
              f"(without release {r['blocks_without_release']} blocks, {r['without_release_over_window']}x)")
    print(f"wrote {write_result('window_kv', {'settings': {'block_size': args.block}, 'results': rows})}")


if __name__ == "__main__":
    main()
