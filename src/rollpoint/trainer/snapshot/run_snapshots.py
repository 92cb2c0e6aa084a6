"""The snapshots a run takes by itself, around and between its train steps.

Owns :func:`first_snapshot` (one published before the first row is sent),
:func:`snapshot_loop` (one every ``snapshot.every_seconds``) and :func:`last_snapshot` (a
published one after the last step). The trainer loop starts them; the snapshots that go
with each train checkpoint are the trainer's, and a stop's final one is
:mod:`.early_stop`'s.
"""

from __future__ import annotations

import asyncio

from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator

SNAPSHOT_RETRY_S = 0.2
"""The wait between tries of the snapshot a run takes before its first row, and of the one
it takes after its last step when the step's own snapshot failed."""


async def first_snapshot(coordinator: SnapshotCoordinator) -> None:
    """Save until one snapshot is published, before anything is trained. A save that
    failed (a store full for a moment) is tried again: training on without one left,
    after a crash, train data no snapshot composes with, which the rerun refuses (chaos:
    a snapshot disk full as the run began, then a kill, stranded every row). Failures
    in a row past ``retry_after_seconds`` stop the run, as for any save."""
    while True:
        if (await coordinator.save()).published:
            return
        await asyncio.sleep(SNAPSHOT_RETRY_S)


async def last_snapshot(coordinator: SnapshotCoordinator) -> None:
    """Save until the run's last save is a published one, after its last step. The
    snapshot that went with the last train checkpoint may have failed (a server
    stopped for a moment as the run ended): the run would end with its newest
    snapshot older than what it trained, and a rerun would go back to it and redo those
    steps (chaos run, trials 85 and 473). Failures in a row past
    ``retry_after_seconds`` stop the run, as for any save."""
    while not (coordinator.history and coordinator.history[-1].published):
        if (await coordinator.save()).published:
            return
        await asyncio.sleep(SNAPSHOT_RETRY_S)


async def snapshot_loop(coordinator: SnapshotCoordinator, every: float | None) -> None:
    """A snapshot every ``every`` seconds (None: only at train checkpoints); runs until
    cancelled."""
    if every is None:
        await asyncio.Event().wait()  # snapshots only at train checkpoints
    assert every is not None
    while True:
        await asyncio.sleep(every)
        await coordinator.save()
