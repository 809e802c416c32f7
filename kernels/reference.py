"""PyTorch reference kernels: the CPU path of the engine and the oracle for the Triton kernels.

Cache layout (one tensor per layer and per K/V):
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
Head-major inside a block, so one (block, kv head) pair is a contiguous [block_size, head_dim]
tile: the CPU path gathers whole tiles straight into the [batch, kv_heads, tokens, head_dim]
layout that `scaled_dot_product_attention` reads fastest, and the Triton kernel loads a tile
with one 2-D block pointer.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.kernels.metadata import AttentionMetadata, LoraMapping

# Decode sequences are padded to the longest one in their bucket; a new bucket starts when a
# sequence is this much longer (in blocks) than the bucket's shortest, which bounds the padding.
_DECODE_BUCKET_GROWTH = 1.3


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset, -1 = skip
) -> None:
    """Scatter this step's new K/V into the block pool (reshape-and-cache)."""
    block_size = k_cache.shape[2]
    skip = slot_mapping < 0
    if bool(skip.any()):
        keep = ~skip
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    # Advanced indices on dims 0 and 2 with a slice between: the indexed view is [tokens, heads, dim].
    k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value.to(v_cache.dtype)


@dataclass
class _DecodeBucket:
    token_index: torch.Tensor  # [n] int64: rows of q/out that belong to this bucket
    tile_index: torch.Tensor  # [n * num_kv_heads * num_blocks] int64: rows of cache.view(-1, bs * D)
    num_blocks: int  # blocks gathered per sequence (the bucket's longest)
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * bs] bool, None when no position is padding


@dataclass
class _PrefillSeq:
    start: int  # first row of this sequence in the flat batch
    query_len: int
    seq_len: int
    tile_index: torch.Tensor  # [num_kv_heads * num_blocks] int64
    # Sliding window only: the gathered tiles start at context position kv_start (a block
    # boundary), and mask [query_len, seq_len - kv_start] says which of them each row sees.
    kv_start: int = 0
    mask: torch.Tensor | None = None


@dataclass
class GatherPlan:
    decode: list[_DecodeBucket]
    prefill: list[_PrefillSeq]


def _tile_index(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, num_blocks] block ids -> [n * num_kv_heads * num_blocks] tile rows, ordered (seq, head, block)."""
    heads = torch.arange(num_kv_heads, dtype=torch.int64)
    return (block_ids.to(torch.int64)[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)


def check_attention_options(window: int | None, softcap: float | None) -> None:
    """Validate `paged_attention`'s per-layer options (every backend calls this)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"window must be a positive number of positions or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")


