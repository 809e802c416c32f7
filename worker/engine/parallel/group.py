"""Rank 0's side of a tensor-parallel group: spawn ranks 1..N-1, health-check them while they
start, send them each step, and stop them.

Failure: a rank that exits is seen before each message (`is_alive`) and by the collective it
leaves (gloo and nccl fail a collective whose peer closed its connection); a rank that hangs is
seen by the timeout (`tensor_parallel_timeout_s`) of the default group's collectives and of
rank 0's sends. Either raises `RankFailedError`, and the group is broken for good (the ranks'
KV pools no longer agree): the engine that owns it cannot step any more.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferry.worker.engine.parallel.rank import CONTROL_TIMEOUT, rank_main
from ferry.worker.engine.parallel.wire import Op, RankSpec
from ferry.worker.models.sharding import Shard, TensorParallelError

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # longest a rank may take to start and load its shard (it is health-checked meanwhile)
_POLL_S = 0.05
_STOP_WAIT_S = 10.0  # a stopped rank gets this long to exit before it is killed
_DEATH_WAIT_S = 1.0  # after a failed collective: how long the rank that caused it has to be seen exiting


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, hung past the collective timeout or failed to start: the engine
    cannot step any more (its process should hand its work back and exit)."""


class RankGroup:
    """Ranks 1..N-1 as spawned processes, and the torch.distributed groups joining them to this one."""

    def __init__(self, spec: RankSpec) -> None:
        """Spawn the ranks and join the group with them (they start loading their shards at once)."""
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already holds a torch.distributed group (another tensor-parallel engine): close it first"
            )
        self.shard = Shard(0, spec.size)
        self.broken: str | None = None  # why the group failed, once it has
        self._timeout = timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, spec.size, is_master=True, wait_for_workers=False, timeout=timeout)
        spec = replace(spec, store_port=store.port)
        context = mp.get_context("spawn")
        self._procs, self._conns = [], []
        for rank in range(1, spec.size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=rank_main, args=(spec, rank, theirs), name=f"ferry-tp-rank-{rank}",
                                   daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _kill, list(self._procs))
        try:
            self._expect("hello")
            backend = "nccl" if spec.device_type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=0, world_size=spec.size, timeout=timeout)
            self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        except BaseException:
            self.close()
            raise

    # --- start-up -------------------------------------------------------------------------------

    def agree_num_blocks(self, num_blocks: int, pools: Callable[[int], tuple[int, int]]) -> tuple[int, int]:
        """The KV pools every rank uses: `pools` of the smallest of each rank's own block count
        (`num_blocks` is rank 0's), so a block id names a block on every rank. Returns them
        (main pool's blocks, windowed pool's). Waits for the ranks to load their shards."""
        counts = self._expect("loaded")
        agreed = pools(min([num_blocks, *counts]))
        for conn in self._conns:
            conn.send(agreed)
        self._expect("ready")
        return agreed

    def _expect(self, kind: str) -> list:
        """Each rank's next start-up message, which must be `kind`: a rank that reports a failure,
        exits or stays silent past START_TIMEOUT_S fails the start."""
        values = []
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), start=1):
            while not conn.poll(_POLL_S):
                if not proc.is_alive():
                    raise RankFailedError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting"
                    )
                if time.monotonic() > deadline:
                    raise RankFailedError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
            try:
                got, value = conn.recv()
            except EOFError:
                raise RankFailedError(f"tensor-parallel rank {rank} exited while starting") from None
            if got == "failed":
                raise RankFailedError(f"tensor-parallel rank {rank} failed to start: {value}")
            if got != kind:
                raise RankFailedError(f"tensor-parallel rank {rank} sent {got!r} during start-up, expected {kind!r}")
            values.append(value)
        return values

    # --- messages ---------------------------------------------------------------------------------

    def send(self, op: Op, payload: torch.Tensor) -> None:
        """Broadcast one message (an int64 CPU payload) to every rank. The control group has no
        practical timeout (the ranks wait on it however long the engine idles), so rank 0 bounds
        its own wait: a rank that stopped reading fails the send after `timeout_s`."""
        self.check()
        header = torch.tensor([int(op), payload.numel()], dtype=torch.int64)
        for tensor in (header, payload) if op != Op.STOP else (header,):
            dist.broadcast(tensor, 0, group=self._control, async_op=True).wait(self._timeout)

    def check(self) -> None:
        """RankFailedError if the group has failed or a rank has exited."""
        if self.broken is None:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    self.broken = f"tensor-parallel rank {rank} exited with code {proc.exitcode}"
                    break
        if self.broken is not None:
            raise RankFailedError(self.broken)

    def fail(self, exc: BaseException) -> RankFailedError:
        """Mark the group broken by `exc` (a collective that failed or timed out, or this rank's own
        error mid-step); returns the error to raise."""
        if self.broken is None:
            deadline = time.monotonic() + _DEATH_WAIT_S  # a collective fails as its peer dies: name the peer
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            procs = enumerate(self._procs, start=1)
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in procs if not p.is_alive()]
            cause = (f"dead: {', '.join(dead)}" if dead else
                     f"{type(exc).__name__}: {exc}; no rank exited: one hangs or ran past tensor_parallel_timeout_s")
            self.broken = f"tensor-parallel step failed ({cause})"
            log.error("%s", self.broken)
        return RankFailedError(self.broken)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop the ranks (killed if they do not exit in time) and leave the group. Idempotent."""
        if not self._finalizer.alive:
            return
        if self.broken is None and dist.is_initialized():
            try:
                self.send(Op.STOP, torch.empty(0, dtype=torch.int64))
            except Exception:  # a rank died meanwhile: killed below
                pass
        deadline = time.monotonic() + (_STOP_WAIT_S if self.broken is None else 0.0)  # a broken group: kill now
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()
        for conn in self._conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
