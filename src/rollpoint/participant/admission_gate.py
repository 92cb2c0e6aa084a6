"""The admission gate: the one gate a participant closes to hold new work for a checkpoint.

Owns: whether new work may start, how much is running (``in_flight``) and how much waits
at the closed gate (``waiting``), and a change signal so a checkpoint fence can wait for
"nothing in flight" (or any condition on its owner's counts) without polling. Closing never
fails work: work that arrives while it is closed waits until it reopens; work already
admitted runs to the end.

The three built-in servers use it each in their own way:

- the model server admits every policy call (``async with gate.admit()``): a call waits
  while closed and counts as in flight to its last streamed byte;
- the resources server admits every call that changes state (start, tool call, release)
  the same way; verify only reads and never passes it;
- the agent server's session book closes it for a checkpoint and refuses new rows while
  it is closed (``is_open``: a row refused never ran, the trainer sends it again), and its
  running sessions wait at their next turn boundary (``wait_open``); its sessions' moves
  wake the fence through the same signal (``notify``).

Does not own: when to close or open (the checkpoint fence decides, through the
participant's admission hooks), what the work is, nor deadlines (a waiting caller is bounded
by its own HTTP timeout).

Every operation is O(1); the change signal allocates nothing while nobody watches. Waits
use :func:`asyncio.timeout`, never :func:`asyncio.wait_for` (on 3.11 ``wait_for`` can
swallow a cancel that lands as the awaited event fires; see :mod:`rollpoint.participant.fence_lease`).
The gate lives in one event loop and is not thread-safe.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class AdmissionGate:
    """Admits work while open; holds new work while closed; counts both."""

    __slots__ = ("_changed", "_in_flight", "_open", "_opened", "_waiting")

    def __init__(self) -> None:
        self._open = True
        self._in_flight = 0
        self._waiting = 0
        self._opened = asyncio.Event()
        self._opened.set()
        self._changed: asyncio.Event | None = None
        """Exists only while someone waits in :meth:`wait_changed`; a change sets and drops it."""

    # --- read side ---------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        """Work admitted and not yet finished (a stream counts until its last byte)."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Work held at the closed gate (in :meth:`admit` or :meth:`wait_open`)."""
        return self._waiting

    @property
    def drained(self) -> bool:
        """Closed with nothing in flight: all admitted work is done, the rest is held."""
        return not self._open and self._in_flight == 0

    # --- the fence's side --------------------------------------------------------------

    def close(self) -> None:
        """Hold new work from now on; idempotent."""
        if self._open:
            self._open = False
            self._opened.clear()
            self.notify()

    def open(self) -> None:
        """Admit new work again and release everything waiting; idempotent."""
        if not self._open:
            self._open = True
            self._opened.set()
            self.notify()

    # --- the work's side ---------------------------------------------------------------

    def admit(self) -> AdmissionGate:
        """``async with gate.admit():`` waits until the gate is open, then counts the caller
        as in flight until the block exits (however it exits). The gate itself is the
        context manager: admitting allocates nothing."""
        return self

    async def __aenter__(self) -> None:
        if not self._open:
            await self.wait_open()
        # No await between the open check and the count: a close after this line sees
        # the caller in flight.
        self._in_flight += 1
        self.notify()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._in_flight -= 1
        self.notify()

    async def wait_open(self) -> None:
        """Return once the gate is open, counted as waiting meanwhile; at once when open.

        For work that is already running and pauses at a safe point while the gate is
        closed (an agent session at its turn boundary), or work not counted as in flight."""
        if self._open:
            return
        self._waiting += 1
        self.notify()
        try:
            # Loop: the gate may close again before a released waiter gets to run.
            while not self._open:
                await self._opened.wait()
        finally:
            self._waiting -= 1
            self.notify()

    # --- the change signal -------------------------------------------------------------

    async def wait_changed(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until the open state, a count or the owner's state (:meth:`notify`)
        changes; False when ``timeout`` (seconds; None: no limit) passed first.

        Check the condition you want before calling: a change that happened earlier does
        not wake this call."""
        changed = self._changed
        if changed is None:
            changed = self._changed = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                await changed.wait()
        except TimeoutError:
            return False
        return True

    def notify(self) -> None:
        """Wake every :meth:`wait_changed`: the gate's owner calls it when its own state
        that a watcher reads changed (a session moved, a reply was acked)."""
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()
