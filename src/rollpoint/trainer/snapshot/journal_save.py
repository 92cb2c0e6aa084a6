"""The pause-free save: a snapshot taken without closing anything, from the journals.

Owns the save ``snapshot.mode: journal`` asks for (docs/design.md "Pause-free snapshots")
up to the trainer's capture: no barrier, no prepare, no admission closed anywhere. Each
participant is sent ``checkpoint`` at once; in one step on its loop it takes its journal
position and writes a state holding no episode, whose manifest's mark is the *floor* the
coordinator chose (:mod:`rollpoint.trainer.snapshot.journal_floors`: a position from before
the first record of every try in flight, so retention keeps all a restore may read). Once
every participant replied, the trainer captures the ledger, the finished queue and its
counters in one instant (its own position, after every participant's), and every try then
in flight is listed as ``journaled``; the trainer's files are then written and the manifest
published as after a cut (:mod:`rollpoint.trainer.snapshot.publication`).

Why the trainer goes last: a try sealed before its capture is in the saved ledger and
finished queue (trained once, from there; its servers' journals are never read for it); a
try in flight at its capture (even one whose reply was on the wire, or sealed a moment
after) is sent again under its own id and attempt, and its agent's journal holds every turn
and the finished reply, so it is continued or only verified again, never sampled again; a
try dispatched after a participant's position but before the capture is in flight and all
its records are after the floor. No order of a seal and a participant's checkpoint can lose
a row or train it twice, because no participant's saved state says anything about any try:
only the ledger does (I1, I2); calls made again are answered by key from the journals,
effects from their records (I3, I4 as for a crash with the journal).

It does not choose between this save and the cut (periodic saves only, and only when every
participant journals: :class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator`
does), nor count its failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollpoint.protocol.control import Verb
from rollpoint.protocol.errors import RollpointError, SnapshotError
from rollpoint.protocol.manifest import JournalMark
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.snapshot.control_calls import blocker, by_deadline
from rollpoint.trainer.snapshot.cut import Blocker, Cut, SavePhase, SaveReport
from rollpoint.trainer.snapshot.journal_floors import JournalFloors
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger

__all__ = ["JournalSave"]


class JournalSave:
    """The checkpoints and the trainer's capture of one coordinator's pause-free saves."""

    def __init__(
        self,
        *,
        store: SnapshotStore,
        ledger: RecoveryLedger,
        finished_queue: FinishedQueue,
        trainer_state: Callable[[], dict[str, Any]],
        floors: JournalFloors,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._finished_queue = finished_queue
        self._trainer_state = trainer_state
        self._floors = floors

    async def capture(
        self,
        snapshot_id: str,
        clients: list[ParticipantClient],
        report: SaveReport,
        *,
        deadline_s: float,
        before_capture: Callable[[], Awaitable[None]],
    ) -> Cut | None:
        """``checkpoint`` on every participant, then the trainer's capture: the cut to write
        and publish, or None with ``report``'s blockers set (its staging aborted).
        ``before_capture`` is awaited once every participant replied."""
        started_at = time.time()
        floors = self._floors.floors(self._ledger.live_records())
        report.phase = SavePhase.COMMIT
        try:
            staging = await asyncio.to_thread(self._store.begin, snapshot_id)
        except (RollpointError, OSError) as exc:
            report.blockers = [blocker(None, report.phase, exc)]
            return None
        t1 = time.monotonic()
        deadline = time.time() + deadline_s
        replies = await by_deadline(
            [
                c.checkpoint(
                    snapshot_id, deadline, staging.participants_relative_dir, floors.get(c.label)
                )
                for c in clients
            ],
            deadline,
        )
        failed = [
            blocker(c.label, Verb.CHECKPOINT, r)
            for c, r in zip(clients, replies, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            report.blockers = failed
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self._store.abort, staging)
            return None
        positions: dict[str, JournalMark] = {}
        for c, r in zip(clients, replies, strict=True):
            assert not isinstance(r, BaseException)
            positions[c.label] = r.position
        self._floors.reported(positions)
        await before_capture()
        cut = Cut(
            staging=staging,
            checkpoint_id=snapshot_id,
            created_at=started_at,
            participants=clients,
            journal_mode=True,
        )
        # The trainer's position, after every participant's: see the module docstring.
        replicas = {c.address.replica for c in clients}
        elsewhere = [r.describe() for r in self._ledger.in_flight() if r.replica not in replicas]
        if elsewhere:
            message = (
                "episodes in flight on replicas taking no part in the snapshot: "
                f"{', '.join(elsewhere[:10])}"
            )
            report.blockers = [Blocker(None, Verb.CHECKPOINT, SnapshotError.code, True, message)]
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self._store.abort, staging)
            return None
        cut.in_flight = {replica: self._ledger.in_flight(replica) for replica in sorted(replicas)}
        self._floors.observe(self._ledger.live_records())
        cut.ledger = self._ledger.capture()
        cut.finished_queue = self._finished_queue.capture()
        cut.trainer_doc = self._trainer_state()
        report.commit_s = time.monotonic() - t1
        return cut
