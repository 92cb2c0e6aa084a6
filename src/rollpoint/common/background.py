"""Stopping a background task: the one way, which never swallows the caller's own cancel.

Owns :func:`stop_task`. The usual idiom, ``task.cancel()`` then ``await task`` under
``suppress(CancelledError)``, cannot tell the task's CancelledError from one meant for the
caller: cancel the caller while it waits there and the cancel is absorbed, and the caller
runs on as if nothing had asked it to stop. A snapshot loop cancelled that way, while its
save stopped the lease renewer, took the next snapshot and the next, and a run stopped by a
second SIGINT never ended (test_a_second_signal_stops_at_once_without_a_traceback, in CI).
"""

from __future__ import annotations

import asyncio
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended. The task's own cancellation is taken;
    an error it ended with otherwise is raised; a cancel of the caller while it waits
    propagates (the task has been asked to stop either way)."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error
