"""The native CPU attention (kernels/cpu/native.py) against the PyTorch reference.

Runs in-process (no Triton involved). The extension must build here: this machine has g++ and
ninja, and a silent fallback would leave the engine's default CPU path untested.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from ferry.kernels import ops, reference
from ferry.kernels.cpu import native as cpu_native
from ferry.kernels.metadata import BackendPlans
from ferry.worker.models.config import ModelArch
from tests.kernels.triton.test_paged_attention import BATCHES, SOFTCAP, make_case, oracle_attention

# (num_heads, num_kv_heads, head_dim): the register paths (32, 64, 128) and the portable loop (48, 80).
HEADS = [(2, 2, 64), (9, 3, 64), (8, 1, 32), (4, 2, 128), (4, 2, 48), (6, 3, 80)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def native():
    assert cpu_native.available(), "the native CPU attention did not build (g++ and ninja are needed)"


def reference_and_native(q, k_cache, v_cache, meta, scale=0.125):
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    meta.plans = BackendPlans()
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, scale)
    return expected, got


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_matches_reference_fp32(batch, num_heads, num_kv_heads, head_dim):
    q, k_cache, v_cache, meta = make_case(
        *BATCHES[batch], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=head_dim + num_heads
    )
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", ["decode", "mixed", "spec_verify"])
def test_matches_reference_half_precision(dtype, batch):
    q, k_cache, v_cache, meta = make_case(*BATCHES[batch], num_heads=8, num_kv_heads=2, dtype=dtype, seed=3)
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes_and_long_contexts(block_size):
    # Query runs of 1 .. 16 (the native limit) and one of 17 (the reference's), over contexts of
    # several hundred tokens, so the online softmax rescales across many blocks.
    query_lens = [1, 5, 16, 17, 1]
    seq_lens = [700, 301, 16, 400, 1]
    q, k_cache, v_cache, meta = make_case(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, block_size=block_size, seed=block_size
    )
    # Large logits: a max that moves block after block exercises the rescaling.
    q = q * 6
    expected, got = reference_and_native(q, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)


def test_writes_only_its_rows_into_out():
    q, k_cache, v_cache, meta = make_case(*BATCHES["mixed"], num_heads=4, num_kv_heads=2, seed=9)
    out = torch.full_like(q, float("nan"))
    result = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()
    meta.plans = BackendPlans()
    torch.testing.assert_close(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.125), rtol=0, atol=2e-5)


def test_default_cpu_dispatch_is_native(monkeypatch):
    monkeypatch.delenv("FERRY_ATTENTION_BACKEND", raising=False)
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=4, num_kv_heads=2, seed=4)
    assert ops.backend_for(q) == "cpu"
    dispatched = ops.paged_attention(q, k_cache, v_cache, meta, 0.125)
    meta.plans = BackendPlans()
    assert torch.equal(dispatched, cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125))


def test_rejects_mismatched_dtypes():
    q, k_cache, v_cache, meta = make_case(*BATCHES["decode"], num_heads=4, num_kv_heads=2, seed=5)
    module = cpu_native.load()
    short = torch.arange(meta.num_seqs, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dtype"):
        module.paged_attention_short(
            q.double(), k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, short, 0.1, q.double()
        )


# --- sliding window and logit soft-capping ------------------------------------------------------

# Short runs (decode, 5 and 16 query tokens: the native kernel) over contexts of many blocks
# outside the window, a context shorter than the window, and one 17-token chunk (the reference).
OPTION_BATCH = ([1, 1, 5, 16, 17, 1, 1], [300, 30, 129, 70, 200, 1, 45])
# (window, softcap): windows not a multiple of the block size (16), a window of one position.
OPTIONS = [(40, None), (None, SOFTCAP), (40, SOFTCAP), (1, None), (7, SOFTCAP), (32, None)]


def options_case(query_lens, seq_lens, softcap, **kwargs):
    q, k_cache, v_cache, meta = make_case(query_lens, seq_lens, **kwargs)
    return (q * 4 if softcap is not None else q), k_cache, v_cache, meta


@pytest.mark.parametrize(("window", "softcap"), OPTIONS, ids=lambda o: str(o))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
def test_window_and_softcap_match_oracle(num_heads, num_kv_heads, head_dim, window, softcap):
    q, k_cache, v_cache, meta = options_case(
        *OPTION_BATCH, softcap, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seed=head_dim
    )
    expected = oracle_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap).float()
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(40, None), (None, SOFTCAP), (40, SOFTCAP)], ids=str)
def test_window_and_softcap_half_precision(dtype, window, softcap):
    q, k_cache, v_cache, meta = options_case(*OPTION_BATCH, softcap, num_heads=8, num_kv_heads=2, dtype=dtype, seed=3)
    expected = oracle_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap).float()
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=2 * TOLERANCE[dtype])


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize(("query_len", "seq_len", "window"), [(1, 700, 200), (5, 333, 100), (1, 700, 1000)])
def test_window_with_few_sequences_splits_only_the_window(query_len, seq_len, window, softcap):
    # One sequence, one KV head: the kernel splits the blocks the window touches into ranges.
    q, k_cache, v_cache, meta = options_case([query_len], [seq_len], softcap, num_heads=3, num_kv_heads=1, seed=seq_len)
    expected = oracle_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap).float()
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)


@pytest.mark.parametrize("head_dim", [64, 48])  # the register path and the portable loop
def test_window_never_reads_positions_outside(head_dim):
    """Every cached position older than its sequence's first query row's window is NaN: a
    kernel that read one (even to mask it) would return NaN."""
    window, query_lens, seq_lens = 37, [1, 4, 16, 1], [500, 130, 90, 20]
    q, k_cache, v_cache, meta = make_case(
        query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, seed=5
    )
    expected = oracle_attention(q, k_cache, v_cache, meta, 0.125, window=window).float()
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for j in range(max(0, seq_len - query_len - window + 1)):
            block = int(meta.block_tables[i, j // 16])
            k_cache[block, :, j % 16] = float("nan")
            v_cache[block, :, j % 16] = float("nan")
    got = cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, window=window)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE[torch.float32])


def test_short_kernel_options_off_by_default():
    """window 0 / softcap 0.0 are the kernel's defaults (the decoder stack calls it without
    them): bit for bit the plain kernel."""
    q, k_cache, v_cache, meta = make_case(*BATCHES["spec_verify"], num_heads=4, num_kv_heads=2, seed=6)
    module = cpu_native.load()
    short = torch.arange(meta.num_seqs, dtype=torch.int64)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, short, 0.125)
    plain, explicit = torch.empty_like(q), torch.empty_like(q)
    module.paged_attention_short(*args, plain)
    module.paged_attention_short(*args, explicit, 0, 0.0)
    assert torch.equal(plain, explicit)
    assert torch.equal(plain, cpu_native.paged_attention(q, k_cache, v_cache, meta, 0.125, window=None, softcap=None))
    with pytest.raises(RuntimeError, match="window"):
        module.paged_attention_short(*args, explicit, -1, 0.0)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_dispatch_passes_window_and_softcap(backend, monkeypatch):
    monkeypatch.setenv("FERRY_ATTENTION_BACKEND", backend)
    q, k_cache, v_cache, meta = options_case(*OPTION_BATCH, SOFTCAP, num_heads=4, num_kv_heads=2, seed=8)
    dispatched = ops.paged_attention(q, k_cache, v_cache, meta, 0.125, window=40, softcap=SOFTCAP)
    meta.plans = BackendPlans()
    direct = (cpu_native if backend == "cpu" else reference).paged_attention
    assert torch.equal(dispatched, direct(q, k_cache, v_cache, meta, 0.125, window=40, softcap=SOFTCAP))
    expected = oracle_attention(q, k_cache, v_cache, meta, 0.125, window=40, softcap=SOFTCAP).float()
    torch.testing.assert_close(dispatched, expected, rtol=0, atol=TOLERANCE[torch.float32])


# --- fused elementwise ops -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(37, 200, generator=gen) * 3).to(dtype)
    weight = torch.randn(200, generator=gen).to(dtype)
    residual = torch.randn(37, 200, generator=gen).to(dtype) if with_residual else None
    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    got, got_residual = cpu_native.rms_norm(x, weight, 1e-6, None if residual is None else residual.clone())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_residual, expected_residual, rtol=0, atol=0)


def test_rms_norm_on_head_views():
    # Qwen3's q/k norms: [tokens, heads, head_dim] views into the fused qkv projection.
    gen = torch.Generator().manual_seed(12)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, generator=gen)
    q = qkv[:, : 4 * 16].reshape(5, 4, 16)
    weight = torch.randn(16, generator=gen)
    got, _ = cpu_native.rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(got, reference.rms_norm(q, weight, 1e-6)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_write_kv_matches_reference(dtype):
    from ferry.worker.models.config import RopeConfig, rope_cos_sin_cache

    gen = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads, head_dim, block_size = 9, 6, 2, 32, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 30, 31, 5, 6, 100])
    slots = torch.tensor([0, 1, 2, 7, -1, 13, 21, 22, 30])  # one padding token (-1) is not cached
    cos_sin = rope_cos_sin_cache(RopeConfig(theta=10000.0, kind="default"), head_dim, 128)

    def split(t):
        q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (
            q.reshape(tokens, heads, head_dim),
            k.reshape(tokens, kv_heads, head_dim),
            v.reshape(tokens, kv_heads, head_dim),
        )

    caches = [torch.zeros(8, kv_heads, block_size, head_dim, dtype=dtype) for _ in range(4)]
    expected_q = reference.rotary_and_write_kv(
        *split(qkv.clone()), positions, cos_sin, True, caches[0], caches[1], slots
    )
    got_q = cpu_native.rotary_and_write_kv(*split(qkv.clone()), positions, cos_sin, True, caches[2], caches[3], slots)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.float(), expected_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # v is copied as is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(14)
    gate_up = (torch.randn(19, 2 * 75, generator=gen) * 4).to(dtype)  # 75: a tail past the 8-wide loop
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        cpu_native.silu_and_mul(gate_up).float(), reference.silu_and_mul(gate_up).float(), rtol=tol, atol=tol
    )


def test_engine_greedy_same_with_cpu_and_torch_backends(llama_dir, monkeypatch):
    """The whole model on the cpu backend gives the reference backend's greedy tokens."""
    from ferry.worker.engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(15)
    outputs = {}
    for backend in ("torch", "cpu"):
        monkeypatch.setenv("FERRY_ATTENTION_BACKEND", backend)
        llm = LLM(str(llama_dir), max_model_len=128, kv_cache_bytes=1 << 20, max_num_batched_tokens=24)
        prompts = [
            torch.randint(3, len(llm.tokenizer), (n,), generator=gen.manual_seed(n)).tolist() for n in (1, 17, 40)
        ]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["cpu"] == outputs["torch"]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 200])
