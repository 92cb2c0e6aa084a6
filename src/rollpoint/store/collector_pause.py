"""Pausing Python's cyclic garbage collector while a large document is decoded.

Owns :func:`collector_paused`. Decoding a snapshot (participant records, the ledger)
allocates millions of dicts and lists that hold no reference cycles, yet every 700
allocations trigger a young collection and the older generations' collections walk the
growing heap again and again: measured, that was three quarters of a restore's time. It
does not decide what to decode; callers wrap their decoding in it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
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
            if gc.get_freeze_count() == 0:
                # Move what was allocated meanwhile to the oldest generation unscanned: a
                # young collection would otherwise walk every decoded container right now
                # (0.6 s per 100k sessions), for records that hold no cycles. Anything
                # cyclic among them is still found by the next full collection.
                gc.freeze()
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()


_PAUSE = CollectorPause()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector is off inside (shared between threads; see :class:`CollectorPause`)."""
    with _PAUSE:
        yield
