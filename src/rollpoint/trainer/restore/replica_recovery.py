"""Replica recovery: a replica that dies mid-run gets its episodes back from the latest snapshot.

Owns what happens to a lost replica's tries between the runtime's "down" and "up" reports
(docs/design.md#a-replica-lost-mid-run: the restore's ledger moves applied to one replica,
while the others keep running):

- **down** (:meth:`ReplicaRecovery.hold`): the tries the latest published snapshot saved on
  that replica and that are still in flight at the same attempt are *held*: they continue
  as ``attempt + 1`` pinned to the replica (finished replies it held are fetched again under
  their own identity), and the dispatcher is told to leave them alone. Every other try of
  the replica (started after the snapshot, or with no snapshot at all) starts over fresh
  elsewhere, as before.
- **up** (:meth:`ReplicaRecovery.restore`): with saves held off (the coordinator's lock),
  the snapshot's records of that replica are installed into its restarted servers, then
  the held tries are re-sent to it. A failed restore re-sends them fresh instead.
- a replica not back within ``wait_s`` has its held tries re-sent fresh.

With the servers journaling (``journaled``), *every* try in flight on the lost replica is
held, not only the snapshot's: a try started after the latest snapshot (or with none)
continues as ``attempt + 1`` pinned to the replica, whose restarted servers find its
turns, policy calls and tool calls in their journals (the agent resumes it at its last
journaled turn, the resources server replays its tool calls): docs/journal.md.

Races, and who wins: the ledger is the arbiter, and the first to move a try wins. A try
the dispatcher gave up on before the replica was reported down is no longer in flight, so
it is not held; a held try is no longer dispatched, so a give-up still running for it
backs off; every step here only acts on a try that is still queued at the held attempt.
A snapshot published while tries are held records them as queued, not in flight: their
state is in the older snapshot only, and a crash-restore from the newer one starts them
over (:class:`~rollpoint.trainer.restore.restorer.Restorer` never continues a queued try).

It does not watch processes (the runtime does) nor send anything (the dispatcher does).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldTries:
    """What a lost replica's restart will continue: for display and tests."""

    snapshot_id: str
    attempts: dict[str, int]
    """rollout_id → the attempt it continues as (or, for a finished reply, is fetched as)."""


@dataclass
class _Held:
    """A lost replica's tries waiting for it to come back."""

    manifest: SnapshotManifest | None
    """The latest snapshot (None: none yet, only journaled tries are held)."""
    attempts: dict[str, int]
    """rollout_id → the attempt it waits at (saved attempt + 1, or the same to adopt)."""
    continued: set[str]
    """The rollouts that continue a saved session (the others fetch a finished reply)."""
    timer: asyncio.TimerHandle | None = None


