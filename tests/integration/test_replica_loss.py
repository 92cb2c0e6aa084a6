"""A replica that dies while the trainer lives: real server processes, SIGKILL, and a restart.

The trainer is told a replica is down (as the runtime's supervisor tells it): the job goes
on on the replicas still up, every row is trained exactly once, snapshots keep committing
without the lost replica and name only the participants that committed. Told it is up
again at new URLs, the trainer sends it rows and includes it in the next snapshot; and a
snapshot taken while it was down still restores.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import RunConfig
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.episode import RunReply
from rollpoint.protocol.errors import RunStalledError
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.testing import LocalCluster
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE, WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import ResumePoint, read_trainer_document
from rollpoint.trainer.snapshot.publication import FINISHED_QUEUE_FILE, LEDGER_FILE, TRAINER_FILE
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from rollpoint.trainer.trainer import Trainer
from tests.support.embedded_job import EmbeddedJob, embedded_job, embedded_servers
from tests.support.job_config import job_config
from tests.support.polling import eventually

LOST = "replica-1"
WAIT_S = 10.0


def job(tmp_path: Path, **overrides: Any) -> RunConfig:
    return job_config(
        tmp_path,
        **{
            "tasks": 12,
            "concurrency": 6,
            "policy": {"latency_ms": 40, "error_rate": 0.0},
            "train": {"batch_size": 4, "checkpoint_every_steps": 1},
            "snapshot": {
                "every_seconds": 0.3,
                "keep": 100,
                "deadline_seconds": 5,
                "retry_after_seconds": 0,
            },
            **overrides,
        },
    )


async def kill(h: EmbeddedJob, replica: str) -> float:
    """SIGKILL the replica's three servers, then tell the trainer; returns the time."""
    children = [c for c in h.runtime.group.children if c.spec.name.endswith(replica)]
    assert sorted(c.spec.name for c in children) == [
        f"{kind}-{replica}" for kind in ("agent", "model", "resources")
    ]
    for child in children:
        child.process.kill()
    for child in children:
        await child.process.wait()
    down_at = time.time()
    await h.trainer.replica_down(replica)
    return down_at


def assert_every_row_trained_once(h: EmbeddedJob) -> None:
    keys = Counter((r["group_id"], r["row"]) for r in h.train_rows())
    groups = h.trainer.ledger.group_ids()
    assert set(keys) == {(gid, row) for gid in groups for row in range(h.config.group_size)}
    assert set(keys.values()) == {1}


def replicas_named(manifest: SnapshotManifest) -> set[str]:
    return {p.replica for p in manifest.participants}


@pytest.mark.process
async def test_a_replica_killed_mid_job_is_left_out_and_every_row_trains_once(
    tmp_path: Path,
) -> None:
    async with embedded_job(job(tmp_path)) as h:
        run = asyncio.create_task(h.trainer.run())
        await eventually(
            lambda: (
                h.trainer.ledger.in_flight_count(LOST) > 0 and len(h.store.list_snapshots()) > 0
            ),
            "rows in flight on the replica to lose, and a snapshot published",
            within_s=WAIT_S,
        )
        lost_tries = {r.rollout_id for r in h.trainer.ledger.in_flight(LOST)}
        down_at = await kill(h, LOST)
        # At once, nothing is in flight on the dead replica any more.
        assert h.trainer.ledger.in_flight_count(LOST) == 0
        summary = await asyncio.wait_for(run, 30)
        assert h.trainer.coordinator is not None
        history = h.trainer.coordinator.history

    assert not summary.failed_groups
    assert_every_row_trained_once(h)
    # Its tries were abandoned and their rows trained under new rollout ids elsewhere.
    trained = {r["rollout_id"] for r in h.train_rows()}
    assert lost_tries and not lost_tries & trained
    for rid in lost_tries:
        assert h.trainer.ledger.get(rid).state is RolloutState.RETIRED
    # Snapshots went on committing without it, naming only the replica that committed.
    after = h.published(down_at)
    assert after, "no snapshot was published after the replica was lost"
    assert all(replicas_named(m) == {"replica-0"} and len(m.participants) == 3 for m in after)
    # At most the save running when the servers died failed; none after.
    assert sum(not r.published for r in history) <= 1, [r.blocked_by for r in history]


