"""Preemption: a stop asked from outside the run, answered with one last snapshot.

Owns what SIGTERM and SIGINT mean to ``rollpoint run`` (a scheduler's notice, Ctrl-C). The
first signal seals the dispatch barrier (no row is sent again), takes one final snapshot
within ``preemption.grace_seconds`` of the signal, and ends the run with a
:class:`RunPreemptedError` whose message names the snapshot that holds the run (the new
one, or the previous one when the final snapshot failed or ran out of time); the caller
stops the servers on its way out. A second signal, or a first one before the trainer runs
(nothing to snapshot yet), cancels the run at once.

The final snapshot holds every participant after its cut until it is published (see
``SnapshotCoordinator.save(final=True)``), so no policy call starts after the cut: a rerun
re-does at most the calls that were in flight when the signal came.

It installs signal handlers only when asked (:meth:`StopRequest.on_signals`, which the CLI
and a trainer of its own call from their main task), and does not stop the servers
(``run_job``'s cleanup does).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from rollpoint.protocol.errors import RollpointError, RunPreemptedError

if TYPE_CHECKING:  # the CLI imports this module for StopRequest: keep it light
    from rollpoint.trainer.trainer import RunSummary, Trainer

log = logging.getLogger(__name__)

EXIT_CODES: dict[int, int] = {signal.SIGTERM: 143, signal.SIGINT: 130}
"""The shell's convention: 128 + the signal's number."""

STOP_RESERVE_S = 5.0
PUBLICATION_WAIT_S = 10.0
"""At most this long for a publication already writing when the stop's line is made."""
"""Of the grace, kept for stopping the servers after the final snapshot (at most a third)."""


