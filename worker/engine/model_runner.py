"""Model runner: one flat varlen batch per step, logits only where a token is sampled."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata
from worker.engine.request import Request
from worker.engine.sampler import SamplerOutput, sample
from worker.engine.scheduler import SchedulerOutput
from worker.models.config import ModelArch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64: every scheduled token of every request, flat
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of its KV slot
    attention: AttentionMetadata  # query_start_loc, seq_lens, block_tables (shared by all layers)
    logits_indices: torch.Tensor  # [num_sampling] int64: rows whose logits are computed
    sampling_requests: list[Request]  # the requests those rows belong to, same order


@dataclass(slots=True)
class StepOutput:
    sampled: dict[str, int]  # request id -> new token, for requests that finished their tokens
    logprobs: dict[str, object]  # request id -> PositionLogprobs, where asked for


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

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens, strict=True):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(table[: -(-end // bs)])
            if end == request.num_tokens:  # all known tokens computed: the next one is sampled
                logits_indices.append(len(input_ids) - 1)
                sampling.append(request)
        dev = self.device
        attention = AttentionMetadata.build(query_lens, seq_lens, tables, bs, dev)
        attention.backend_cache["workspace"] = self._attention_workspace
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            attention=attention,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            sampling_requests=sampling,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.slot_mapping, inputs.attention)
        if not inputs.sampling_requests:
            return StepOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices)).cpu()
        result: SamplerOutput = sample(logits, inputs.sampling_requests)
        sampled, logprobs = {}, {}
        for request, token, lp in zip(inputs.sampling_requests, result.token_ids, result.logprobs, strict=True):
            sampled[request.request_id] = token
            if lp is not None:
                logprobs[request.request_id] = lp
        return StepOutput(sampled, logprobs)
