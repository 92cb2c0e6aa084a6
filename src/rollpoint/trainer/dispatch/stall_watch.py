"""The stall watchdog: a run whose rows stop returning results fails instead of hanging.

Owns :func:`watch_stall`: once no row result has arrived for ``timeout_s`` while rows wait
to be sent or run, it raises :class:`~rollpoint.protocol.errors.RunStalledError` with
:func:`stall_message` (the rows in flight, the replicas down). Time paused by a snapshot is
not counted (the dispatch barrier's pause clock), nor time the dispatcher is idle (the feed
holding groups back is not a stall). The trainer loop runs it alongside the run.
"""

from __future__ import annotations

import asyncio

from rollpoint.protocol.errors import RunStalledError
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.state.ledger import RecoveryLedger

STALL_REPORT_ROWS = 10


async def watch_stall(
    dispatcher: Dispatcher,
    barrier: DispatchBarrier,
    ledger: RecoveryLedger,
    roster: ReplicaRoster,
    timeout_s: float,
) -> None:
    """Raise :class:`RunStalledError` once no row result arrived for ``timeout_s`` of the
    pause clock while the dispatcher was not idle; runs until then, or until cancelled."""
    tick = min(1.0, timeout_s / 10)
    pulse = dispatcher.results_total
    last_progress = barrier.pause_clock()
    while True:
        await asyncio.sleep(tick)
        now = barrier.pause_clock()
        # Rows waiting with none in flight are stuck (no replica up) unless the barrier
        # holds them, and then the pause clock stands still.
        if dispatcher.results_total != pulse or dispatcher.idle:
            pulse = dispatcher.results_total
            last_progress = now
        elif now - last_progress >= timeout_s:
            raise RunStalledError(stall_message(ledger, roster, now - last_progress))


def stall_message(ledger: RecoveryLedger, roster: ReplicaRoster, quiet_s: float) -> str:
    """The stall's one line: the rows in flight (the first :data:`STALL_REPORT_ROWS`) and
    the replicas down."""
    rows = ledger.in_flight()
    shown = ", ".join(r.describe() for r in rows[:STALL_REPORT_ROWS])
    more = f" and {len(rows) - STALL_REPORT_ROWS} more" if len(rows) > STALL_REPORT_ROWS else ""
    down = roster.down
    replicas = (
        f"; replicas down: {', '.join(down)}" + ("" if roster.any_up else " (none up)")
        if down
        else ""
    )
    return (
        f"no row result for {quiet_s:.0f}s (snapshot pauses not counted); "
        f"{len(rows)} rows in flight: {shown}{more}{replicas}"
    )
