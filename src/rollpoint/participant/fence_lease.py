"""A fence's lease and the deadlines that extend it: :class:`FenceLease`.

Owns the clock side of one fence: the check every deadline passes before a verb acts on it
(not passed already, not further ahead than ``max_deadline_ahead_s``: a deadline holds
admission closed until it lapses), when the lease lapses (``lease_grace_s`` after the latest
deadline), and the task that wakes up then and asks the fence to reap it. It does not
reopen the participant nor decide which phase holds a lease: the fence does, under its lock
(:mod:`rollpoint.participant.fence`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from rollpoint.common.background import stop_task
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.protocol.errors import BadRequestError, DeadlineExceededError

__all__ = ["REOPEN_RETRY_S", "FenceLease"]

REOPEN_RETRY_S = 1.0
"""After a failed reopen on lease expiry, try again this much later."""


class FenceLease:
    """When one fence's hold lapses. Call :meth:`aclose` when the fence stops."""

    def __init__(self, settings: ControlSettings, clock: Callable[[], float]) -> None:
        self._settings = settings
        self._clock = clock
        self._expires_at: float | None = None
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    @property
    def expires_at(self) -> float | None:
        return self._expires_at

    def held(self) -> float:
        assert self._expires_at is not None, "a non-idle phase always holds a lease"
        return self._expires_at

    def check_deadline(self, verb: str, checkpoint_id: str, deadline_ts: float) -> None:
        late = self._clock() - deadline_ts
        if late >= 0:
            raise DeadlineExceededError(
                f"{verb} {checkpoint_id}: deadline {deadline_ts:.3f} passed {late:.3f}s ago"
            )
        horizon = self._settings.max_deadline_ahead_s
        if -late > horizon:
            raise BadRequestError(
                f"{verb} {checkpoint_id}: deadline_ts {deadline_ts:.3f} is {-late:.0f}s ahead, "
                f"more than this participant accepts (max_deadline_ahead_s {horizon:g}); "
                "deadline_ts is absolute Unix seconds, not a duration"
            )

    def extend(self, deadline_ts: float, reap: Callable[[], Awaitable[object]]) -> None:
        """Hold the lease until ``lease_grace_s`` after ``deadline_ts`` (never shorten it),
        and start the task that watches it unless one runs: once the lease lapses, it calls
        ``reap`` (the fence's reopening, under its lock)."""
        expires = deadline_ts + self._settings.lease_grace_s
        if self._expires_at is None or expires > self._expires_at:
            self._expires_at = expires
            self._changed.set()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(reap), name="rollpoint-lease")

    def lapsed(self) -> bool:
        expires = self._expires_at
        return expires is not None and self._clock() >= expires

    def retry_later(self) -> None:
        """A reopen on expiry failed: lapse again :data:`REOPEN_RETRY_S` from now."""
        self._expires_at = self._clock() + REOPEN_RETRY_S
        self._changed.set()

    def end(self) -> None:
        """The phase is back to idle: no lease."""
        self._expires_at = None
        self._changed.set()

    async def aclose(self) -> None:
        """Stop the watching task."""
        await stop_task(self._watcher)
        self._watcher = None

    async def _watch(self, reap: Callable[[], Awaitable[object]]) -> None:
        while True:
            self._changed.clear()
            expires = self._expires_at
            if expires is None:
                await self._changed.wait()
                continue
            delay = expires - self._clock()
            if delay > 0:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel
                # that lands as the event fires, and aclose would wait forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._changed.wait()
                continue
            await reap()
