"""KV held per sequence by a sliding-window model (issue 36): a tiny model generates 4x its window
after a 16-token prompt; the most KV the sequence ever held, against its window and against the
whole sequence (what it held before blocks behind the window were released).

- Mistral-shaped, every layer windowed: blocks held.
- Gemma 2-shaped (`--family gemma2`), full-attention layers beside windowed ones: its windowed
  layers' blocks (their own pool) against the window, and the KV bytes of every layer against
  one pool that keeps every block for every layer.

    python -m bench.window_kv                       # windows 64 and 256, block 16, both families
    python -m bench.window_kv --windows 4096 --block 16 --family mistral
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import write_result


def held_blocks(window: int, block: int, prompt_tokens: int = 16) -> dict:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                           max_position_embeddings=prompt_tokens + 4 * window + 16)
    with tempfile.TemporaryDirectory() as tmp:
        llm = _engine(MistralForCausalLM(config), Path(tmp), block)
        steps = _run(llm, window, prompt_tokens)
    held = max(used for _, used, _ in steps)
    tokens = prompt_tokens + 4 * window
    whole = -(-tokens // block)
    return {"family": "mistral", "window": window, "block_size": block, "sequence_tokens": tokens,
            "max_blocks_held": held, "held_over_window": round(held * block / window, 3),
            "blocks_without_release": whole, "without_release_over_window": round(whole * block / window, 3),
            **_layer_blocks(steps, block, full_layers=0, window_layers=2)}


def hybrid_held(window: int, block: int, prompt_tokens: int = 16) -> dict:
    """Gemma 2-shaped: 4 layers, every other one windowed (their KV in a pool of its own)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                          max_position_embeddings=prompt_tokens + 4 * window + 16)
    with tempfile.TemporaryDirectory() as tmp:
        llm = _engine(Gemma2ForCausalLM(config), Path(tmp), block)
        steps = _run(llm, window, prompt_tokens)
        full_layers, window_layers = llm.engine.runner.kv_cache.shape[0], llm.engine.runner.window_kv_cache.shape[0]
    windowed = max(w for _, _, w in steps)
    return {"family": "gemma2", "window": window, "block_size": block, "sequence_tokens": prompt_tokens + 4 * window,
            "full_layers": full_layers, "window_layers": window_layers, "max_window_blocks_held": windowed,
            "window_held_over_window": round(windowed * block / window, 3),
            **_layer_blocks(steps, block, full_layers, window_layers)}


def _layer_blocks(steps: list[tuple[int, int, int]], block: int, full_layers: int, window_layers: int) -> dict:
    """KV in blocks of one layer (what a block of every layer is made of): the most the sequence
    held, against one pool keeping every block of every layer; and per step (tokens computed, held).
    A model with one pool (every layer windowed) counts its blocks as windowed layers' ones."""
    layers = full_layers + window_layers

    def layer_blocks(main: int, windowed: int) -> int:
        return main * full_layers + windowed * window_layers if full_layers else main * layers

    series = [(computed, layer_blocks(main, windowed)) for computed, main, windowed in steps]
    held = max(h for _, h in series)
    whole = -(-max(c for c, _ in series) // block) * layers
    return {"kv_layer_blocks_held": held, "kv_layer_blocks_without_release": whole,
            "kv_held_over_without_release": round(held / whole, 3), "layers": layers,
            "series_tokens_and_layer_blocks": series}


def _engine(model, directory: Path, block: int):
    import torch

    from ferry.worker.engine import LLM

    torch.manual_seed(0)
    model.save_pretrained(directory)  # no tokenizer: prompts are token ids
    return LLM(str(directory), block_size=block)


def _run(llm, window: int, prompt_tokens: int) -> list[tuple[int, int, int]]:
    """Generate 4x the window; per step (tokens computed, blocks in use in the main pool (a hybrid
    model's full layers'), in a hybrid model's windowed pool (0 for a model with one pool))."""
    from ferry.worker.engine import SamplingParams

    params = SamplingParams(max_tokens=4 * window, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("window", list(range(3, 3 + prompt_tokens)), params)
    kv = llm.engine.core.kv
    main, windowed = getattr(kv, "full", kv), getattr(kv, "windowed", None)
    steps = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        request = llm.engine.scheduler.requests.get("window")
        if request is None:  # finished: its blocks went back
            break
        in_window = 0 if windowed is None else windowed.num_blocks - windowed.num_free_blocks
        steps.append((request.num_computed_tokens, main.num_blocks - main.num_free_blocks, in_window))
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", default="64,256", help="comma-separated window sizes")
    parser.add_argument("--block", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--family", choices=("mistral", "gemma2", "both"), default="both")
    args = parser.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    rows = []
    if args.family in ("mistral", "both"):
        rows += [held_blocks(w, args.block) for w in windows]
    if args.family in ("gemma2", "both"):
        rows += [hybrid_held(w, args.block) for w in windows]
    for r in rows:
        start = f"{r['family']}, window {r['window']}, block {r['block_size']}: a {r['sequence_tokens']}-token sequence"
        if r["family"] == "mistral":
            print(f"{start} held at most {r['max_blocks_held']} blocks = {r['held_over_window']}x its window "
                  f"(without release {r['blocks_without_release']} blocks, {r['without_release_over_window']}x)")
        else:
            print(f"{start}: its {r['window_layers']} windowed layers held at most {r['max_window_blocks_held']} "
                  f"blocks = {r['window_held_over_window']}x the window; every layer's KV "
                  f"{r['kv_held_over_without_release']}x what one pool keeping every block holds")
    print(f"wrote {write_result('window_kv', {'settings': {'block_size': args.block}, 'results': rows})}")


if __name__ == "__main__":
    main()
