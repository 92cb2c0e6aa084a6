"""Pausing Python's cyclic garbage collector while a large document is decoded.

Justified by ``snapshot_io`` (restore: collections over the growing heap took three
quarters of a restore) and ``snapshot_pause`` (no collection inside a pause).

Owns :func:`collector_paused`, and :class:`CollectorHold` for a pause that spans several
calls (a checkpoint's, from the seam's hold to its release:
:mod:`rollpoint.tuning.collector_listener`). Decoding a snapshot (participant records, the ledger)
allocates millions of dicts and lists that hold no reference cycles, yet every 700
allocations trigger a young collection and the older generations' collections walk the
growing heap again and again: measured, that was three quarters of a restore's time. It
does not decide what to decode; callers wrap their decoding in it.

Also owns :func:`freeze` and :func:`unfreeze`, through which rollpoint freezes objects
(the collector schedule freezes its collections' survivors): they keep a flag saying that
something is frozen, because CPython's ``gc.get_freeze_count()`` walks the whole frozen
generation to count it. At 100k in-flight sessions that walk, once per pause, was 64 % of
an agent's snapshot writer thread (py-spy, ``snapshot_growth_100k``, 2026-12-02).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from types import TracebackType


class CollectorPause:
    """Pauses the cyclic garbage collector while any holder is inside; thread-safe.

    The collector is process-wide: it comes back when the last concurrent decode ends,
    and only if it was on when the first began (an application that turned it off keeps
    it off). Garbage made meanwhile is not lost, only collected later; an application
    that froze objects itself (``gc.freeze``) keeps them frozen.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders > 0:
                return
            # Move what was allocated meanwhile out of the young generations unscanned: a
            # young collection would otherwise walk every decoded container right now
            # (0.6 s per 100k sessions), for records that hold no cycles.
            _settle_allocations()
            if self._was_enabled:
                gc.enable()


_FROZEN_LOCK = threading.RLock()
_frozen = False
"""rollpoint froze objects (:func:`freeze`) and has not thawed them since."""


def freeze() -> None:
    """``gc.freeze()``, remembered: a later pause need not count the frozen generation."""
    global _frozen
    with _FROZEN_LOCK:
        gc.freeze()
        _frozen = True


def unfreeze() -> None:
    """``gc.unfreeze()``, remembered (it thaws an application's own frozen objects too)."""
    global _frozen
    with _FROZEN_LOCK:
        gc.unfreeze()
        _frozen = False


def frozen_lock() -> threading.RLock:
    """Held by a caller whose thaw, collect and freeze must not interleave with a pause's exit."""
    return _FROZEN_LOCK


def _settle_allocations() -> None:
    """Move what was allocated during a pause out of the young generations, unscanned."""
    with _FROZEN_LOCK:
        # The flag first: counting is a walk of the frozen generation (millions of objects
        # once the schedule has frozen its survivors); it is counted only when rollpoint
        # froze nothing, to keep an application's own ``gc.freeze`` (then usually small).
        if _frozen or gc.get_freeze_count() > 0:
            # Objects are frozen already (by the collector schedule, or the application):
            # freeze these with them, and thaw nothing of theirs.
            freeze()
        else:
            # To the oldest generation: the next full collection still scans them.
            gc.freeze()
            gc.unfreeze()


_PAUSE = CollectorPause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector is off inside (shared between threads; see :class:`CollectorPause`)."""
    with _PAUSE:
        yield


class CollectorHold:
    """A collector pause that spans several calls of one event loop: taken by :meth:`hold`,
    given back by :meth:`release` now or :meth:`release_soon` after a delay; holding again
    meanwhile keeps it (a pending release is cancelled), so the pause never lapses between
    two holds. Idempotent both ways.

    ``on_release`` runs right after a hold is given back (not on a release that had
    nothing to give back): the moment a checkpoint's pause has just ended.
    """

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._held: contextlib.ExitStack | None = None
        self._release: asyncio.TimerHandle | None = None
        self._on_release = on_release

    @property
    def held(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self._held is None:
            self._held = contextlib.ExitStack()
            self._held.enter_context(collector_paused())

    def release_soon(self, delay_s: float) -> None:
        if self._held is not None and self._release is None:
            self._release = asyncio.get_running_loop().call_later(delay_s, self.release)

    def release(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self._held is not None:
            self._held.close()
            self._held = None
            if self._on_release is not None:
                self._on_release()