def cancelled_line(stop: StopRequest) -> str:
    """The one line of a run a signal cancelled outright: the final snapshot's line when it
    was over before the cancel (a second signal while the servers stop), else what holds
    the run without one."""
    if stop.outcome is not None:
        return stop.outcome
    why = "a second signal" if stop.received > 1 else "before the trainer ran"
    return (
        f"stopped at once by {signal_name(stop.signum or signal.SIGTERM)} ({why}; "
        "no final snapshot): the latest published snapshot holds the run"
    )


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The signals one run received, and what each asks of it.

    ``cancel`` stops the run at once (the CLI passes its main task's ``cancel``)."""

    def __init__(self, cancel: Callable[[], object]) -> None:
        self._cancel = cancel
        self.signum: int | None = None
        """The first signal received (None: none yet)."""
        self.received_at = 0.0
        """``time.monotonic()`` when the first signal came."""
        self.asked = asyncio.Event()
        self._armed = False
        self.cancelled = False
        """True once a signal cancelled the run outright (second signal, or too early)."""
        self.received = 0
        """How many signals came."""
        self.outcome: str | None = None
        """The stop's one line once the final snapshot is over (what holds the run): a
        second signal that cancels the way out after it must say that line, not "no final
        snapshot"."""

    @classmethod
    def on_signals(cls, signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> StopRequest:
        """A stop request for the running task, which the event loop calls on each of
        ``signums`` (the main thread's loop only: Python delivers signals there). A signal
        that cancels outright cancels this task."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("StopRequest.on_signals() is called from a running task")
        stop = cls(cancel=task.cancel)
        loop = asyncio.get_running_loop()
        for signum in signums:
            loop.add_signal_handler(signum, stop.signal, signum)
        return stop

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum or signal.SIGTERM, 143)

    def arm(self) -> None:
        """From now on the first signal asks for a final snapshot instead of a cancel."""
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def signal(self, signum: int) -> None:
        """Called from the event loop's signal handler."""
        first = self.signum is None
        self.received += 1
        if first:
            self.signum = signum
            self.received_at = time.monotonic()
            self.asked.set()
        if first and self._armed:
            log.warning("%s received: taking a final snapshot, then stopping", signal_name(signum))
            return
        if not first:
            log.warning("%s received again: stopping at once", signal_name(signum))
        self.cancelled = True
        self._cancel()


async def drive_until_stopped(
    job: Awaitable[RunSummary],
    trainer: Trainer,
    stop: StopRequest,
    *,
    grace_s: float,
    previous: str | None,
) -> RunSummary:
    """Run ``job`` (the trainer driven to the end); on a stop request, take the final
    snapshot and raise :class:`RunPreemptedError`. ``previous`` is the snapshot that held
    the run before this process published any (the one it resumed from)."""
    task = asyncio.ensure_future(job)
    asked = asyncio.create_task(stop.asked.wait())
    stop.arm()
    try:
        await asyncio.wait({task, asked}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        message, taken = await final_snapshot(trainer, stop, grace_s=grace_s, previous=previous)
    finally:
        stop.disarm()
        for t in (task, asked):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, asked, return_exceptions=True)
    # The stop's one line is the error's message (the CLI prints it): the log keeps it at
    # info, so the console's warning handler does not say it a second time.
    log.info("%s", message)
    stop.outcome = message
    # For `rollpoint report`'s timeline: the signal, and the snapshot taken on the way out.
    trainer.events.preemption(
        signal_name(stop.signum or signal.SIGTERM), snapshot_id=taken, detail=message
    )
    raise RunPreemptedError(message, stop.exit_code)


async def final_snapshot(
    trainer: Trainer, stop: StopRequest, *, grace_s: float, previous: str | None
) -> tuple[str, str | None]:
    """Seal the barrier and take the final snapshot: the line that says what holds the run,
    and the id of the snapshot published on the way out (None when none was)."""
    trainer.barrier.seal()
    name = signal_name(stop.signum or signal.SIGTERM)
    coordinator = trainer.coordinator
    in_flight = trainer.ledger.in_flight_count()
    reserve = min(STOP_RESERVE_S, grace_s / 3)
    budget = grace_s - reserve - (time.monotonic() - stop.received_at)

    async def kept(why: str) -> str:
        if coordinator is None:
            latest = None
        else:
            # A periodic save the signal caught while its thread wrote the publication:
            # that thread finishes it regardless (the process waits for it at exit), so
            # the line names what it publishes, not the snapshot before it.
            await coordinator.publication_settled(PUBLICATION_WAIT_S)
            latest = coordinator.latest_published
        held_by = previous if latest is None else latest.snapshot_id
        holds = (
            f"snapshot {held_by} (taken before the signal) holds the run"
            if held_by is not None
            else "no snapshot holds the run: the rerun starts it over"
        )
        return f"stopped by {name}: {why}; {holds}"

    if coordinator is None:
        return await kept("this run takes no snapshots"), None
    started = time.monotonic()
    try:
        # Half the budget at most for the calls already running to finish: what is left
        # covers the cut and its writes.
        save = coordinator.save(final=True, drain_s=max(0.0, budget) / 2)
        report = await asyncio.wait_for(save, max(0.0, budget))
    except TimeoutError:
        return await kept(f"the final snapshot did not finish within the {grace_s:g}s grace"), None
    except RollpointError as exc:
        return await kept(f"the final snapshot failed ({exc.message})"), None
    if not report.published:
        return await kept(f"the final snapshot failed ({report.blocked_by})"), None
    return (
        f"stopped by {name}: snapshot {report.snapshot_id} holds the run "
        f"({saved_line(in_flight, report.saved, report.restarts, report.mid_call)}; "
        f"taken in {time.monotonic() - started:.1f}s); run the same command to resume"
    ), report.snapshot_id


def saved_line(in_flight: int, saved: int, restarts: int, mid_call: int = 0) -> str:
    """What became of the episodes in flight at the signal: every one is accounted for.
    Those saved mid-episode are split into those at a turn boundary (parked between two
    turns) and those waiting on a policy call (its reply is had again on resume). Those
    not saved nor restarting finished before the cut (their calls drained): their replies
    are in the snapshot's queue or held for adoption."""
    finished = max(0, in_flight - saved - restarts)
    mid_call = min(mid_call, saved)
    split = (
        f" ({saved - mid_call} at a turn boundary, {mid_call} waiting on a policy call)"
        if saved
        else ""
    )
    restart = f", {restarts} restart from their prompt" if restarts else ""
    return (
        f"of {in_flight} episodes in flight at the signal, {saved} saved mid-episode{split}, "
        f"{finished} finished before the cut{restart}; none lost"
    )
