"""The native decoder stack (every layer in one call, for decode and verification steps) gives
the same floats as the model's layer-by-layer path, for each architecture's variations
(grouped-query attention, q/k/v biases, q/k norms, Gemma's sandwich norms, GeGLU, soft-capping and
local rotary table, a hybrid model's two KV pools), and stands aside for prefill chunks."""

from __future__ import annotations

import pytest
import torch

from ferry.worker.engine import Engine
from ferry.worker.engine.model_runner import SeqChunk
from ferry.worker.models.kv_split import kv_split

BLOCK = 16


def _engine(model_dir, dtype: str = "float32") -> Engine:
    return Engine(str(model_dir), dtype=dtype, kv_cache_bytes=8 << 20, max_model_len=256)


def _tables(lengths: list[int], first_block: int = 1) -> list[list[int]]:
    """Disjoint block tables with room for each context plus a verification run."""
    tables, next_block = [], first_block
    for length in lengths:
        count = -(-(length + 32) // BLOCK)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


# Odd shapes: q heads wider than the hidden size, one KV head, widths that are no multiple of the
# products' 16-column panels, a head dim off the attention's register paths.
ODD_SHAPE = dict(hidden_size=72, num_heads=3, num_kv_heads=1, head_dim=40)
# And widths that are no multiple of the 8-float vectors anywhere (hidden 36, head dim 12).
NARROW = dict(hidden_size=36, num_heads=3, num_kv_heads=3, head_dim=12)
# Windows wider than every context here: Gemma 2 every other layer (soft-capped
# attention), Gemma 3 one in two (q/k norms, its own rotary table for the local layers), Qwen2 from
# max_window_layers on; each keeps its windowed layers' KV in a pool of their own.
GEMMA2 = dict(head_dim=16, num_layers=4, sliding_window=512, attn_logit_softcapping=5.0, query_pre_attn_scalar=24)
GEMMA3 = dict(head_dim=16, num_layers=4, sliding_window=512, sliding_window_pattern=2, query_pre_attn_scalar=24,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})
QWEN2_HYBRID = dict(use_sliding_window=True, sliding_window=512, max_window_layers=1, num_layers=3)
CASES = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", ODD_SHAPE),
    ("qwen3", ODD_SHAPE),
    ("qwen2", NARROW),
    ("gemma2", GEMMA2),
    ("gemma3_text", GEMMA3),
    ("qwen2", QWEN2_HYBRID),
    # Windows shorter than the contexts (up to 146 tokens): the stack's layers attend over them
    ("mistral", dict(sliding_window=32)),
    ("gemma2", {**GEMMA2, "sliding_window": 32}),
]


def _randomise_norms(model) -> None:
    """Gemma's norm weights start at 0 (a scale of 1): random ones, so a norm applied to the wrong
    tensor changes the floats."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)


@pytest.mark.parametrize(("arch", "shape"), CASES,
                         ids=[f"{a}-{s.get('hidden_size', s.get('sliding_window', 'default'))}" for a, s in CASES])
def test_stack_matches_layer_by_layer(tiny_model_factory, arch, shape):
    runner = _engine(tiny_model_factory(arch, **shape)).runner
    model = runner.model
    _randomise_norms(model)
    model.native_stack = model._build_native_stack()
    stack = model.native_stack
    assert stack is not None and stack.num_layers == len(model.layers)
    assert (runner.window_kv_cache is not None) == (kv_split(model.arch) is not None)
    pools = [p for p in (runner.kv_cache, runner.window_kv_cache) if p is not None]
    vocab = model.arch.vocab_size
    generator = torch.Generator().manual_seed(0)
    contexts = [53, 17, 5, 130]
    tables = _tables(contexts)
    # A split model's windowed pool: other block ids than the main pool's, in reverse order
    window_tables = [t[::-1] for t in _tables(contexts, first_block=2)] if len(pools) > 1 else [[]] * len(tables)
    prompts = [torch.randint(vocab, (n,), generator=generator).tolist() for n in contexts]

    def prefill():  # contexts written by a prefill step (chunks longer than the native attention's limit)
        runner.forward([SeqChunk(p, 0, t, 1, window_block_ids=w)
                        for p, t, w in zip(prompts, tables, window_tables, strict=True)])

    prefill()
    # One decode step and verification runs of 4 and 16 (the native attention's limit) in one batch.
    query_lens = [1, 4, 16, 1]
    step = [
        SeqChunk(torch.randint(vocab, (q,), generator=generator).tolist(), n, t, q, window_block_ids=w)
        for q, n, t, w in zip(query_lens, contexts, tables, window_tables, strict=True)
    ]

    ran = []  # whether the stack took each step (it stands aside by returning None)
    stack_forward = stack.forward
    stack.forward = lambda *args, **kwargs: ran.append(stack_forward(*args, **kwargs)) or ran[-1]
    stacked = runner.forward(step)
    assert len(ran) == 1 and ran[0] is not None
    kv_stacked = [pool.clone() for pool in pools]
    for pool in pools:
        pool.zero_()  # the KV the step writes must come back from the other path too
    model.native_stack = None
    prefill()
    layer_by_layer = runner.forward(step)

    assert stacked.shape == (sum(query_lens), vocab)
    assert torch.equal(stacked, layer_by_layer)
    for before, pool in zip(kv_stacked, pools, strict=True):
        assert torch.equal(before, pool)


def test_stack_runs_only_short_query_steps(llama_dir):
    runner = _engine(llama_dir).runner
    stack = runner.model.native_stack
    table = _tables([40])[0]
    tokens = list(range(3, 43))

    def attempt(chunk: SeqChunk):
        inputs = runner.prepare([chunk])
        embeddings = runner.model.embed_tokens(inputs.input_ids)
        return stack.forward(
            embeddings, inputs.positions, runner.model.cos_sin, runner.kv_cache, inputs.slot_mapping, inputs.attention
        )

    with torch.inference_mode():
        assert attempt(SeqChunk(tokens, 0, table, 1)) is None  # a 40-token prefill chunk: layer by layer
        hidden = attempt(SeqChunk(tokens[:16], 24, table, 16))  # 16 tokens: the native limit
    assert hidden is not None and hidden.shape == (16, runner.model.arch.hidden_size)
    assert torch.isfinite(hidden).all()


def test_half_precision_models_run_layer_by_layer(llama_dir):
    # Only float32 weights are packed for the native products, so there is no stack to run.
    assert _engine(llama_dir, dtype="bfloat16").runner.model.native_stack is None
