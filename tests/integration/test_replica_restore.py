"""A replica killed mid-run comes back with its episodes: restored from the latest snapshot.

Real server processes (embedded runtime), SIGKILL of one replica's three servers, a
restart on new ports, as the runtime's supervisor does it. The episodes the latest
snapshot saved on that replica and still in flight continue on the restarted replica as
``attempt + 1`` from their saved turn; the rest start over; every row trains exactly once.

The last tests pin down the races on the trainer's own parts (no servers: nothing is
sent): a try the dispatcher gave up on first is not restored, and held tries start over
when the replica does not come back, or goes down again before its restore.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollpoint.envs import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import ReplicaEndpoints
from rollpoint.protocol.episode import RunReply
from rollpoint.protocol.manifest import SavedEpisode, SnapshotManifest
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import invariants
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.restore.replica_recovery import ReplicaRecovery
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.coordinator import SaveReport, SnapshotCoordinator
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import LedgerRecord, RolloutState
from rollpoint.trainer.trainer import Trainer
from tests.integration.test_replica_loss import LOST, assert_every_row_trained_once, job, kill
from tests.support.embedded_job import embedded_job
from tests.support.polling import eventually


def saved_and_running(trainer: Trainer) -> bool:
    """The latest snapshot saved a mid-conversation episode on LOST that still runs there."""
    assert trainer.coordinator is not None
    manifest = trainer.coordinator.latest_published
    if manifest is None:
        return False
    for episode in manifest.episodes:
        if episode.replica != LOST or episode.turns_completed < 1:
            continue
        record = trainer.ledger.get(episode.rollout_id)
        if (record.state, record.attempt, record.replica) == (
            RolloutState.DISPATCHED,
            episode.attempt,
            LOST,
        ):
            return True
    return False


@pytest.mark.process
async def test_a_killed_replica_continues_its_snapshot_episodes_once_restarted(
    tmp_path: Path,
) -> None:
    config = job(tmp_path, tasks=8, policy={"latency_ms": 50, "error_rate": 0.0})
    # The test restarts the replica itself; on a loaded 2-core machine that can take longer
    # than the snapshot deadline the wait defaults to.
    async with embedded_job(config, replica_restart_wait_s=60) as h:
        trainer = h.trainer
        assert trainer.coordinator is not None and trainer.recovery is not None
        run = asyncio.create_task(trainer.run())
        await eventually(
            lambda: saved_and_running(trainer),
            f"a snapshot saved a mid-conversation episode still running on {LOST}",
            within_s=10.0,
        )
        await kill(h, LOST)
        held = trainer.recovery.held[LOST]
        manifest = h.store.load(held.snapshot_id)
        turns = {e.rollout_id: e.turns_completed for e in manifest.episodes}
        # Held, not re-sent: queued at their next attempt, pinned to the lost replica.
        for rollout_id, attempt in held.attempts.items():
            record = trainer.ledger.get(rollout_id)
            assert (record.state, record.attempt, record.replica) == (
                RolloutState.QUEUED,
                attempt,
                LOST,
            )
        # More snapshots than retention keeps publish before the replica is back: the
        # held one is pinned (before, the restore found it pruned and started over).
        published = [await trainer.coordinator.save() for _ in range(config.snapshot.keep + 1)]
        assert all(r.published for r in published), [r.blocked_by for r in published]
        assert h.store.load(held.snapshot_id) == manifest
        endpoints = await h.runtime.restart_replica(LOST)
        await trainer.replica_up(endpoints)
        assert LOST not in trainer.recovery.held
        sample = h.metrics.registry.get_sample_value
        assert sample("rollpoint_restores_total", {"kind": "replica"}) == 1
        assert sample("rollpoint_restored_episodes_total", {"outcome": "continued"}) >= 1
        assert held.snapshot_id not in h.store.pinned  # released once restored
        summary = await asyncio.wait_for(run, 30)

    assert not summary.failed_groups
    assert_every_row_trained_once(h)
    rows = {r["rollout_id"]: r for r in h.train_rows()}
    continued = [rid for rid in held.attempts if rid in turns and turns[rid] >= 1]
    assert continued
    for rollout_id in continued:
        row = rows[rollout_id]
        saved_attempt = held.attempts[rollout_id] - 1
        # Trained as the next attempt, the turns before the cut answered by the saved one:
        # breaks if the restarted replica started the episode over from its prompt.
        assert row["attempt"] == saved_attempt + 1
        early = [c["attempt"] for c in row["model_calls"] if c["turn"] < turns[rollout_id]]
        assert early and set(early) == {saved_attempt}, row["model_calls"]
    rollouts, unreadable = invariants.read_train_data(config.workdir)
    found = [*unreadable, *invariants.check_no_regenerated_turns(rollouts)]
    assert found == [], invariants.report(found)


# --- who wins a race for a lost replica's tries (the trainer's parts, no servers needed) ---


def saved(record: LedgerRecord, turns: int = 2) -> SavedEpisode:
    return SavedEpisode(
        rollout_id=record.rollout_id,
        attempt=record.attempt,
        replica=record.replica or "",
        group_id=record.group_id,
        row=record.row,
        turns_completed=turns,
    )


@asynccontextmanager
async def parts(tmp_path: Path, wait_s: float) -> AsyncIterator[Parts]:
    """A ledger with a group of three rows in flight on LOST, the latest snapshot saving
    rows 0 and 1 there, and the recovery, dispatcher and coordinator a trainer wires."""
    ledger = RecoveryLedger()
    (task,) = get_environment("workplace").make_tasks(1, 0)
    records = [ledger.dispatch(r.rollout_id, LOST) for r in ledger.add_group(task, "g", 3)]
    names = ("replica-0", LOST)
    roster = ReplicaRoster(
        ReplicaEndpoints(name=n, model_url=URL, agent_url=URL, resources_url=URL) for n in names
    )
    barrier = DispatchBarrier()
    coordinator = SnapshotCoordinator(
        roster,
        store=SnapshotStore(str(tmp_path / "snapshots")),
        ledger=ledger,
        finished_queue=FinishedQueue(),
        barrier=barrier,
        config=SaveSettings(),
        metrics=TrainerMetrics(),
        trainer_state=dict,
        config_fingerprint={},
    )
    manifest = SnapshotManifest(
        snapshot_id="snap-1",
        checkpoint_id="snap-1",
        created_at=0.0,
        train_step=0,
        policy_version=0,
        pause_seconds=0.0,
        topology_fingerprint="0" * 64,
        participants=[],
        episodes=[saved(records[0]), saved(records[1])],
        restarts=[],
        finished=[],
        files={},
        config_fingerprint={},
    )
    coordinator.remember(SaveReport("snap-1", published=True, manifest=manifest))
    recovery = ReplicaRecovery(ledger, roster, coordinator, wait_s=wait_s, restore_deadline_s=1)

    async def on_reply(reply: RunReply) -> None:
        raise AssertionError(f"nothing is sent in these tests: {reply.episode}")

    async with HttpClient() as client:
        dispatcher = Dispatcher(
            ledger,
            roster.deployment(),
            client,
            concurrency=8,
            max_turns=4,
            row_timeout_s=30,
            barrier=barrier,
            on_reply=on_reply,
            roster=roster,
        )
        yield Parts(ledger, roster, recovery, dispatcher, records)


@dataclass
class Parts:
    ledger: RecoveryLedger
    roster: ReplicaRoster
    recovery: ReplicaRecovery
    dispatcher: Dispatcher
    records: list[LedgerRecord]

    def lose(self) -> None:
        self.roster.mark_down(LOST)
        self.recovery.hold(LOST, self.dispatcher)


URL = "http://127.0.0.1:9"


async def test_a_try_given_up_before_the_replica_was_reported_down_is_not_restored(
    tmp_path: Path,
) -> None:
    async with parts(tmp_path, wait_s=30) as p:
        row0, row1, row2 = p.records
        # The dispatcher gave row 1 up first (its stream broke): it is re-sent fresh.
        fresh = p.ledger.abandon(row1.rollout_id)
        p.lose()
        held = p.recovery.held[LOST].attempts
        # Only row 0 is held; row 2 (not in the snapshot) started over; row 1's fresh try
        # is left alone, so no rollout of row 1 can run twice.
        assert held == {row0.rollout_id: 1}
        assert p.ledger.current("g", 1) == fresh
        assert p.ledger.get(row2.rollout_id).state is RolloutState.ABANDONED
        assert p.ledger.current("g", 2).tries == 2
        # The replica goes down again before its restore: the held try starts over, and
        # the restore that follows finds nothing to continue.
        p.roster.mark_up(p.roster.endpoints(LOST))
        p.roster.mark_down(LOST)
        p.dispatcher.replica_lost(LOST)
        assert await p.recovery.restore(LOST, p.dispatcher) == 0
        assert p.ledger.get(row0.rollout_id).state is RolloutState.ABANDONED
        assert p.ledger.current("g", 0).attempt == 0


async def test_held_tries_start_over_when_the_replica_does_not_come_back(tmp_path: Path) -> None:
    async with parts(tmp_path, wait_s=0.05) as p:
        p.lose()
        assert set(p.recovery.held[LOST].attempts) == {
            p.records[0].rollout_id,
            p.records[1].rollout_id,
        }
        await eventually(lambda: LOST not in p.recovery.held, f"{LOST}'s tries let go", within_s=2)
        for row in (0, 1):
            current = p.ledger.current("g", row)
            assert (current.state, current.attempt, current.tries) == (RolloutState.QUEUED, 0, 2)
        # Too late: the replica is back but nothing waits for it any more.
        assert await p.recovery.restore(LOST, p.dispatcher) == 0
