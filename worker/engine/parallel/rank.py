"""A spawned tensor-parallel rank (1..N-1): join the group, load its shard, size its KV pool
with rank 0, then run every message rank 0 broadcasts until it says stop.

Start-up goes over a pipe to rank 0 (`hello`, `loaded` with the rank's block count, then
`ready`, or `failed` with the reason), so rank 0 can tell a rank that died from one still
loading. A rank exits when rank 0's process goes away, whatever it is waiting on.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ferry.worker.engine.kv_budget import kv_budget_bytes
from ferry.worker.engine.model_runner import ModelRunner
from ferry.worker.engine.parallel.wire import Op, RankSpec, unpack_chunks, unpack_lora
from ferry.worker.models.loader import load_model
from ferry.worker.models.lora_adapter import read_adapter
from ferry.worker.models.lora_layers import attach_lora, clear_slot, write_slot
from ferry.worker.models.sharding import Shard, first_kv_head, local_arch

CONTROL_TIMEOUT = timedelta(days=365)  # the control group waits for rank 0's next message however idle it is
_PARENT_POLL_S = 1.0


def join_group(spec: RankSpec, rank: int) -> dist.ProcessGroup:
    """Join the default group (the model's collectives: gloo on CPU, nccl on CUDA, `timeout_s`) and
    return the control group (gloo, no practical timeout) that rank 0's messages arrive on."""
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=spec.timeout_s))
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def rank_main(spec: RankSpec, rank: int, conn) -> None:
    """The spawned process's entry point."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    try:
        torch.set_num_threads(spec.num_threads)
        device = torch.device("cpu") if spec.device_type == "cpu" else torch.device("cuda", rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("hello", None))
        control = join_group(spec, rank)
        shard = Shard(rank, spec.size)
        model = load_model(Path(spec.model_dir), spec.arch, spec.dtype, device, spec.max_model_len, shard=shard)
        if spec.lora_slots is not None:
            attach_lora(model, *spec.lora_slots)
        local = local_arch(spec.arch, shard)
        per_block = ModelRunner.bytes_per_block(local, spec.block_size, spec.dtype)
        ranks_per_host = spec.size if device.type == "cpu" else 1
        budget = kv_budget_bytes(spec.kv_cache_bytes, device, spec.max_model_len, spec.block_size,
                                 spec.max_num_seqs, per_block, ranks_per_host)
        conn.send(("loaded", budget // per_block))
        # (main pool, windowed pool) from the smallest count of all ranks: block ids mean the same everywhere
        num_blocks, num_window_blocks = conn.recv()
        runner = ModelRunner(model, local, num_blocks, spec.block_size, spec.dtype, device, num_window_blocks)
        conn.send(("ready", None))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    _serve(runner, control, first_kv_head(spec.arch, shard), spec.arch.num_kv_heads, spec, shard)
    dist.destroy_process_group()


def _serve(runner: ModelRunner, control: dist.ProcessGroup, kv_head0: int, num_kv_heads: int, spec: RankSpec,
           shard: Shard) -> None:
    header = torch.empty(2, dtype=torch.int64)
    pool = runner.kv_cache  # [layers, 2, blocks, local kv heads, block size, head dim]
    while True:
        dist.broadcast(header, 0, group=control)
        op, length = header.tolist()
        if op == Op.STOP:
            return
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, 0, group=control)
        if op == Op.STEP:
            runner.forward_hidden(unpack_chunks(payload))
        elif op == Op.READ_BLOCKS:
            dist.gather(runner.read_blocks(payload).contiguous(), None, dst=0)
        elif op == Op.WRITE_BLOCKS:
            num_ids = length if runner.split is None else length // 2
            shape = (spec.arch.num_layers, 2, num_ids, num_kv_heads, *pool.shape[4:])
            kv = torch.empty(shape, dtype=pool.dtype, device=pool.device)
            dist.broadcast(kv, 0)
            runner.write_blocks(payload, kv[:, :, :, kv_head0 : kv_head0 + pool.shape[3]])
        elif op == Op.LORA:  # rank 0 read and checked the same files: this rank's shard of them
            slot, directory = unpack_lora(payload)
            if directory is None:
                clear_slot(runner.model, slot)
            else:
                weights = read_adapter(Path(directory), spec.arch, spec.lora_slots[1], spec.dtype)
                write_slot(runner.model, slot, weights, spec.arch, shard)


def _exit_with_parent(parent: int) -> None:
    """Rank 0's process is gone (killed, crashed): leave at once rather than wait on it forever."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)