@pytest.mark.parametrize(
    ("n", "k", "with_bias"), [(576, 576, False), (130, 64, True), (3, 8, False), (17, 13, True), (48, 1, False)]
)
def test_packed_linear_matches_f_linear(rows, n, k, with_bias):
    """Every micro-kernel height (1-6 rows), a partial last panel (n % 16), odd K, bias."""
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = cpu_native.pack_weight(weight)
    assert packed is not None and packed.panels.shape == ((n + 15) // 16, k, 16)
    # Rows of x as a strided view (a slice of a wider activation), as the model passes them.
    x = torch.randn(rows, k + 8, generator=gen)[:, :k]
    got = cpu_native.linear(x, packed, bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "k"), [(576, 576), (200, 96), (49, 33)])
def test_packed_linear_gives_a_row_the_same_floats_in_any_batch(n, k):
    """A row alone (decode at batch 1, its own kernel) and the same row among others (a batch, a
    verification run) are summed in the same order: bit-identical, which keeps greedy
    speculative decoding token-identical to plain decoding."""
    gen = torch.Generator().manual_seed(n + k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = cpu_native.pack_weight(weight)
    x = torch.randn(7, k, generator=gen)
    batch = cpu_native.linear(x, packed, bias)
    for r in range(7):
        assert torch.equal(cpu_native.linear(x[r : r + 1], packed, bias)[0], batch[r])


def test_packed_linear_keeps_leading_dims_and_large_row_blocks():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 1536, generator=gen)  # K large enough that x is cut into row blocks
    x = torch.randn(3, 70, 1536, generator=gen)
    got = cpu_native.linear(x, cpu_native.pack_weight(weight))
    assert got.shape == (3, 70, 40)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=2e-4)


