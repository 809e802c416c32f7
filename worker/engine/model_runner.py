"""Model runner: one flat varlen batch per step, logits only where a token is sampled."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ferry.kernels.ops import AttentionMetadata
from ferry.worker.engine.outputs import PositionLogprobs
from ferry.worker.engine.sampler import SamplerOutput, sample
from ferry.worker.engine.scheduler import SchedulerOutput
from ferry.worker.engine.spec.decode import verify
from ferry.worker.models.config import ModelArch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a flat batch."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of the first of them (the tokens before it have KV already)
    block_ids: list[int]  # the sequence's block table
    num_logits: int  # trailing rows whose logits are wanted (0: a prefill chunk, 1: sample, k+1: verify)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64: every scheduled token of every sequence, flat
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of its KV slot
    attention: AttentionMetadata  # query_start_loc, seq_lens, block_tables (shared by all layers)
    logits_indices: torch.Tensor  # [num_logits] int64: rows whose logits are computed


@dataclass(slots=True)
class StepOutput:
    sampled: dict[str, list[int]]  # request id -> its new tokens (accepted proposals + one sampled), where it sampled
    logprobs: dict[str, list[PositionLogprobs]]  # request id -> one entry per new token, where asked for
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why sampling it raised (it fails alone)


class ModelRunner:
    def __init__(self, model, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.model = model
        self.arch = arch
        self.block_size = block_size
        self.device = torch.device(device)
        # One pool for all layers: [layer, K/V, block, kv head, slot, head dim]. Zeroed so that
        # padded positions read by the CPU path are finite (they are masked out).
        self.kv_cache = torch.zeros(
            (arch.num_layers, 2, num_blocks, arch.num_kv_heads, block_size, arch.head_dim),
            dtype=dtype,
            device=self.device,
        )
        self._attention_workspace: dict = {}  # scratch buffers the CPU attention path reuses every step

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return arch.num_layers * 2 * arch.num_kv_heads * block_size * arch.head_dim * element

    def prepare(self, chunks: list[SeqChunk]) -> ModelInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        logits_indices: list[int] = []
        for chunk in chunks:
            start, end = chunk.start, chunk.start + len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            table = chunk.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(table[: -(-end // bs)])
            logits_indices.extend(range(len(input_ids) - chunk.num_logits, len(input_ids)))
        dev = self.device
        attention = AttentionMetadata.build(query_lens, seq_lens, tables, bs, dev)
        attention.plans.workspace = self._attention_workspace
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            attention=attention,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def forward_hidden(self, chunks: list[SeqChunk]) -> tuple[ModelInput, torch.Tensor]:
        """Run the decoder over one flat batch (writing every chunk's KV): its inputs and the
        [num_tokens, hidden] final-normed hidden states. A tensor-parallel rank other than 0 stops here."""
        inputs = self.prepare(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.slot_mapping, inputs.attention)
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
        chunks, sampling = [], []
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens, strict=True):
            start, end, known = request.num_computed_tokens, request.num_computed_tokens + num_new, request.num_tokens
            # Past the known tokens come this step's proposals; the row before each one scores it.
            token_ids = request.all_token_ids[start:end] + request.spec.token_ids[: max(end - known, 0)]
            num_logits = end - known + 1 if end >= known else 0
            chunks.append(SeqChunk(token_ids, start, request.block_ids, num_logits))
            if num_logits:
                sampling.append(request)
        logits = self.forward(chunks)
        if logits is None:
            return StepOutput({}, {})
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
        )