def _plan(meta: AttentionMetadata, num_kv_heads: int, min_query_len: int, window: int | None = None) -> GatherPlan:
    """Gather plan for the sequences whose query run is at least min_query_len tokens long. With a
    sliding `window`, each sequence gathers only the blocks its query rows' windows touch (a decode
    token over a long context reads ceil(window / block_size) + 1 blocks, not the whole context),
    and masks say which gathered positions each row sees."""
    key = min_query_len if window is None else (min_query_len, window)
    cached = meta.plans.torch.get(key)
    if cached is not None:
        return cached
    bs = meta.block_size
    tables = meta.block_tables.cpu()
    starts = [0]
    for q in meta.query_lens_host:
        starts.append(starts[-1] + q)

    def first_block(i: int) -> int:
        # The first query row (position seq_len - query_len) sees back to that minus window - 1.
        if window is None:
            return 0
        return max(0, meta.seq_lens_host[i] - meta.query_lens_host[i] - window + 1) // bs

    def span(i: int) -> int:  # blocks from first_block(i) to the end of the context
        return -(-meta.seq_lens_host[i] // bs) - first_block(i)

    decode_seqs = [i for i, q in enumerate(meta.query_lens_host) if q == 1 and q >= min_query_len]
    decode_seqs.sort(key=span)
    buckets: list[list[int]] = []
    for i in decode_seqs:
        if buckets and span(i) <= _DECODE_BUCKET_GROWTH * span(buckets[-1][0]) + 1:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    decode = []
    for members in buckets:
        lens = torch.tensor([meta.seq_lens_host[i] for i in members])
        firsts = torch.tensor([first_block(i) for i in members])
        lasts = torch.tensor([-(-meta.seq_lens_host[i] // bs) - 1 for i in members])
        num_blocks = max(span(i) for i in members)
        # Columns past a sequence's last block repeat that block (its own, never another
        # sequence's) and are masked out.
        columns = torch.minimum(firsts[:, None] + torch.arange(num_blocks)[None, :], lasts[:, None])
        positions = firsts[:, None] * bs + torch.arange(num_blocks * bs)[None, :]
        valid = positions < lens[:, None]
        if window is not None:
            valid &= positions >= lens[:, None] - window
        decode.append(
            _DecodeBucket(
                token_index=torch.tensor([starts[i] for i in members]),
                tile_index=_tile_index(torch.gather(tables[members], 1, columns), num_kv_heads),
                num_blocks=num_blocks,
                mask=None if bool(valid.all()) else valid[:, None, None, :],
            )
        )
    prefill = []
    for i, q in enumerate(meta.query_lens_host):
        if q == 1 or q < min_query_len:
            continue
        seq_len = meta.seq_lens_host[i]
        first = first_block(i)
        tile_index = _tile_index(tables[i : i + 1, first : -(-seq_len // bs)], num_kv_heads)
        if window is None or seq_len <= window:  # no row's window reaches back past position 0: plain causal
            prefill.append(_PrefillSeq(starts[i], q, seq_len, tile_index))
            continue
        rows = torch.arange(seq_len - q, seq_len)[:, None]  # each query row's position
        positions = torch.arange(first * bs, seq_len)[None, :]
        mask = (positions <= rows) & (positions > rows - window)
        prefill.append(_PrefillSeq(starts[i], q, seq_len, tile_index, kv_start=first * bs, mask=mask))
    plan = GatherPlan(decode, prefill)
    meta.plans.torch[key] = plan
    return plan


def _softcapped_attention(
    q: torch.Tensor,  # [batch, num_kv_heads, rows, head_dim]: the query heads of a KV head as rows
    k: torch.Tensor,  # [batch, num_kv_heads, positions, head_dim]
    v: torch.Tensor,  # [batch, num_kv_heads, positions, head_dim]
    mask: torch.Tensor | None,  # bool, broadcastable to [batch, num_kv_heads, rows, positions]; True = seen
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [batch, num_kv_heads, rows, head_dim] in k's dtype
    """Attention with Gemma 2's logit soft-capping, written out in float32 (SDPA has no cap):
    softmax(softcap * tanh(scale * q k^T / softcap)) v, as transformers' eager attention."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(k.dtype)


def _gather(
    cache: torch.Tensor, tile_index: torch.Tensor, n: int, num_blocks: int, workspace: dict, slot: str
) -> torch.Tensor:
    """Gather tiles into [n, num_kv_heads, num_blocks * block_size, head_dim] (contiguous).

    The destination is a reused workspace buffer: a fresh multi-megabyte tensor per layer costs
    as much in page faults as the copy itself."""
    _, num_kv_heads, block_size, head_dim = cache.shape
    rows = tile_index.numel()
    buffer = workspace.get(slot)
    if buffer is None or buffer.numel() < rows * block_size * head_dim or buffer.dtype != cache.dtype:
        buffer = torch.empty(rows * block_size * head_dim, dtype=cache.dtype, device=cache.device)
        workspace[slot] = buffer
    tiles = buffer[: rows * block_size * head_dim].view(rows, block_size * head_dim)
    torch.index_select(cache.view(-1, block_size * head_dim), 0, tile_index, out=tiles)
    return tiles.view(n, num_kv_heads, num_blocks * block_size, head_dim)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context.

    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q; they are the last
    query_len tokens of its seq_len-token context, so query row r (0-based within the
    sequence) sees context positions 0 .. seq_len - query_len + r. Query head h reads KV head
    h // (num_heads // num_kv_heads), as in transformers' repeat_kv.

    Per-layer options (None: off):
    - window: sliding-window attention as transformers defines it: the query at position
      p = seq_len - query_len + r sees only positions j with p - window < j <= p (the last
      `window` positions, itself included);
    - softcap: Gemma 2's attn_logit_softcapping: the scaled logits s = scale * q.k become
      softcap * tanh(s / softcap) before the softmax.
    """
    return attend(q, k_cache, v_cache, meta, scale, out, min_query_len=1, window=window, softcap=softcap)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None,
    min_query_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention` for only the sequences with at least min_query_len query tokens; the
    rows of the others are left as they are in `out` (another backend computes them)."""
    check_attention_options(window, softcap)
    if window is not None and window >= meta.max_seq_len:
        window = None  # every row's window reaches back past position 0: plain causal attention
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    plan = _plan(meta, num_kv_heads, min_query_len, window)
    workspace = meta.plans.workspace
    for bucket in plan.decode:
        n = bucket.token_index.numel()
        k = _gather(k_cache, bucket.tile_index, n, bucket.num_blocks, workspace, "k")
        v = _gather(v_cache, bucket.tile_index, n, bucket.num_blocks, workspace, "v")
        # A decode token's query heads that share a KV head become that head's "query rows".
        qd = q.index_select(0, bucket.token_index).view(n, num_kv_heads, group, head_dim).to(k.dtype)
        if softcap is None:
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=bucket.mask, scale=scale)
        else:
            o = _softcapped_attention(qd, k, v, bucket.mask, scale, softcap)
        out.index_copy_(0, bucket.token_index, o.reshape(n, num_heads, head_dim).to(out.dtype))
    for seq in plan.prefill:
        num_blocks = seq.tile_index.numel() // num_kv_heads
        kv_len = seq.seq_len - seq.kv_start
        k = _gather(k_cache, seq.tile_index, 1, num_blocks, workspace, "k")[:, :, :kv_len]
        v = _gather(v_cache, seq.tile_index, 1, num_blocks, workspace, "v")[:, :, :kv_len]
        qp = q[seq.start : seq.start + seq.query_len].transpose(0, 1).unsqueeze(0).to(k.dtype)
        if softcap is None and seq.mask is None:
            if seq.query_len == seq.seq_len:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                offset = seq.seq_len - seq.query_len
                rows = torch.arange(seq.query_len)[:, None] + offset
                mask = torch.arange(seq.seq_len)[None, :] <= rows
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        else:
            mask = seq.mask
            if mask is None:  # causal over the whole context
                rows = torch.arange(seq.query_len)[:, None] + (seq.seq_len - seq.query_len)
                mask = torch.arange(seq.seq_len)[None, :] <= rows
            if softcap is None:
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            else:
                # The query heads of a KV head as one run of rows: [1, kv heads, group * query_len, D].
                qg = qp.reshape(1, num_kv_heads, group * seq.query_len, head_dim)
                o = _softcapped_attention(qg, k, v, mask.repeat(group, 1), scale, softcap)
                o = o.view(1, num_heads, seq.query_len, head_dim)
        out[seq.start : seq.start + seq.query_len] = o[0].transpose(0, 1).to(out.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as transformers computes it (statistics in float32), with an optional fused
    residual add. Returns (normalised, residual_out) where residual_out = x (+ residual)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] float32: cos in [:, :D/2], sin in [:, D/2:]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding. neox: rotate the two halves of each head (Llama/Qwen/Mistral in
    transformers); gpt-j: rotate interleaved pairs (x[2i], x[2i+1])."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def apply(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)

    return apply(q), apply(k)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    """The gated MLP's activation: silu(gate) * up, gate and up the two halves of the last dim."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up, gate and up the two halves of the last dim."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary` on q and k, then `write_kv` of the rotated k and v; returns the rotated q."""
    q, k = rotary(q, k, positions, cos_sin_cache, is_neox)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def sort_by_expert(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """The (token, slot) pairs sorted by expert once (stable, experts ascending): (token rows
    [T * top_k] int64, router weights [T * top_k] float32, (expert, start, end) spans of those
    rows for each expert that some token chose)."""
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    spans, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            spans.append((expert, start, start + count))
            start += count
    return order // topk_ids.shape[1], topk_weights.reshape(-1)[order], spans


def expert_groups(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, token rows [n] int64, router weights [n] float32) for each expert that some token
    chose, experts ascending (`sort_by_expert`'s spans), so each expert's tokens are one slice and
    its product one matrix product."""
    tokens, weights, spans = sort_by_expert(topk_weights, topk_ids, num_experts)
    for expert, start, end in spans:
        yield expert, tokens[start:end], weights[start:end]


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32: the router's weight for each chosen expert
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64: the chosen experts
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """A mixture-of-experts MLP: for each token, the sum over its chosen experts of
    weight * down(silu(gate(x)) * up(x)). Tokens are grouped by expert, so each expert that has
    tokens runs one product per projection; experts are summed in ascending order, as
    transformers' experts modules do (the same float32 result)."""
    out = torch.zeros_like(x)
    for expert, rows, weights in expert_groups(topk_weights, topk_ids, w13.shape[0]):
        hidden = silu_and_mul(F.linear(x[rows], w13[expert]))
        out.index_add_(0, rows, (F.linear(hidden, w2[expert]) * weights[:, None]).to(out.dtype))
    return out


def lora_delta(
    x: torch.Tensor,  # [n, in]
    a: torch.Tensor,  # [R, in]: one slot's lora_a
    b: torch.Tensor,  # [out, R]: one slot's lora_b, scaling folded in
) -> torch.Tensor:  # [n, out], x's dtype
    """b @ (a @ x) per row. 16-bit inputs are multiplied in float32 and rounded once at the end:
    the [n, R] intermediate is never rounded, so the sum with the base output stays close to a
    merged-weight product (float32 inputs take no copy)."""
    compute = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    shrunk = F.linear(x.to(compute), a.to(compute))  # [n, R]
    return F.linear(shrunk, b.to(compute)).to(x.dtype)


def add_lora(
    y: torch.Tensor,  # [T, out]: the base projection's output, updated in place
    x: torch.Tensor,  # [T, in]: the projection's input
    lora_a: torch.Tensor,  # [num_slots, R, in]
    lora_b: torch.Tensor,  # [num_slots, out, R]
    mapping: LoraMapping,
) -> None:
    """In place: y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for every row t whose slot s = mapping.slot_of_row[t] >= 0.
    y: [T, out]; x: [T, in]; lora_a: [num_slots, R, in]; lora_b: [num_slots, out, R]; all one dtype
    (the model's: float32, bfloat16, float16). The scaling (alpha / r) is already folded into lora_b by the
    caller; ranks below R are zero-padded, and a fused projection (q|k|v) uses a block-diagonal lora_b, so the
    kernel needs to know nothing about either.

    Grouped ("SGMV"): one pair of products per slot present, over its rows, which one gather
    brought together (adapted rows grouped by slot); one scatter adds every update back. Rows
    without an adapter are neither read nor written."""
    if mapping.all_rows_one_slot is not None:
        slot = mapping.all_rows_one_slot
        y += lora_delta(x, lora_a[slot], lora_b[slot])
        return
    compute = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    if mapping.padded is not None:  # every adapter's rows in one grid: two batched products
        slots, width, rows, valid = mapping.padded
        grid = x.index_select(0, rows).to(compute).view(slots, width, -1)  # [slots, width, in]
        shrunk = torch.bmm(grid, lora_a[:slots].to(compute).transpose(1, 2))  # [slots, width, R]
        update = torch.bmm(shrunk, lora_b[:slots].to(compute).transpose(1, 2))  # [slots, width, out]
        y.index_add_(0, mapping.adapted_rows, update.view(slots * width, -1).index_select(0, valid).to(y.dtype))
        return
    grouped = x.index_select(0, mapping.adapted_rows).to(compute)  # [n, in], rows by slot
    update = torch.empty(grouped.shape[0], y.shape[1], dtype=compute, device=y.device)  # [n, out]
    for slot, start, count in mapping.segments:
        shrunk = torch.mm(grouped[start : start + count], lora_a[slot].to(compute).t())  # [count, R]
        torch.mm(shrunk, lora_b[slot].to(compute).t(), out=update[start : start + count])
    y.index_add_(0, mapping.adapted_rows, update.to(y.dtype))
