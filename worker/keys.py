"""Redis key names: moved to `worker.protocol.keys`; this alias keeps old imports working."""

from worker.protocol.keys import GROUP, PRIORITIES, Keys

__all__ = ["GROUP", "PRIORITIES", "Keys"]
