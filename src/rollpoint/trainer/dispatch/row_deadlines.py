"""Row deadlines on the pause clock: the streams that still owe rows past their due time.

Owns the due time of every stream the dispatcher opens and the one task that watches them,
measured on the dispatch barrier's pause clock so a snapshot's pause never counts against
a row. It does not know what a stream owes (the ``owes`` predicate says whether it still
waits for anything) nor what becomes of a late row (``expire`` decides).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from rollpoint.common.background import stop_task
from rollpoint.protocol.errors import BadRequestError
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier

S = TypeVar("S")


class RowDeadlines(Generic[S]):
    """Calls ``expire(stream)`` once a stream that still ``owes`` rows is past its timeout."""

    def __init__(
        self,
        barrier: DispatchBarrier,
        timeout_s: float,
        *,
        owes: Callable[[S], bool],
        expire: Callable[[S], None],
    ) -> None:
        if timeout_s <= 0:
            raise BadRequestError(f"dispatcher: row_timeout_s must be > 0, got {timeout_s}")
        self._barrier = barrier
        self.timeout_s = timeout_s
        self._owes = owes
        self._expire = expire
        # Every stream gets the same timeout, so due times arrive in the order streams are
        # added: an insertion-ordered dict is a heap here, from which a stream that ended
        # is dropped at once (:meth:`drop`). Dropped only at the head, ended streams (each
        # holding its group and task) piled up for a whole timeout behind the oldest, 300 s
        # of rows at the default (issue 33's soak).
        self._due: dict[S, float] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, stream: S) -> None:
        """Start the clock of a stream whose rows were all sent just now."""
        self._due[stream] = self._barrier.pause_clock() + self.timeout_s
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="row-deadlines")

    def drop(self, stream: S) -> None:
        """Forget a stream that ended (it owes nothing any more); a no-op if unknown."""
        self._due.pop(stream, None)

    def __len__(self) -> int:
        """Streams watched: those added and neither dropped, expired nor found owing nothing."""
        return len(self._due)

    async def aclose(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _watch(self) -> None:
        while True:
            if not self._due:
                self._wake.clear()
                await self._wake.wait()
                continue
            stream, due = next(iter(self._due.items()))
            if not self._owes(stream):
                del self._due[stream]
                continue
            wait = due - self._barrier.pause_clock()
            if wait > 0:
                if self._barrier.is_open:
                    await asyncio.sleep(wait)
                else:
                    await self._barrier.wait_open()
                continue
            if self._due.pop(stream, None) is not None:  # not dropped while asleep
                self._expire(stream)
