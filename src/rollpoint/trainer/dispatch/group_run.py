"""Group runs: one group the dispatcher is playing, and the outcome it ends with.

Owns a running group's bookkeeping: the rows it still waits for, why it failed (if it did),
the refusals per try, when each row was first lost, and the tasks working on it (spawned, watched for a bug, cancelled
together when the group ends). It does not decide anything about a row, send anything or
touch the ledger: the :class:`~rollpoint.trainer.dispatch.dispatcher.Dispatcher` does.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    group_id: str
    failed: str | None = None
    """Why the group failed; None when every row finished."""

    @property
    def ok(self) -> bool:
        return self.failed is None


class GroupRun:
    """One running group: the rows it still waits for and the tasks working on them."""

    def __init__(self, group_id: str, remaining: set[int]) -> None:
        self.group_id = group_id
        self.remaining = remaining
        self.tasks: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()
        self.failure: str | None = None
        self.error: BaseException | None = None
        self.refusals: Counter[str] = Counter()
        self.first_lost: dict[int, float] = {}
        """Row → when (monotonic) a try of it was first given up on."""

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"dispatch-{self.group_id}")
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self.error is None:
            self.error = error
            self.done.set()

    async def cancel_all(self) -> None:
        pending = list(self.tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
