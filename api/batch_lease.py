"""The lease on a batch, and the writes it fences.

Each active batch (`Keys.active_batches`) is driven by one process at a time, the holder of its
lease (`Keys.batch_lease`, a random token per process, renewed every tick, taken over when it
lapses). Every write of the driver is one `lua.BATCH_FENCED` call that checks the lease first, so
a driver that stalled past its lease writes nothing.
"""

from __future__ import annotations

import json
import time
import uuid

from ferry.api.batches import STATUS_TIMES
from ferry.api.services import Services
from ferry.worker.protocol import lua


class Fenced(Exception):
    """The batch's lease is no longer this driver's: another process drives it now."""


class BatchLease:
    """This process's leases on batches, and its writes to the batches it holds."""

    def __init__(self, svc: Services) -> None:
        self.redis, self.keys, self.settings = svc.redis, svc.keys, svc.settings
        self.token = uuid.uuid4().hex  # this process, as the holder of a lease (and in the names of its parts)
        self._fenced = self.redis.register_script(lua.BATCH_FENCED)
        self._renew = self.redis.register_script(lua.BATCH_RENEW)

    async def hold(self, batch_id: str) -> bool:
        """Take the batch's lease, or renew it if it is ours; False while another process holds it."""
        lease, ms = self.keys.batch_lease(batch_id), int(self.settings.batch_lease_s * 1000)
        if await self.redis.set(lease, self.token, nx=True, px=ms):
            return True
        return bool(await self._renew(keys=[lease], args=[self.token, ms]))

    async def write(self, batch_id: str, writes: list[list]) -> None:
        """Apply `writes` ([command, key, args...], key one of "batch", "inflight", "parts") if the lease is ours."""
        names = {"batch": self.keys.batch(batch_id), "inflight": self.keys.batch_inflight(batch_id),
                 "parts": self.keys.batch_parts(batch_id)}
        order = list(names)
        encoded = [[w[0], order.index(w[1]) + 1, *map(str, w[2:])] for w in writes]
        keys = [self.keys.batch_lease(batch_id), *names.values()]
        if not await self._fenced(keys=keys, args=[self.token, json.dumps(encoded)]):
            raise Fenced(batch_id)

    async def set_status(self, batch_id: str, status: str, **fields) -> None:
        pairs = [status_field for item in {"status": status, STATUS_TIMES[status]: time.time(), **fields}.items()
                 for status_field in item]
        await self.write(batch_id, [["HSET", "batch", *pairs]])
