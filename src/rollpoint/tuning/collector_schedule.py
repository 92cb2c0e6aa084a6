"""When a checkpoint participant's process runs its full garbage collections.

Justified by ``snapshot_pause_100k`` (an automatic full collection that started
before a prepare put the pause p99 past 1 s).

Owns :class:`CollectorSchedule`, one per process (:func:`collector_schedule`): while any
source of checkpoint events (a fence, or the trainer's snapshot coordinator for its run;
:mod:`rollpoint.tuning.collector_listener` gives each a :class:`ServerCollector`) is
attached, CPython's *automatic* full (generation-2) collections are off and the process
runs them itself, at the moments those events mark: right after a checkpoint's pause. At
100k in-flight sessions an environment server holds millions of objects, and an automatic
full collection takes 0.5-2.5 s every 10-20 s. The collector is already paused from prepare
to just after resume (:mod:`rollpoint.tuning.collector_pause`), but a full collection that *starts* just
before a prepare or commit arrives holds that reply for its whole length, which is what put
the snapshot pause's p99 past its 1 s target. Run right after a checkpoint's pause ends,
a full collection is as far from the next checkpoint as it can be.

The survivors of each collection run here are frozen (``gc.freeze``): the next one scans
only what was allocated since, and one in :data:`THAW_GAP_S` thaws them first. At 100k
sessions this took an agent's scheduled collections from 1.7-8.8 s to 0.2-1.6 s, with the
same resident memory (two runs side by side, 2026-12-01). The heap there is mostly the
machinery of in-flight requests (coroutines, cells, bound methods: ~170 objects a
session in an agent, ~230 an in-flight call in a model server, counted at 10k), which
lives for a whole policy call and holds almost no cycles when it dies.

:class:`ServerCollector` with ``idle`` puts a server outside checkpoints on the same
schedule, collecting only while it has no call in flight (the scripted policy engine, whose full collections at
10k calls in flight took seconds and freed nothing).

Young collections (generations 0 and 1) stay automatic: they are short and keep the heap
from growing between full ones. The schedule does not decide *when* a checkpoint ends (a
:class:`ServerCollector` calls :meth:`CollectorSchedule.collect_if_due` as its hold is
given back, and a background task
:meth:`CollectorSchedule.collect_if_overdue` for a process that sees no checkpoints, or
:meth:`CollectorSchedule.collect_if_grown` for one whose heap grows with none ending), does
not pause the collector (:mod:`rollpoint.tuning.collector_pause`) and does not track full
collections it did not run itself.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable

from rollpoint.common.background import stop_task
from rollpoint.tuning.collector_pause import CollectorHold, freeze, frozen_lock, unfreeze

log = logging.getLogger(__name__)

MIN_GAP_S = 10.0
"""Full collections at most this often: CPython's own ran every 10-20 s at 100k sessions,
so garbage in reference cycles piles up no longer than it did."""
RATIO = 20.0
"""And at most once per this many times the last one's length: a heap whose full collection
takes 2 s gets one every 40 s, so at most 1/RATIO (5%) of the time goes to collecting."""
MAX_GAP_S = 60.0
"""A full collection this old is overdue: run it whether or not a checkpoint ended, so a
process with checkpointing off (or a long interval) still frees its cyclic garbage."""
THAW_GAP_S = 600.0
"""Survivors of each full collection run here are frozen (``gc.freeze``), so the next one
scans only what was allocated since; at most this often one thaws them first and scans
everything, collecting reference cycles among the frozen (at 100k sessions such a complete
scan takes seconds; a gc callback logged almost no cyclic garbage at that age)."""
CHECK_EVERY_S = 5.0
"""How often a :class:`ServerCollector`'s task looks for an overdue full collection."""
GROWTH_BLOCKS = 500_000
"""A heap that grew by this many allocated blocks (``sys.getallocatedblocks``) since the
last full collection here has grown enough to collect and freeze, when no checkpoint has
ended for :data:`QUIET_S` (:meth:`CollectorSchedule.grown`). Without it, a server whose
sessions opened for a minute with no checkpoint met its first with all of them unfrozen:
that collection, run just after the first pause, took 2.3-2.5 s in each model and agent
server at 10k sessions (six servers collecting at once on two cores) and held the next
pause 261 ms (docs/log/performance-2026.md, session 8). Collected as it grows, the same heap is
scanned a slice at a time, each slice frozen behind it (0.4-0.7 s each at a million blocks
in that run, the first collection after the cut then ~1 ms; half that here, so that a
resources server's smaller heap is sliced too)."""
QUIET_S = MIN_GAP_S
"""No checkpoint ended for this long, nor for twice the last gap between two checkpoints'
ends: a grown heap is collected by the task instead of waiting for a pause to end (while
checkpoints come, collections follow them). The gap counts because a slow cadence is not a
stop: at 100k sessions cuts came ~11 s apart in the bench, and a collection at 10 s would
have met the next prepare."""
COLLECTOR_RELEASE_DELAY_S = 0.25
"""How long after a checkpoint's pause ends the collector's listener gives a fence's or the
trainer coordinator's hold back (:meth:`ServerCollector.release_soon`), not at once: held off through the cut,
the collector's counts are far past the thresholds, and the first allocation would start a
full collection inside the resume itself, before the reply leaves (1.4 s of a
100k-session pause was the resume, measured); a due scheduled one then runs while the
reopened work is on the wire."""
_NEVER = 2**31 - 1
"""A generation-2 threshold no count reaches (``gc.set_threshold`` takes a C int)."""


