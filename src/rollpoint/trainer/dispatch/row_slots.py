"""Row slots: the limit on rows in flight across all replicas (``concurrency``).

Owns the count of slots in use and the order waiters get them. It is not a plain
semaphore, for two reasons that would each deadlock a run:

- A group's rows go out in one stream, so a send takes all its slots **at once**; two
  groups each holding half of what they need would wait on each other forever.
- Re-sends (a refused row, a fresh re-send) jump ahead of new groups. A cohort verifier
  holds a group's admitted rows until its refused row arrives, so that row must not wait
  behind a new group that waits for the slots those very rows hold.

Waiters of one class are served first come, first served, and the head of a queue blocks
the rest of it (no starvation of a big group by a stream of small ones).
"""

from __future__ import annotations

import asyncio
from collections import deque

from rollpoint.protocol.errors import BadRequestError


class RowSlots:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise BadRequestError(f"row slots: concurrency must be >= 1, got {capacity}")
        self._capacity = capacity
        self._used = 0
        self._priority: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._normal: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def waiters(self) -> int:
        return len(self._priority) + len(self._normal)

    async def acquire(self, n: int, *, priority: bool = False) -> None:
        """Take ``n`` slots at once; re-sends pass ``priority=True``."""
        if not 1 <= n <= self._capacity:
            raise BadRequestError(f"row slots: cannot take {n} of {self._capacity} slots")
        queue = self._priority if priority else self._normal
        ahead = self._priority if priority else (self._priority or self._normal)
        if not ahead and self._used + n <= self._capacity:
            self._used += n
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, future)
        queue.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                queue.remove(entry)
                self._grant()  # we may have been the head blocking others
            raise

    def release(self, n: int = 1) -> None:
        if n <= 0:
            return
        if n > self._used:
            raise BadRequestError(f"row slots: releasing {n} slots, only {self._used} in use")
        self._used -= n
        self._grant()

    def _grant(self) -> None:
        for queue in (self._priority, self._normal):
            while queue:
                n, future = queue[0]
                if self._used + n > self._capacity:
                    return
                queue.popleft()
                self._used += n
                future.set_result(None)
