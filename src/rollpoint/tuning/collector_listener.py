"""The garbage collector's tricks on the checkpoint seam: :class:`CollectorListener`.

Justified by ``snapshot_pause`` (no collection inside a pause) and ``snapshot_pause_100k``
(full collections right after a pause, not into the next one).

Owns one :class:`~rollpoint.tuning.collector_schedule.ServerCollector` per source of
checkpoint events (:mod:`rollpoint.tuning.seam`: a fence, the trainer's snapshot
coordinator), made at its first event and dropped when it closes (or is garbage itself):
started on the source's loop when checkpoints come into use there, held from a checkpoint's
hold to its release, then given back :data:`COLLECTOR_RELEASE_DELAY_S` later if started,
at once if not (nothing would close a collector that never started, and a loop that ends
before a delayed release would leave the process's collector off for good), and closed
with its source. That is what the fence and the coordinator did with a collector field of
their own; they now only emit the events. :func:`rollpoint.tuning.install` adds one,
for the process's schedule, at each process's entry point; a test adds its own with
:func:`installed`.

It does not own the hold or the schedule (:mod:`rollpoint.tuning.collector_schedule`) nor
when the events come.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from rollpoint.tuning import seam
from rollpoint.tuning.collector_schedule import (
    COLLECTOR_RELEASE_DELAY_S,
    CollectorSchedule,
    ServerCollector,
)

__all__ = ["COLLECTOR_RELEASE_DELAY_S", "CollectorListener", "installed"]


class CollectorListener(seam.CheckpointListener):
    """One :class:`ServerCollector` per source, on ``schedule`` (default: the process's)."""

    def __init__(self, schedule: CollectorSchedule | None = None) -> None:
        self._schedule = schedule
        # Sources of several event loops (LocalCluster serves each server in a thread of
        # its own) reach one listener: the map is shared, each collector is its source's.
        self._lock = threading.Lock()
        self._collectors: weakref.WeakKeyDictionary[object, ServerCollector] = (
            weakref.WeakKeyDictionary()
        )

    def collector(self, source: object) -> ServerCollector | None:
        """``source``'s collector, if an event made one and it has not closed."""
        with self._lock:
            return self._collectors.get(source)

    def _made(self, source: object) -> ServerCollector:
        with self._lock:
            collector = self._collectors.get(source)
            if collector is None:
                collector = self._collectors[source] = ServerCollector(self._schedule)
            return collector

    def in_use(self, source: object) -> None:
        self._made(source).start()

    def hold(self, source: object) -> None:
        # No cyclic collection while the source is held: a full collection walks every
        # session's heap (hundreds of ms at 5k sessions), and the cut's own allocations are
        # what would trigger one inside the pause.
        self._made(source).hold()

    def release(self, source: object) -> None:
        collector = self.collector(source)
        if collector is None:
            return
        if collector.started:
            collector.release_soon(COLLECTOR_RELEASE_DELAY_S)
        else:
            # Never started, so never closed, and its loop may end before a delayed
            # release fires: the collector would stay off for good.
            collector.release()

    async def closed(self, source: object) -> None:
        with self._lock:
            collector = self._collectors.pop(source, None)
        if collector is not None:
            await collector.aclose()


@contextlib.contextmanager
def installed(schedule: CollectorSchedule | None = None) -> Iterator[CollectorListener]:
    """A :class:`CollectorListener` on ``schedule`` hears the checkpoint events emitted
    inside, alone (:func:`rollpoint.tuning.seam.listening`); for tests."""
    with seam.listening(CollectorListener(schedule)) as listener:
        yield listener