class CollectorSchedule:
    """Automatic full collections off while attached; run here when due. Thread-safe.

    ``clock`` (seconds, monotonic) dates the collections and measures their length; the
    process start counts as the last full collection.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._attached = 0
        self._saved: tuple[int, int, int] | None = None
        self._last_full = clock()
        self._last_duration = 0.0
        self._last_thaw = self._last_full
        self._blocks_after = sys.getallocatedblocks()

    @property
    def attached(self) -> bool:
        return self._attached > 0

    def now(self) -> float:
        """The schedule's clock."""
        return self._clock()

    @property
    def last_duration_s(self) -> float:
        """How long the last full collection run here took (0 before the first)."""
        return self._last_duration

    def attach(self) -> None:
        """Turn automatic full collections off (counted: the first attach does it)."""
        with self._lock:
            if self._attached == 0:
                t0, t1, t2 = gc.get_threshold()
                self._saved = (t0, t1, t2)
                gc.set_threshold(t0, t1, _NEVER)
            self._attached += 1

    def detach(self) -> None:
        """Undo one :meth:`attach`; the last puts the thresholds back as they were."""
        with self._lock:
            if self._attached == 0:
                raise RuntimeError("CollectorSchedule.detach without a matching attach")
            self._attached -= 1
            if self._attached == 0 and self._saved is not None:
                gc.set_threshold(*self._saved)
                self._saved = None
                unfreeze()  # the heap as CPython's own collections expect it

    def due(self, now: float) -> bool:
        """A full collection may run at ``now``: the collector is on (no checkpoint holds
        it paused) and the last one is old enough (:data:`MIN_GAP_S`, :data:`RATIO`)."""
        gap = max(MIN_GAP_S, RATIO * self._last_duration)
        return gc.isenabled() and now - self._last_full >= gap

    def overdue(self, now: float) -> bool:
        """The last full collection is older than :data:`MAX_GAP_S` (the collector is on)."""
        return gc.isenabled() and now - self._last_full >= MAX_GAP_S

    def grown(self, now: float) -> bool:
        """The heap grew by :data:`GROWTH_BLOCKS` since the last full collection here (or
        since this schedule was made), and the collector is on. ``now`` is not used: the
        signature is :meth:`due`'s."""
        del now
        return gc.isenabled() and sys.getallocatedblocks() - self._blocks_after >= GROWTH_BLOCKS

    def collect_if_due(self, now: float | None = None) -> bool:
        """Run a full collection if :meth:`due` at ``now`` (default: the clock), dated
        ``now`` plus its length; True if it ran."""
        return self._collect_if(self.due, now)

    def collect_if_overdue(self, now: float | None = None) -> bool:
        """Run a full collection if :meth:`overdue` at ``now``; True if it ran."""
        return self._collect_if(self.overdue, now)

    def collect_if_grown(self, now: float | None = None) -> bool:
        """Run a full collection if the heap :meth:`grown`; True if it ran."""
        return self._collect_if(self.grown, now)

    def _collect_if(self, wanted: Callable[[float], bool], now: float | None) -> bool:
        # The frozen lock too: a pause ending meanwhile (another thread) must not freeze the
        # heap between the thaw and the collection.
        with self._lock, frozen_lock():
            now = self._clock() if now is None else now
            if not wanted(now):
                return False
            started = self._clock()
            thaw = started - self._last_thaw >= THAW_GAP_S
            if thaw:
                unfreeze()
            found = gc.collect(2)
            freeze()
            self._blocks_after = sys.getallocatedblocks()
            self._last_duration = self._clock() - started
            self._last_full = now + self._last_duration
            if thaw:
                self._last_thaw = self._last_full
        # At info: a full collection holds its process's event loop for its whole length,
        # and a reply late by that much is explained by this line (snapshot_growth).
        log.info(
            "full collection%s: %d unreachable in %.3f s",
            " (thawed)" if thaw else "",
            found,
            self._last_duration,
        )
        return True


