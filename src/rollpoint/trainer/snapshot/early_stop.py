"""Stopping a run from inside, with one last snapshot: too many failed groups, a stuck peer.

Owns :func:`stop_snapshot`: seal the dispatch barrier (no row is sent again), take one
final snapshot within a budget, and say in a few words what holds the run now (the new
snapshot, or the one before it when the final one failed or ran out of time). The caller
raises its own typed error with that line; the servers stop on the way out, as for any
error. A signal's stop is :mod:`rollpoint.preemption`'s, which does the same for SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging

from rollpoint.protocol.errors import RollpointError
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator

log = logging.getLogger(__name__)


async def stop_snapshot(
    coordinator: SnapshotCoordinator | None,
    barrier: DispatchBarrier,
    *,
    budget_s: float,
    previous: str | None,
) -> str:
    """Seal, save once (``final``: the participants stay held until it is published), and
    return ``snapshot X holds the run`` or why none new does and which one still holds it.
    Calls still running are not waited for: the session is saved as before its call."""
    barrier.seal()
    if coordinator is None:
        return "this run takes no snapshots; the rerun starts it over"
    try:
        report = await asyncio.wait_for(coordinator.save(final=True), budget_s)
    except TimeoutError:
        why = f"the final snapshot did not finish within {budget_s:g}s"
    except RollpointError as exc:
        why = f"the final snapshot failed ({exc.message})"
    else:
        if report.published:
            return f"snapshot {report.snapshot_id} holds the run"
        why = f"the final snapshot failed ({report.blocked_by})"
    latest = coordinator.latest_published
    held_by = previous if latest is None else latest.snapshot_id
    holds = (
        f"snapshot {held_by} (taken before) holds the run"
        if held_by is not None
        else "no snapshot holds the run: the rerun starts it over"
    )
    return f"{why}; {holds}"
