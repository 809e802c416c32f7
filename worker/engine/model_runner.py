"""Model runner: one flat varlen batch per step, logits only where a token is sampled."""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import torch

from ferry.kernels.metadata import LoraMapping
from ferry.kernels.ops import AttentionMetadata
from ferry.worker.engine.outputs import Logprob, PositionLogprobs
from ferry.worker.engine.sampler import SamplerOutput, sample
from ferry.worker.engine.scheduler import SchedulerOutput
from ferry.worker.engine.spec.decode import verify
from ferry.worker.models.config import ModelArch, rope_table_rows
from ferry.worker.models.kv_split import KVSplit, WindowedKV, kv_split

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a flat batch."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of the first of them (the tokens before it have KV already)
    block_ids: list[int]  # the sequence's block table
    num_logits: int  # trailing rows whose logits are wanted (0: a prefill chunk, 1: sample, k+1: verify)
    # Leading rows whose logits score the prompt token after them (params.prompt_logprobs); rank 0's
    # alone (the other tensor-parallel ranks compute no logits)
    num_prompt_logits: int = 0
    long_rope: bool = False  # LongRoPE: the sequence is past the switch, rotate with the long factors
    lora_slot: int = -1  # the device slot of its LoRA adapter; -1: the base model
    window_block_ids: list[int] = field(default_factory=list)  # a hybrid model's: its windowed layers' table


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64: every scheduled token of every sequence, flat
    positions: torch.Tensor  # [num_tokens] int64: each token's rotary row: its position (LongRoPE: rope_table_rows)
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of its KV slot
    attention: AttentionMetadata  # query_start_loc, seq_lens, block_tables (shared by all layers)
    logits_indices: torch.Tensor  # [num_logits] int64: rows whose logits are computed (a chunk's prompt rows first)
    lora: LoraMapping | None = None  # each row's adapter slot; None: no row has an adapter
    windowed: WindowedKV | None = None  # a hybrid model's windowed layers' pool, slots and block tables


