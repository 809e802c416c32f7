"""What other threads ask of the engine thread: commands it takes between two steps.

`start` admits jobs (they share their first step), `abort` stops one (cancelled, or lost: written
by nobody), `hand_back_all` gives every job back (a drain ran out of time). The intake also
`announce`s jobs it has read and is still preparing; each later `start(..., arrived=n)` or
`settle(n)` accounts for n of them, and the engine thread waits briefly for announced jobs rather
than step half-empty.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from ferry.worker.serve.job_starts import JobStart


@dataclass(frozen=True, slots=True)
class Start:
    jobs: list[JobStart]  # admitted together: they share their first step
    arrived: int  # announced jobs now accounted for (started here or settled otherwise)


@dataclass(frozen=True, slots=True)
class Abort:
    job_id: str
    lost: bool  # another worker has the job, or Redis lost it: stop and write nothing; else it was cancelled


@dataclass(frozen=True, slots=True)
class HandBackAll:
    """Stop every job now and hand it back to the queue (a drain ran out of time)."""


Command = Start | Abort | HandBackAll


class Inbox:
    """The engine loop's commands: other threads call these methods; the engine thread drains `_inbox`."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._arriving = 0  # jobs announced by the intake and not yet started or settled
        self._arriving_lock = threading.Lock()

    def announce(self, count: int) -> None:
        """`count` jobs were read and are being prepared: each later `start(..., arrived=)` or
        `settle` accounts for some of them."""
        with self._arriving_lock:
            self._arriving += count

    @property
    def arriving(self) -> int:
        """Jobs announced and not yet started or settled (the worker is not idle while any are)."""
        return self._arriving

    def start(self, jobs: list[JobStart], arrived: int = 0) -> None:
        """Admit `jobs` together; `arrived` announced jobs are now accounted for."""
        self._inbox.put(Start(jobs, arrived))

    def settle(self, arrived: int) -> None:
        """`arrived` announced jobs will not come (the intake gave up on them)."""
        self._inbox.put(Start([], arrived))

    def abort(self, job_id: str, lost: bool = False) -> None:
        """Stop a job: cancelled (write the cancelled event), or `lost` (write nothing)."""
        self._inbox.put(Abort(job_id, lost))

    def hand_back_all(self) -> None:
        self._inbox.put(HandBackAll())

    def _arrived(self, count: int) -> None:
        with self._arriving_lock:
            self._arriving -= count