def test_only_float32_cpu_matrices_are_packed():
    assert cpu_native.pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_native.pack_weight(torch.randn(8)) is None
    weight = torch.randn(8, 16)
    x = torch.randn(2, 16)
    torch.testing.assert_close(cpu_native.linear(x, weight), torch.nn.functional.linear(x, weight))


def test_loaded_float32_model_holds_packed_projections_only(llama_dir):
    """The loader packs every projection (and drops its [out, in] tensor) and the head; a
    bfloat16 model keeps nn.Linear."""
    from ferry.worker.models.llama import PackedLinear
    from ferry.worker.models.loader import load_model

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(llama_dir))
    model = load_model(llama_dir, arch, torch.float32, torch.device("cpu"), 64)
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}
    assert kinds == {"PackedLinear"}
    assert model.lm_head_packed is not None
    assert not [name for name, _ in model.named_parameters() if name.endswith("proj.weight")]
    half = load_model(llama_dir, arch, torch.bfloat16, torch.device("cpu"), 64)
    assert {type(m).__name__ for m in half.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))} == {"Linear"}


@pytest.mark.parametrize(("num_kv_heads", "query_len", "seq_len"), [(1, 1, 700), (1, 5, 333), (2, 1, 129), (3, 16, 64)])
def test_few_sequences_split_their_blocks_and_merge_exactly(num_kv_heads, query_len, seq_len):
    # One sequence with one or two KV heads is fewer work items than threads (x2): the kernel
    # splits its blocks into ranges and merges their softmax states. Large logits make the
    # ranges' maxima differ, so the merge's rescaling is what is checked.
    q, k_cache, v_cache, meta = make_case(
        [query_len], [seq_len], num_heads=3 * num_kv_heads, num_kv_heads=num_kv_heads, block_size=16, seed=seq_len
    )
    expected, got = reference_and_native(q * 6, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-5)


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path):
    """torch's builder waits while its `lock` file exists; one left by a killed build is removed
    under Ferry's own OS lock (which a dead process cannot hold), so the next start goes on."""
    import subprocess
    import sys

    (tmp_path / "lock").write_text("")
    with cpu_native._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
        # Another process must wait for the OS lock while this one holds it.
        code = (
            "import fcntl, sys; f = open(sys.argv[1], 'w')\n"
            "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)"
        )
        held = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ferry.flock")], timeout=30)
        assert held.returncode == 3
    free = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ferry.flock")], timeout=30)
    assert free.returncode == 0