class ReplicaRecovery:
    """Holds a lost replica's snapshot tries and restores them when it is back."""

    def __init__(
        self,
        ledger: RecoveryLedger,
        roster: ReplicaRoster,
        coordinator: SnapshotCoordinator,
        *,
        wait_s: float,
        restore_deadline_s: float,
        journaled: bool = False,
    ) -> None:
        self._ledger = ledger
        self._roster = roster
        self._coordinator = coordinator
        self._wait_s = wait_s
        self._deadline_s = restore_deadline_s
        self._journaled = journaled
        self._held: dict[str, _Held] = {}

    @property
    def held(self) -> dict[str, HeldTries]:
        """Per lost replica, the tries waiting for it."""
        return {
            name: HeldTries("" if h.manifest is None else h.manifest.snapshot_id, dict(h.attempts))
            for name, h in self._held.items()
        }

    def hold(self, name: str, dispatcher: Dispatcher) -> None:
        """``name`` is down (marked in the roster): keep its snapshot tries for its
        restart, and have the dispatcher send the rest fresh. No await: nothing moves the
        ledger in between."""
        self._release(name, dispatcher, f"{name} went down again before its restore")
        manifest = self._coordinator.latest_published
        saved = {}
        if manifest is not None:
            for group in (manifest.episodes, manifest.finished):
                saved.update({e.rollout_id: e.attempt for e in group if e.replica == name})
        in_flight = self._ledger.in_flight(name)
        keep = [r for r in in_flight if saved.get(r.rollout_id) == r.attempt]
        if self._journaled:
            keep = list(in_flight)
        dispatcher.replica_lost(name, keep={r.rollout_id for r in keep})
        if not keep:
            return
        continuing = set()
        if manifest is not None:
            continuing = {e.rollout_id for e in manifest.episodes if e.replica == name}
            # Snapshots go on publishing while the replica restarts: retention must not
            # prune the one its tries come back from (seen with a snapshot every 2 s, keep 3).
            self._coordinator.store.pin(manifest.snapshot_id)
        held = _Held(manifest, {}, set())
        for record in keep:
            from_snapshot = saved.get(record.rollout_id) == record.attempt
            if record.rollout_id in continuing and from_snapshot:
                moved = self._ledger.continue_attempt(record.rollout_id)
                held.continued.add(record.rollout_id)
            elif from_snapshot:
                moved = self._ledger.requeue(record.rollout_id, keep_replica=True)
            else:  # journaled only: the restarted servers' journals hold its work
                moved = self._ledger.continue_attempt(record.rollout_id)
            held.attempts[moved.rollout_id] = moved.attempt
        held.timer = asyncio.get_running_loop().call_later(
            self._wait_s,
            self._release,
            name,
            dispatcher,
            f"{name} did not come back within {self._wait_s:g}s",
        )
        self._held[name] = held
        log.warning(
            "%s is down: %d of its tries wait to be restored from snapshot %s%s",
            name,
            len(held.attempts),
            "(none)" if manifest is None else manifest.snapshot_id,
            " and its servers' journals" if self._journaled else "",
        )

    async def restore(self, name: str, dispatcher: Dispatcher) -> int:
        """``name`` is up again (marked in the roster): install its snapshot state, then
        re-send its held tries. Returns how many were re-sent to continue there."""
        held = self._held.pop(name, None)
        if held is None:
            return 0
        if held.timer is not None:
            held.timer.cancel()
        try:
            return await self._restore(name, held, dispatcher)
        finally:
            if held.manifest is not None:
                self._coordinator.store.unpin(held.manifest.snapshot_id)

    async def _restore(self, name: str, held: _Held, dispatcher: Dispatcher) -> int:
        async with self._coordinator.holding_saves():
            still = self._still_held(name, held)
            if not still:
                return 0
            episodes = [
                EpisodeId(rollout_id=rid, attempt=still[rid] - 1)
                for rid in sorted(still)
                if rid in held.continued
            ]
            try:
                lost: set[str] = set()
                if held.manifest is not None:
                    lost = await Restorer(self._roster.participants(name)).restore_replica(
                        held.manifest, name, episodes, deadline_s=self._deadline_s
                    )
            except RollpointError as exc:
                log.warning("restoring %s failed (%s): its tries start over", name, exc.message)
                dispatcher.give_up(still, f"restoring {name} failed: {exc.message}")
                return 0
            gone = sorted(r for r in still if r in lost)
            if gone:
                # An external environment's state did not survive: never continued on it.
                dispatcher.give_up(gone, f"the external state of {name} did not survive")
                still = {r: a for r, a in still.items() if r not in lost}
        log.info(
            "%s restored from snapshot %s: %d tries continue there",
            name,
            "(none)" if held.manifest is None else held.manifest.snapshot_id,
            len(still),
        )
        dispatcher.resend(sorted(still))
        return len(still)

    def _release(self, name: str, dispatcher: Dispatcher, reason: str) -> None:
        """Send the tries still held for ``name`` fresh elsewhere."""
        held = self._held.pop(name, None)
        if held is None:
            return
        if held.timer is not None:
            held.timer.cancel()
        if held.manifest is not None:
            self._coordinator.store.unpin(held.manifest.snapshot_id)
        still = self._still_held(name, held)
        if still:
            log.warning("%s: %d held tries start over", reason, len(still))
            dispatcher.give_up(sorted(still), reason)

    def _still_held(self, name: str, held: _Held) -> dict[str, int]:
        """The held tries nothing else moved: still queued, at the held attempt, pinned."""
        still = {}
        for rollout_id, attempt in held.attempts.items():
            record = self._ledger.get(rollout_id)
            if (record.state, record.attempt, record.replica) == (
                RolloutState.QUEUED,
                attempt,
                name,
            ):
                still[rollout_id] = attempt
        return still
