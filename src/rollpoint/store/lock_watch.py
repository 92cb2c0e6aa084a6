"""The workdir lock, watched while a job runs: a run never goes on unguarded.

Owns running a job's coroutine beside a check of its workdir lock every
:data:`~rollpoint.store.workdir_lock.CHECK_EVERY_S`
(:func:`~rollpoint.store.workdir_lock.check_lock`): a lock file deleted or replaced is taken
again; when that cannot be done, the job is cancelled at once (as a crash would end it: what
it made durable stays, nothing more is written) and the check's one-line
:class:`~rollpoint.protocol.errors.WorkdirBusyError` is raised in its place. Does not own
the lock itself (:mod:`rollpoint.store.workdir_lock`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from rollpoint.protocol.errors import RollpointError
from rollpoint.store.workdir_lock import CHECK_EVERY_S, check_lock

T = TypeVar("T")


async def while_locked(workdir: Path, job: Awaitable[T], *, every_s: float = CHECK_EVERY_S) -> T:
    """Await ``job``, checking the lock on ``workdir`` every ``every_s`` meanwhile."""
    task = asyncio.ensure_future(job)
    failure: RollpointError | None = None

    async def watch() -> None:
        nonlocal failure
        while True:
            await asyncio.sleep(every_s)
            try:
                # A stat or two and, rarely, a re-take: too small to leave the loop for.
                check_lock(workdir)
            except RollpointError as exc:
                failure = exc
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except BaseException:
        # Cancelled for the lock: its one line, whatever the job's unwinding raised.
        if failure is not None:
            raise failure from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
