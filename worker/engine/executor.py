"""Executors: how the engine's step reaches the model, on one device or on a tensor-parallel group.

- `Executor` (tensor_parallel_size=1): the model runner in the engine's own process, called
  directly: no other process, no copy, no collective.
- `ParallelExecutor` (N > 1): rank 0 is the engine's process and runs the same model runner over
  its shard; before each forward pass it broadcasts the step's flat batch metadata once to ranks
  1..N-1 (`worker.engine.parallel`), which run their shards in lockstep (two all-reduces per
  layer, inside the model). Sampling happens on rank 0 alone, on the full logits of its
  replicated LM head. The block manager and prefix cache stay single, in the engine: a block id
  names the same block on every rank, and each rank's pool holds its kv heads of it.

Both expose `execute` (one step), `read_blocks` / `write_blocks` (whole blocks, every kv head,
for snapshots) and `close`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferry.worker.engine.model_runner import ModelRunner, SeqChunk, StepOutput
from ferry.worker.engine.parallel.group import RankFailedError, RankGroup
from ferry.worker.engine.parallel.wire import Op, pack_chunks, pack_lora
from ferry.worker.engine.scheduler import SchedulerOutput
from ferry.worker.models.config import ModelArch
from ferry.worker.models.lora_layers import clear_slot, write_slot
from ferry.worker.models.sharding import UNSHARDED, Shard, TensorParallelError, check_divisible, holds_kv_heads


def check_tensor_parallel(arch: ModelArch, size: int, device: torch.device, quantization: str | None) -> None:
    """TensorParallelError, before any weight is loaded, where `size` ranks cannot serve `arch`
    here: heads or MLP not divisible, more ranks than GPUs, a device or quantization that has
    no sharded path. On the CPU the ranks are processes on the same cores: any size goes."""
    check_divisible(arch, size)
    if size == 1:
        return
    if arch.implementation == "transformers":
        raise TensorParallelError(f"{arch.architecture} runs on the transformers fallback, which is served at "
                                  "tensor_parallel_size=1 only")
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise TensorParallelError(
                f"tensor_parallel_size={size} runs rank r on cuda:r: give device='cuda', not {device}"
            )
        available = torch.cuda.device_count()
        if size > available:
            raise TensorParallelError(f"tensor_parallel_size={size} needs {size} GPUs; {available} are visible")
    elif device.type != "cpu":
        raise TensorParallelError(f"tensor parallelism runs on cuda or cpu, not {device.type}")
    if quantization not in (None, "none"):
        raise TensorParallelError(
            f"quantization={quantization!r} is served at tensor_parallel_size=1 only; use 'none' to shard float weights"
        )


class Executor:
    """tensor_parallel_size=1: the engine's own model runner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, sched: SchedulerOutput) -> StepOutput:
        return self.runner.execute(sched)

    def read_blocks(self, block_ids: list[int], window_block_ids: list[int] | None = None) -> torch.Tensor:
        """KV of these blocks on the CPU: [layers, 2, len(block_ids), kv heads, block size, head dim].
        A hybrid model's blocks have a place in each pool: `window_block_ids` the windowed one's."""
        return self.runner.read_blocks(_block_ids(block_ids, window_block_ids)).cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, window_block_ids: list[int] | None = None) -> None:
        """Fill these blocks with `kv` (read_blocks' shape; a negative id leaves that pool's part)."""
        self.runner.write_blocks(_block_ids(block_ids, window_block_ids), kv)

    def write_lora(self, slot: int, adapter) -> None:
        """Put a loaded adapter (lora.manager.LoadedAdapter) into device slot `slot`."""
        write_slot(self.runner.model, slot, adapter.weights, self.runner.arch, UNSHARDED)

    def clear_lora(self, slot: int) -> None:
        clear_slot(self.runner.model, slot)

    def close(self) -> None:
        """Nothing to stop in one process."""


class _ShardRunner(ModelRunner):
    """Rank 0's model runner: each forward pass is announced to the other ranks first."""

    def __init__(self, group: RankGroup, *args) -> None:
        super().__init__(*args)
        self.group = group

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        self.group.send(Op.STEP, pack_chunks(chunks))
        return super().forward(chunks)


class ParallelExecutor(Executor):
    """tensor_parallel_size=N: rank 0 here, ranks 1..N-1 in `group`'s processes."""

    def __init__(self, group: RankGroup, arch: ModelArch, model, local: ModelArch, num_blocks: tuple[int, int],
                 block_size: int, dtype: torch.dtype, device) -> None:
        """`num_blocks`: (main pool's blocks, a hybrid model's windowed pool's or 0)."""
        super().__init__(_ShardRunner(group, model, local, num_blocks[0], block_size, dtype, device, num_blocks[1]))
        self.group = group
        self.arch = arch  # the whole model's: a block read here has all its kv heads
        size = group.shard.size
        # The ranks whose pools together hold every kv head once, in head order (a rank's heads
        # follow the lower ranks').
        self._head_ranks = [r for r in range(size) if holds_kv_heads(arch, Shard(r, size))]

    def execute(self, sched: SchedulerOutput) -> StepOutput:
        """One step on every rank; RankFailedError once any rank has failed (and from then on)."""
        self.group.check()
        try:
            return self.runner.execute(sched)
        except RankFailedError:
            raise
        except Exception as exc:  # mid-step the ranks' pools no longer agree: no later step can be right
            raise self.group.fail(exc) from exc

    def read_blocks(self, block_ids: list[int], window_block_ids: list[int] | None = None) -> torch.Tensor:
        """Every rank's heads of these blocks, gathered here in head order."""
        ids = _block_ids(block_ids, window_block_ids)
        try:
            self.group.send(Op.READ_BLOCKS, ids)
            mine = self.runner.read_blocks(ids).contiguous()
            parts = [torch.empty_like(mine) for _ in range(self.group.shard.size)]
            dist.gather(mine, parts, dst=0)
        except RankFailedError:
            raise
        except Exception as exc:
            raise self.group.fail(exc) from exc
        return torch.cat([parts[r] for r in self._head_ranks], dim=3).cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, window_block_ids: list[int] | None = None) -> None:
        """`kv` holds every kv head: each rank keeps its own."""
        pool = self.runner.kv_cache
        ids = _block_ids(block_ids, window_block_ids)
        try:
            self.group.send(Op.WRITE_BLOCKS, ids)
            full = kv.to(device=pool.device, dtype=pool.dtype).contiguous()
            dist.broadcast(full, 0)
        except RankFailedError:
            raise
        except Exception as exc:
            raise self.group.fail(exc) from exc
        self.runner.write_blocks(ids, full[:, :, :, : pool.shape[3]])

    def write_lora(self, slot: int, adapter) -> None:
        """Every rank its shard of the adapter: the others read it from the same local files."""
        self._send_lora(slot, str(adapter.directory))
        write_slot(self.runner.model, slot, adapter.weights, self.arch, self.group.shard)

    def clear_lora(self, slot: int) -> None:
        self._send_lora(slot, None)
        clear_slot(self.runner.model, slot)

    def _send_lora(self, slot: int, directory: str | None) -> None:
        try:
            self.group.send(Op.LORA, pack_lora(slot, directory))
        except RankFailedError:
            raise
        except Exception as exc:
            raise self.group.fail(exc) from exc

    def close(self) -> None:
        self.group.close()


def _block_ids(block_ids: list[int], window_block_ids: list[int] | None) -> torch.Tensor:
    """The int64 ids `ModelRunner.read_blocks` takes: the main pool's, then a hybrid model's windowed pool's."""
    return torch.tensor(block_ids + (window_block_ids or []), dtype=torch.int64)
