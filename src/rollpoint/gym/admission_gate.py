"""The model server's admission gate: policy calls pass it one by one, and a checkpoint closes it.

Owns: whether new calls may start, how many are running (``in_flight``) and how many wait
at the closed gate (``waiting``), and a change signal so a checkpoint fence can wait for
"nothing in flight" without polling. Closing never fails a call: calls that arrive while it
is closed wait until it reopens; calls already admitted run to the end.

Does not own: when to close or open (the checkpoint fence decides), what a call is (the model
server proxies it), nor deadlines (a waiting caller is bounded by its own HTTP timeout).

Every operation is O(1). The gate lives in one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class AdmissionGate:
    """Admits policy calls while open; holds new ones while closed."""

    def __init__(self) -> None:
        self._open = True
        self._in_flight = 0
        self._waiting = 0
        self._opened = asyncio.Event()
        self._opened.set()
        self._changed = asyncio.Event()

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        """Calls admitted and not yet finished (a stream counts until its last byte)."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Calls held at the closed gate."""
        return self._waiting

    @property
    def drained(self) -> bool:
        """Closed with nothing in flight: every policy call is either done or held."""
        return not self._open and self._in_flight == 0

    def close(self) -> None:
        """Hold new calls from now on; idempotent."""
        if self._open:
            self._open = False
            self._opened.clear()
            self._notify()

    def open(self) -> None:
        """Admit new calls again and release every waiting one; idempotent."""
        if not self._open:
            self._open = True
            self._opened.set()
            self._notify()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Wait until the gate is open, then count the caller as in flight until it exits."""
        if not self._open:
            self._waiting += 1
            self._notify()
            try:
                # Loop: the gate may close again before a released waiter gets to run.
                while not self._open:
                    await self._opened.wait()
            finally:
                self._waiting -= 1
                self._notify()
        self._in_flight += 1
        self._notify()
        try:
            yield
        finally:
            self._in_flight -= 1
            self._notify()

    async def wait_changed(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until any count or the open state changes; False when ``timeout`` passed first.

        Check the condition you want before calling: a change that happened earlier does not
        wake this call.
        """
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _notify(self) -> None:
        # A fresh event per change keeps notification O(1) with any number of watchers.
        self._changed.set()
        self._changed = asyncio.Event()