_SCHEDULE = CollectorSchedule()


def collector_schedule() -> CollectorSchedule:
    """This process's schedule (full collections are process-wide, so there is one)."""
    return _SCHEDULE


class ServerCollector:
    """One server's share of its process's collector (or the trainer's, for its snapshot
    coordinator): the :class:`CollectorHold` that keeps it paused while a checkpoint holds
    the server (from the seam's hold to its release: :mod:`rollpoint.tuning.collector_listener`
    keeps one per fence and one for the coordinator), and, from
    :meth:`start` to :meth:`aclose`, a place on the schedule: attached, a due collection
    whenever the hold is given back (a checkpoint just ended), and a task that looks every
    :data:`CHECK_EVERY_S`, while nothing is held, for an overdue one, and, when no
    checkpoint has ended for :data:`QUIET_S`, for a heap that has :meth:`~CollectorSchedule.grown`.

    ``idle`` is for a server that takes no part in checkpoints but holds many calls at once
    (the scripted policy engine): the task then runs a *due* collection whenever ``idle()``
    and none at all otherwise, so under load that never lets up none runs. Fit only for a
    heap that makes next to no cyclic garbage (the scripted policy's: every full collection
    logged at 10k calls in flight found 0 objects, and took 1.1-2.8 s).

    Not started at construction: an app factory may build a fence inside another event
    loop than the one that serves it (the listener starts it at the seam's ``in_use``). Attached only while the task lives (its end detaches,
    also when its loop shuts down without :meth:`aclose`), so automatic full collections
    are never off without something to run them instead.
    """

    def __init__(
        self,
        schedule: CollectorSchedule | None = None,
        *,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self._schedule = collector_schedule() if schedule is None else schedule
        self._idle = idle
        self._hold = CollectorHold(on_release=self._after_release)
        self._task: asyncio.Task[None] | None = None
        self._attached = False
        self._closed = False
        self._last_release = -float("inf")
        """When a checkpoint last ended here (the schedule's clock): none yet, long ago."""
        self._last_gap = 0.0
        """Between the last two checkpoints' ends (0 before the second)."""

    @property
    def held(self) -> bool:
        return self._hold.held

    @property
    def started(self) -> bool:
        """On the schedule: started, not closed (its task runs, automatic full collections
        are off)."""
        return self._attached

    def hold(self) -> None:
        self._hold.hold()

    def release_soon(self, delay_s: float) -> None:
        self._hold.release_soon(delay_s)

    def release(self) -> None:
        self._hold.release()

    def start(self) -> None:
        """Attach and start the overdue task (idempotent; a no-op outside a running event
        loop or once closed)."""
        if self._closed or self._task is not None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._schedule.attach()
        self._attached = True
        self._task = asyncio.create_task(self._check(), name="rollpoint-collector")
        self._task.add_done_callback(lambda _: self._leave())

    async def aclose(self) -> None:
        """Stop the task and detach (so shutdown runs no full collection here), then give
        the hold back. A closed collector never starts again."""
        self._closed = True
        await stop_task(self._task)
        self._task = None
        self._leave()
        self._hold.release()

    def _leave(self) -> None:
        if self._attached:
            self._attached = False
            self._schedule.detach()

    async def _check(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if self._hold.held:
                continue
            if self._idle is None:
                if not self._schedule.collect_if_overdue() and self._quiet():
                    self._schedule.collect_if_grown()
            elif self._idle():
                self._schedule.collect_if_due()

    def _quiet(self) -> bool:
        return self._schedule.now() - self._last_release >= max(QUIET_S, 2 * self._last_gap)

    def _after_release(self) -> None:
        # The hold was just given back: the next checkpoint is as far away as it will be.
        now = self._schedule.now()
        if self._last_release > -float("inf"):
            self._last_gap = now - self._last_release
        self._last_release = now
        if self._attached:
            self._schedule.collect_if_due()