@pytest.mark.process
async def test_a_replica_back_on_new_ports_is_used_again_and_a_cut_without_it_restores(
    tmp_path: Path,
) -> None:
    # A job longer than the test: it is stopped (as by a crash) once the checks are done.
    # No train checkpoints: every snapshot composes with step 0, so the cut taken while
    # the replica was down stays restorable however far the job has gone since.
    config = job(tmp_path, tasks=200, train={"batch_size": 4, "checkpoint_every_steps": None})
    async with embedded_job(config) as h:
        run = asyncio.create_task(h.trainer.run())
        await eventually(
            lambda: h.trainer.ledger.in_flight_count(LOST) > 0,
            "rows in flight on the replica to lose",
            within_s=WAIT_S,
        )
        down_at = await kill(h, LOST)
        await eventually(
            lambda: bool(h.published(down_at)),
            "a snapshot published with the replica down",
            within_s=WAIT_S,
        )
        endpoints = await h.runtime.restart_replica(LOST)
        up_at = time.time()
        await h.trainer.replica_up(endpoints)
        # The dispatcher sends to it again at its new URLs, and snapshots include it again.
        await eventually(
            lambda: h.trainer.ledger.in_flight_count(LOST) > 0,
            "rows in flight on the replica back up",
            within_s=WAIT_S,
        )
        await eventually(
            lambda: any(LOST in replicas_named(m) for m in h.published(up_at)),
            "a snapshot published naming the replica back up",
            within_s=WAIT_S,
        )
        # Its model server serves the rows' policy calls (they may still be on their way).
        stats = await h.http.get_json(f"{endpoints.model_url}/rollpoint/v1/stats")
        deadline = time.monotonic() + 10
        while stats["calls_total"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            stats = await h.http.get_json(f"{endpoints.model_url}/rollpoint/v1/stats")
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    assert stats["calls_total"] > 0
    assert stats["policy_version"] > 0  # told the current version when it came back
    back = [m for m in h.published(up_at) if LOST in replicas_named(m)]
    assert len(back[0].participants) == 6
    # A snapshot taken while it was down names only replica-0 ...
    cut = [m for m in h.published(down_at) if m.created_at < up_at][-1]
    assert replicas_named(cut) == {"replica-0"} and len(cut.participants) == 3
    # ... and a rerun after the crash restores it on fresh servers: the replica it does not
    # name is left alone, and nothing of the cut waits on it.
    point = resume_point(h, cut)
    copy = tmp_path / "copy"  # the restore cuts the train data back: on a copy of it
    copy.mkdir()
    shutil.copy(config.workdir / TRAIN_DATA_FILE, copy / TRAIN_DATA_FILE)
    async with embedded_servers(config) as rerun:
        restored = await Restorer(rerun.participants()).restore(
            point, step_record=WorkdirRecord(copy)
        )
    assert restored.snapshot_id == cut.snapshot_id
    assert len(restored.continued) == len(cut.episodes)
    assert all(r.replica != LOST for r in restored.ledger.in_flight())
    for episode in restored.continued:
        assert restored.ledger.get(episode.rollout_id).replica == "replica-0"


def resume_point(h: EmbeddedJob, manifest: SnapshotManifest) -> ResumePoint:
    sid = manifest.snapshot_id
    finished_queue_doc = read_trainer_document(h.store, sid, FINISHED_QUEUE_FILE)
    committed = int(finished_queue_doc.get("committed_step", 0))
    checkpoints = [
        c for c in h.trainer.step_record.available() if committed <= c.step <= manifest.train_step
    ]
    assert checkpoints, f"no train checkpoint composes with {sid}"
    return ResumePoint(
        manifest=h.store.verify(sid),
        checkpoint=checkpoints[0],
        ledger_doc=read_trainer_document(h.store, sid, LEDGER_FILE),
        finished_queue_doc=finished_queue_doc,
        trainer_doc=orjson.loads(h.store.read_file(sid, TRAINER_FILE)),
    )


# --- no replica up: the dispatcher waits (threads on loopback, no processes) -------------


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(replicas=2, latency_ms=2.0) as c:
        yield c


async def test_with_no_replica_up_rows_wait_unsent_until_one_comes_back(
    cluster: LocalCluster,
) -> None:
    ledger, barrier = RecoveryLedger(), DispatchBarrier()
    roster = ReplicaRoster.of_deployment(cluster.deployment())
    replies: list[RunReply] = []

    async def on_reply(reply: RunReply) -> None:
        ledger.seal(reply.episode.rollout_id)
        replies.append(reply)

    (task,) = cluster.tasks(1)
    ledger.add_group(task, "g", 4)
    async with HttpClient() as client:
        dispatcher = Dispatcher(
            ledger,
            cluster.deployment(),
            client,
            concurrency=8,
            max_turns=12,
            row_timeout_s=30,
            barrier=barrier,
            on_reply=on_reply,
            roster=roster,
        )
        async with dispatcher:
            for name in roster.names:
                roster.mark_down(name)
                dispatcher.replica_lost(name)
            run = asyncio.create_task(dispatcher.run_group("g"))
            await eventually(
                lambda: dispatcher.waiting_rows == 4, "every row waiting", within_s=WAIT_S
            )
            await asyncio.sleep(0.2)
            assert (dispatcher.in_flight_rows, replies, dispatcher.idle) == (0, [], False)
            roster.mark_up(cluster.replicas[1].endpoints)
            outcome = await asyncio.wait_for(run, 10)

    assert outcome.ok
    rows = [ledger.current("g", row) for row in range(4)]
    assert {(r.state, r.replica, r.tries) for r in rows} == {(RolloutState.SEALED, "replica-1", 1)}


async def test_the_stall_watchdog_stops_a_run_with_no_replica_up_and_says_so(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    config = RunConfig(
        workdir=tmp_path, environment="workplace", group_size=2, replicas=2, concurrency=4
    )
    trainer = Trainer(
        config.trainer_settings(),
        cluster.deployment(),
        cluster.tasks(2),
        hooks=SimulatedTrainer(),
        stall_timeout_s=0.5,
    )
    for replica in cluster.replicas:
        await trainer.replica_down(replica.name)
    with pytest.raises(RunStalledError, match=r"replicas down: replica-0, replica-1 \(none up\)"):
        await asyncio.wait_for(trainer.run(), 10)
