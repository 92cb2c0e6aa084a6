"""The dispatch barrier: the gate in front of every ``/run`` the trainer sends.

Owns whether rows may be sent (the snapshot coordinator closes it for a cut and opens
it after), who waits behind it, and the **pause clock**: a clock that stops while the
barrier is closed, so per-row deadlines and the stall watchdog never count time spent
paused by a snapshot. It does not know about rows or the ledger: a row waiting here is
queued, not in flight (the dispatcher marks it dispatched only once it passes).

``close`` and ``open`` are synchronous and idempotent, so the coordinator can call them
from any step of a save or an abort without tracking whether it already did. ``seal`` closes
it for good (a preempted run: no row is sent again, whatever a save in progress reopens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class DispatchBarrier:
    """An asyncio gate with a clock that stops while it is closed."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open = asyncio.Event()
        self._open.set()
        self._closed_at: float | None = None
        self._paused_before = 0.0
        self._pauses = 0
        self._waiting = 0
        self._sealed = False

    @property
    def is_open(self) -> bool:
        return self._closed_at is None

    @property
    def waiting(self) -> int:
        """How many senders wait behind the closed barrier right now."""
        return self._waiting

    @property
    def pauses(self) -> int:
        """How many times the barrier was closed."""
        return self._pauses

    def close(self) -> None:
        """Stop new sends and stop the pause clock. Closing a closed barrier does nothing."""
        if self._closed_at is None:
            self._closed_at = self._clock()
            self._pauses += 1
            self._open.clear()

    @property
    def sealed(self) -> bool:
        return self._sealed

    def seal(self) -> None:
        """Close for good: :meth:`open` does nothing from now on. Idempotent."""
        self.close()
        self._sealed = True

    def open(self) -> None:
        """Let waiting senders through and restart the pause clock. Idempotent; sealed, a no-op."""
        if self._closed_at is not None and not self._sealed:
            self._paused_before += max(0.0, self._clock() - self._closed_at)
            self._closed_at = None
            self._open.set()

    async def wait_open(self) -> None:
        """Return at once when open; otherwise wait until the barrier opens."""
        if self._closed_at is None:
            return
        self._waiting += 1
        try:
            await self._open.wait()
        finally:
            self._waiting -= 1

    @property
    def paused_seconds_total(self) -> float:
        """Seconds spent closed since this barrier was made, the current pause included."""
        current = 0.0 if self._closed_at is None else max(0.0, self._clock() - self._closed_at)
        return self._paused_before + current

    @property
    def current_pause_seconds(self) -> float:
        return 0.0 if self._closed_at is None else max(0.0, self._clock() - self._closed_at)

    def pause_clock(self) -> float:
        """Seconds on a clock that does not run while the barrier is closed.

        Compare two readings to measure a duration with snapshot pauses left out. While
        the barrier is closed the reading stays where it was when it closed.
        """
        return self._clock() - self.paused_seconds_total
