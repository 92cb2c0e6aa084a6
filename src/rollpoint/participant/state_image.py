"""A participant's saved form kept current between checkpoints, so that a commit only copies it.

Owns :class:`StateImage`: one entry per key (a rollout id), made by the participant's
``make`` function and never changed once made; the keys whose entry is stale (the
participant calls :meth:`StateImage.changed` whenever the state behind a key changes);
a background sweep that remakes stale entries a few milliseconds at a time, between
checkpoints; and
:meth:`StateImage.capture`, which remakes what is still stale and copies the map.

Why: a commit runs inside the snapshot pause, and exporting every in-flight episode there
was the pause. Profiled at 100k sessions (50k per participant, 2 cores), the commit walked
its scope in Python — a SQLite image per changed workplace episode, a record per session
and per rollout's calls — for ~0.9 s of the 1 s pause. With the image, the pause remakes
only what changed in the last sweep interval and copies a dict (C speed, ~1 ms per 50k
entries); choosing the scope's entries and building its records runs in the writer's
thread after the pause, on the copy. This is the pre-copy of live migration: copy while
running, stop only for what is still dirty.

An image is idle until :meth:`StateImage.keep_current` (the fence calls it when a
coordinator first asks for its status, so checkpoints will follow) or its first capture:
changes are not even noted, so a server whose job never checkpoints keeps nothing. Then
it makes an entry for every key there is, and the sweep starts.

Entries are read in another thread after a capture: ``make`` must return values nobody
changes afterwards (new containers, never updated ones).

Does not own: what an entry holds or when the state changes (the participant), the scope,
nor writing (:mod:`rollpoint.participant.checkpoint_write`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from rollpoint.common.background import stop_task

log = logging.getLogger(__name__)

V = TypeVar("V")

SWEEP_INTERVAL_S = 0.25
"""How often stale entries are remade between checkpoints. A checkpoint remakes in its
pause what changed since the last sweep: at 5,000 changes a second, ~1,250."""
SWEEP_SLICE_S = 0.005
"""Work the sweep does before it yields the event loop: data-plane requests wait that long
at most. A slice, not a count: a workplace episode's SQLite image takes ~70 µs, a session
record ~10 µs."""
CAPTURE_SLICE_S = 0.05
"""The same inside a checkpoint's capture, longer: each yield lets data-plane handlers run
inside the pause (the reason exports once yielded every 2,048 sessions, not 256)."""
_CLOCK_EVERY = 32
"""Entries remade between two reads of the clock."""


class StateImage(Generic[V]):
    """Entries by key, kept current by a sweep; see the module docstring.

    ``make(key)`` returns the key's entry, or None when the key has no state any more
    (the entry is dropped). An error it raises leaves the key stale and reaches the
    capture's caller (the sweep logs it and tries again at its next pass).
    """

    def __init__(
        self, make: Callable[[str], V | None], keys: Callable[[], Iterable[str]], *, name: str
    ) -> None:
        """``keys()``: every key with state now (read once, by the first capture)."""
        self._make = make
        self._keys = keys
        self._active = False
        self._name = name
        self._entries: dict[str, V] = {}
        self._stale: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def stale(self) -> int:
        return len(self._stale)

    def __len__(self) -> int:
        return len(self._entries)

    def changed(self, key: str) -> None:
        """The state behind ``key`` changed (or appeared, or went): its entry is stale."""
        if self._active:
            self._stale.add(key)

    def keep_current(self) -> None:
        """Start noting changes and sweeping (idempotent; call it on the event loop)."""
        self._activate()
        self._start_sweeping()

    def _activate(self) -> None:
        if not self._active:
            self._active = True
            self._stale.update(self._keys())

    async def capture(self) -> dict[str, V]:
        """A copy of every entry, each current as of now. Yields the event loop between
        chunks of stale entries; call it while the state is not changing (inside a
        checkpoint's pause), or a change made meanwhile may or may not be in the copy."""
        self.keep_current()
        while self._stale:
            self._remake(CAPTURE_SLICE_S)
            if self._stale:
                await asyncio.sleep(0)
        return dict(self._entries)

    def capture_now(self) -> dict[str, V]:
        """:meth:`capture` without yielding, and without starting the sweep (for callers
        that export once, outside a checkpoint)."""
        self._activate()
        self._remake(None)
        return dict(self._entries)

    async def aclose(self) -> None:
        """Stop the sweep for good (captures still work, remaking what is stale)."""
        self._closed = True
        await stop_task(self._sweeper)
        self._sweeper = None

    def _start_sweeping(self) -> None:
        if self._sweeper is None and not self._closed:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep(), name=f"state image sweep ({self._name})"
            )

    async def _sweep(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                while self._stale:
                    self._remake(SWEEP_SLICE_S)
                    await asyncio.sleep(0)
                failing = False
            except Exception:  # a bug in make must not end the sweep for good
                if not failing:  # once, not every pass: the key stays stale and fails again
                    log.exception("%s: remaking state image entries failed", self._name)
                failing = True

    def _remake(self, slice_s: float | None) -> None:
        """Remake stale entries for about ``slice_s`` seconds (None: all of them). A key
        whose make raised stays stale."""
        entries, stale, make = self._entries, self._stale, self._make
        until = None if slice_s is None else time.perf_counter() + slice_s
        done = 0
        while stale:
            key = stale.pop()
            try:
                entry = make(key)
            except BaseException:
                stale.add(key)
                raise
            if entry is None:
                entries.pop(key, None)
            else:
                entries[key] = entry
            done += 1
            if until is not None and done % _CLOCK_EVERY == 0 and time.perf_counter() >= until:
                return