@dataclass(slots=True)
class StepOutput:
    sampled: dict[str, list[int]]  # request id -> its new tokens (accepted proposals + one sampled), where it sampled
    logprobs: dict[str, list[PositionLogprobs]]  # request id -> one entry per new token, where asked for
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why sampling it raised (it fails alone)
    # request id -> (the position of the first prompt token scored, one entry per scored token): prompt logprobs
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`. On the CPU it is an anonymous mapping: the kernel's zero pages,
    each faulted in at its first write, so a 4 GiB pool costs nothing at start (torch.zeros writes
    every page: about 2.5 s of a cold start here) and RAM is taken as blocks fill."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # frombuffer keeps the mapping alive as long as the tensor (and views of it) live.
    # Private: a process forked from this one gets its own copy on write, never a shared pool.
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, model, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                 num_window_blocks: int = 0) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = torch.device(device)
        # A hybrid model (num_window_blocks > 0) keeps its windowed layers' KV in a pool of their own
        # (worker.models.kv_split); `kv_cache` then holds the full-attention layers only.
        self.split: KVSplit | None = kv_split(arch) if num_window_blocks else None
        if num_window_blocks and self.split is None:
            raise ValueError(f"a windowed KV pool needs both full and sliding-window layers; {arch.architecture} "
                             "has one kind")
        pool_layers = arch.num_layers if self.split is None else len(self.split.full_layers)
        # The pool: [layer, K/V, block, kv head, slot, head dim] (every layer, or a hybrid model's
        # full-attention ones). Zeroed so that padded positions read by the CPU path are finite
        # (they are masked out).
        kv_shape = (arch.num_kv_heads, block_size, arch.head_dim)
        self.kv_cache = zeroed_pool((pool_layers, 2, num_blocks, *kv_shape), dtype, self.device)
        self.window_kv_cache = None if self.split is None else zeroed_pool(
            (len(self.split.window_layers), 2, num_window_blocks, *kv_shape), dtype, self.device)
        self._attention_workspace: dict = {}  # scratch buffers the CPU attention path reuses every step
        # LongRoPE's rotary table holds the short factors' rows, then as many of the long factors'.
        self._rope_half = model.cos_sin.shape[0] // 2 if arch.rope.long_inv_freq is not None else 0

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """One block's KV bytes over `num_layers` layers (default: every layer)."""
        element = torch.empty((), dtype=dtype).element_size()
        layers = arch.num_layers if num_layers is None else num_layers
        return layers * 2 * arch.num_kv_heads * block_size * arch.head_dim * element

    def prepare(self, chunks: list[SeqChunk]) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        logits_indices: list[int] = []
        lora_slots: list[int] | None = None  # per row; None while no chunk has an adapter
        for chunk in chunks:
            if chunk.lora_slot >= 0 and lora_slots is None:
                lora_slots = [-1] * len(input_ids)
            if lora_slots is not None:
                lora_slots.extend([chunk.lora_slot] * len(chunk.token_ids))
            start, end = chunk.start, chunk.start + len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(rope_table_rows(self.arch.rope, start, end, chunk.long_rope, self._rope_half))
            query_lens.append(end - start)
            seq_lens.append(end)
            first_row = len(input_ids) - len(chunk.token_ids)
            logits_indices.extend(range(first_row, first_row + chunk.num_prompt_logits))
            logits_indices.extend(range(len(input_ids) - chunk.num_logits, len(input_ids)))
        dev = self.device
        slots, attention = self._paged(chunks, [c.block_ids for c in chunks], query_lens, seq_lens)
        windowed = None
        if self.split is not None:
            window_slots, window_attention = self._paged(chunks, [c.window_block_ids for c in chunks], query_lens,
                                                         seq_lens)
            windowed = WindowedKV(self.split, self.window_kv_cache, window_slots, window_attention)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=slots,
            attention=attention,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            lora=LoraMapping.build(lora_slots, dev) if lora_slots is not None else None,
            windowed=windowed,
        )

    def _paged(self, chunks: list[SeqChunk], tables: list[list[int]], query_lens: list[int],
               seq_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The [num_tokens] slot mapping and the attention metadata of one pool's block `tables`
        (one per chunk)."""
        bs = self.block_size
        slots: list[int] = []
        used_tables = []
        for chunk, table, end in zip(chunks, tables, seq_lens, strict=True):
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, end))
            used_tables.append(table[: -(-end // bs)])
        attention = AttentionMetadata.build(query_lens, seq_lens, used_tables, bs, self.device)
        attention.plans.workspace = self._attention_workspace
        return torch.tensor(slots, dtype=torch.int64, device=self.device), attention

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """KV of these blocks, on the pool's device: [layers, 2, n, kv heads, block size, head dim] in
        layer order. A hybrid model's `block_ids` are [2n]: n main-pool ids, then the same blocks'
        windowed-pool ids."""
        if self.split is None:
            return self.kv_cache.index_select(2, block_ids.to(self.device))
        full_ids, window_ids = block_ids.to(self.device).view(2, -1)
        out = self.kv_cache.new_empty((self.arch.num_layers, 2, len(full_ids), *self.kv_cache.shape[3:]))
        out[list(self.split.full_layers)] = self.kv_cache.index_select(2, full_ids)
        out[list(self.split.window_layers)] = self.window_kv_cache.index_select(2, window_ids)
        return out

    def write_blocks(self, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Fill these blocks (read_blocks' ids; a negative id: leave that pool's part of the block)
        with `kv` (read_blocks' shape, this pool's kv heads)."""
        kv = kv.to(device=self.device, dtype=self.kv_cache.dtype)
        block_ids = block_ids.to(self.device)
        if self.split is None:
            self.kv_cache.index_copy_(2, block_ids, kv)
            return
        for pool, layers, ids in zip((self.kv_cache, self.window_kv_cache),
                                     (self.split.full_layers, self.split.window_layers), block_ids.view(2, -1),
                                     strict=True):
            kept = (ids >= 0).nonzero().flatten()
            pool.index_copy_(2, ids[kept], kv[list(layers)].index_select(2, kept))

    @torch.inference_mode()
    def forward_hidden(self, chunks: list[SeqChunk]) -> tuple[ModelInput, torch.Tensor]:
        """Run the decoder over one flat batch (writing every chunk's KV): its inputs and the
        [num_tokens, hidden] final-normed hidden states. A tensor-parallel rank other than 0 stops here."""
        inputs = self.prepare(chunks)
        lora = getattr(self.model, "lora", None)
        if lora is not None:
            lora.set(inputs.lora)
        windowed = {} if inputs.windowed is None else {"windowed": inputs.windowed}
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.slot_mapping, inputs.attention,
                            **windowed)
        return inputs, hidden

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """Run one flat batch: write every chunk's KV, return [sum of num_logits, vocab] float32
        logits on the CPU (None when no chunk wants any)."""
        inputs, hidden = self.forward_hidden(chunks)
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)).cpu()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        """The target's step: every scheduled token in one batch, then a token (or a verified
        run of proposals plus one) for each request whose known tokens are all computed."""
        chunks, sampling, scoring = [], [], []
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens, strict=True):
            start, end, known = request.num_computed_tokens, request.num_computed_tokens + num_new, request.num_tokens
            # Past the known tokens come this step's proposals; the row before each one scores it.
            token_ids = request.all_token_ids[start:end] + request.spec.token_ids[: max(end - known, 0)]
            num_logits = end - known + 1 if end >= known else 0
            # Rows at positions start .. P-2 score the prompt token after them (P-1's row samples).
            scores_prompt = request.prompt_logprobs is not None
            num_prompt = max(0, min(end, request.num_prompt_tokens - 1) - start) if scores_prompt else 0
            chunks.append(SeqChunk(token_ids, start, request.block_ids, num_logits, num_prompt, request.rope_long,
                                   request.lora_slot, request.window_table.block_ids))
            if num_logits:
                sampling.append(request)
            if num_prompt:
                scoring.append((request, start, num_prompt))
        logits = self.forward(chunks)
        if logits is None:
            return StepOutput({}, {})
        prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = {}
        if scoring:
            logits, prompt_logprobs = _split_prompt_rows(logits, chunks, scoring)
            if not sampling:
                return StepOutput({}, {}, prompt_logprobs=prompt_logprobs)
        if any(r.spec.token_ids for r in sampling):
            verified = verify(logits, sampling)
            tokens, logprobs, failed = verified.token_ids, verified.logprobs, verified.failed
        else:
            sampled: SamplerOutput = sample(logits, sampling)
            tokens = [[t] for t in sampled.token_ids]
            logprobs = [None if lp is None else [lp] for lp in sampled.logprobs]
            failed = sampled.failed
        return StepOutput(
            {r.request_id: t for i, (r, t) in enumerate(zip(sampling, tokens, strict=True)) if i not in failed},
            {r.request_id: lp for r, lp in zip(sampling, logprobs, strict=True) if lp is not None},
            {sampling[i].request_id: message for i, message in failed.items()},
            prompt_logprobs,
        )


def _split_prompt_rows(logits: torch.Tensor, chunks: list[SeqChunk], scoring: list[tuple]) -> tuple[
        torch.Tensor, dict[str, tuple[int, list[PositionLogprobs]]]]:
    """`logits` ([prompt and sampling rows, vocab], per chunk: its prompt rows first) split into the
    sampling rows and each scoring request's prompt logprobs: (first position scored, entries)."""
    keep: list[int] = []
    prompt_rows: list[range] = []
    row = 0
    for chunk in chunks:
        if chunk.num_prompt_logits:
            prompt_rows.append(range(row, row + chunk.num_prompt_logits))
        row += chunk.num_prompt_logits
        keep.extend(range(row, row + chunk.num_logits))
        row += chunk.num_logits
    scored = {}
    for (request, start, count), rows in zip(scoring, prompt_rows, strict=True):
        # The row at position p scores the prompt token at p + 1.
        targets = request.all_token_ids[start + 1:start + 1 + count]
        scored[request.request_id] = (start + 1, position_logprobs(logits[rows.start:rows.stop], targets,
                                                                   request.params.prompt_logprobs))
    return logits[keep], scored


def position_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[PositionLogprobs]:
    """For each row of `logits` ([rows, vocab], raw): the top-n tokens' logprobs and rank, and the
    target token's (the one that came next), as `sampler.top_logprobs` gives one sampled row's."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1))  # [rows, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    out: list[PositionLogprobs] = []
    for i, (target, value) in enumerate(zip(targets, chosen.squeeze(1).tolist(), strict=True)):
        entry: PositionLogprobs = {}
        if top_ids is not None:
            for rank, (tid, top_value) in enumerate(zip(top_ids[i].tolist(), top_values[i].tolist(), strict=True), 1):
                entry[tid] = Logprob(top_value, rank)
        entry.setdefault(target, Logprob(value, ranks[i]))
        out.append(entry)
    return out
