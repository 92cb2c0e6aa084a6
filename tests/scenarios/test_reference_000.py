"""Reference 000: the eleven defects the review of NeMo-RL #4500 found, one scenario each.

Each test builds the situation of one row of the reference's table on real servers (threads
on loopback) and checks what rollpoint does there instead. Each says in a comment which of
our lines would have to break for it to fail.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import Phase
from rollpoint.protocol.episode import RunRow, ToolCall
from rollpoint.protocol.errors import RestoreError, StaleAttemptError
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN, EpisodeId
from rollpoint.protocol.manifest import FileEntry, encode_document, seal_manifest
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.digest import digest_bytes
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import Fault, invariants
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE, WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import choose_resume_point, read_trainer_document
from rollpoint.trainer.snapshot.publication import LEDGER_FILE
from rollpoint.trainer.state.ledger import RecoveryLedger, RolloutState
from rollpoint.trainer.train_hooks import TrainSample
from rollpoint.tuning import seam
from rollpoint.tuning.collector_listener import CollectorListener
from tests.scenarios.scenario_kit import (
    PREPARE,
    RESTORE,
    RESUME,
    ControlCall,
    Job,
    ScenarioCluster,
    crash,
    fronted,
    job,
    job_config,
    label,
    play,
    rig,
    rollout_is,
    run_row,
    save_with_episodes,
    statuses,
)
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

MODEL, AGENT, RESOURCES = ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES
A0, A1, M0, RES0, RES1 = (
    label(AGENT, "replica-0"),
    label(AGENT, "replica-1"),
    label(MODEL, "replica-0"),
    label(RESOURCES, "replica-0"),
    label(RESOURCES, "replica-1"),
)


def assert_every_row_trained_once(j: Job) -> None:
    rows = j.train_rows()
    keys = [(r["group_id"], r["row"]) for r in rows]
    assert sorted(keys) == sorted(j.every_row()), "a row was lost or trained twice"


# --- save 1: nothing measured how long a snapshot pauses rollouts ------------------------

SLOW_PREPARE_S = 0.3


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("rollpoint_snapshot_pause_seconds_") and " " in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def test_snapshot_pause_is_measured(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        fronted(cluster, A0) as fronts,
        job(cluster, job_config(tmp_path / "run"), fronts=fronts) as j,
    ):
        port = j.metrics.serve()
        run = await j.start()
        # A slow participant: the agent answers prepare late, so the pause must span it.
        fronts[A0].add(Fault.delay(SLOW_PREPARE_S, path=PREPARE))
        slow = await j.coordinator.save()
        quick = await j.coordinator.save()
        await run
        exposed = await asyncio.to_thread(scrape, port)

    reports = [slow, quick]
    assert all(r.published for r in reports), [r.blocked_by for r in reports]
    # Breaks if coordinator._save stops the pause clock before the resume (or never).
    assert slow.pause_s >= slow.prepare_s >= SLOW_PREPARE_S
    assert quick.pause_s >= quick.prepare_s > 0
    events = {
        e["snapshot_id"]: e
        for e in map(orjson.loads, (j.config.workdir / "metrics.jsonl").read_bytes().splitlines())
        if e["event"] == "snapshot"
    }
    for report in reports:
        manifest = j.store.load(report.snapshot_id)
        event = events[report.snapshot_id]
        # The same number in the manifest, in metrics.jsonl and in the report.
        assert manifest.pause_seconds == event["pause_seconds"] == report.pause_s
        assert event["pause_seconds"] >= event["prepare_seconds"] > 0
    # Prometheus: one observation per snapshot, their sum the pauses measured.
    assert exposed["rollpoint_snapshot_pause_seconds_count"] == 2
    assert exposed["rollpoint_snapshot_pause_seconds_sum"] == pytest.approx(
        slow.pause_s + quick.pause_s
    )


# --- save 4: no test noticed if retired episodes were never marked retired ---------------

ROW_TIMEOUT_S = 1.0


async def test_retired_episodes_are_marked_retired(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots", replicas=1) as cluster,
        fronted(cluster, A0) as fronts,
        rig(cluster, tmp_path, fronts=fronts, row_timeout_s=ROW_TIMEOUT_S) as r,
        HttpClient(token=cluster.token) as http,
    ):
        replica = cluster.replicas[0]
        old = r.add_group(size=2)
        replica.on_gate(lambda gate: gate.close())  # every row waits at its first policy call
        # When the rows time out the agent cannot be reached: the give-up can retire nothing
        # there, so the tries stay abandoned, queued for the next save to retire (its step 1).
        await fronts[A0].partition()
        run = asyncio.create_task(r.dispatcher.run_group("g"))
        await eventually(
            lambda: len(r.ledger.abandoned()) == 2,
            "the timed-out tries were given up",
            within_s=ROW_TIMEOUT_S + 5,
        )
        assert replica.on_book(lambda book: [book.retire_mark(t.rollout_id) for t in old]) == [
            None,
            None,
        ]
        await fronts[A0].heal()
        report = await r.coordinator.save()  # its resume reopens the gate
        # Given back at once: no trainer run started this coordinator's collector, so a
        # hold kept past the save would never be released (the collector off for good).
        # (The LocalCluster under the scenario installed the collector's listener.)
        collectors = [
            listener.collector(r.coordinator)
            for listener in seam.listeners()
            if isinstance(listener, CollectorListener)
        ]
        assert collectors and all(c is not None and not c.held for c in collectors)
        outcome = await asyncio.wait_for(run, 10)
        direct = cluster.clients(http)
        after = await statuses(direct)
        late = await late_calls(cluster, http, r.ledger, old[0].rollout_id)

    assert report.published, report.blocked_by
    assert outcome.ok
    # Breaks if ReleaseBatcher._retire_abandoned stops calling ledger.retire once every
    # participant of the replica raised its marks.
    assert [r.ledger.get(t.rollout_id).state for t in old] == [RolloutState.RETIRED] * 2
    assert r.dispatcher.retire_queue == set()
    # Every participant of the replica holds the marks (Fence._raise_marks), one per try the
    # ledger retired: the two above, and any fresh re-send of theirs that also met the cut
    # before the heal (a loaded machine gives them that time: a CI run saw 4).
    retired = r.ledger.counts()[RolloutState.RETIRED]
    assert retired >= 2
    assert {name: s.retired_rollouts for name, s in after.items()} == {
        c.label: retired for c in direct
    }
    # ... and refuses a late call of the retired try, each in its own way.
    assert late == {
        "model": "stale_attempt",
        "resources": "stale_attempt",
        "agent": "stale_attempt",
    }


async def late_calls(
    cluster: ScenarioCluster, http: HttpClient, ledger: RecoveryLedger, rollout_id: str
) -> dict[str, str]:
    """A call of ``rollout_id#0`` to each server, as a straggler of that try would make it."""
    replica = cluster.replicas[0]
    record = ledger.get(rollout_id)
    episode = EpisodeId(rollout_id=rollout_id, attempt=0)
    task = ledger.task(record.task_id)
    found: dict[str, str] = {}
    headers = {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: "0", HEADER_TURN: "7"}
    body = {"model": "scripted", "messages": [{"role": "user", "content": task.prompt}]}
    with pytest.raises(StaleAttemptError) as model:
        await http.request_json(
            "POST", f"{replica.model.url}/v1/chat/completions", body=body, headers=headers
        )
    found["model"] = model.value.code
    call = ToolCall(episode=episode, turn=7, call_index=0, arguments='{"query": ""}')
    with pytest.raises(StaleAttemptError) as tool:
        await http.post_json(
            f"{replica.resources.url}/tools/calendar_search_events", call.model_dump(mode="json")
        )
    found["resources"] = tool.value.code
    lines = await play(http, replica.agent.url, [run_row(ledger, record)])
    assert [line["kind"] for line in lines] == ["failed"]
    found["agent"] = lines[0]["code"]
    return found


# --- save 5: a restart-only agent never parks, so prepare timed out ----------------------


async def test_restart_only_agent_never_wedges_prepare(tmp_path: Path) -> None:
    async with ScenarioCluster(
        tmp_path / "snapshots", replicas=1, environment="math", tool_proxy=True
    ) as cluster:
        tools = cluster.replicas[0].tools
        assert tools is not None
        # Every episode ends in a verify the resources server does not answer yet: the
        # sessions are busy, away from any turn boundary, for as long as the test likes.
        verify = tools.add(Fault.hold(path="/episodes/verify", times=None))
        config = job_config(
            tmp_path / "run",
            environment="math",
            replicas=1,
            tasks=4,
            snapshot={"keep": 100, "deadline_seconds": 2, "allow_restart_only": True},
        )
        async with job(cluster, config) as j:
            run = await j.start(in_flight=4)
            agent = j.direct[label(AGENT, "replica-0")]

            async def all_verifying() -> bool:
                return (await agent.status()).counts.get("verifying") == 4

            await eventually(all_verifying, "every episode busy in its verify")
            busy = sorted(r.key for r in j.trainer.ledger.in_flight())
            # The reference's budget: three prepare timeouts in a row stop the run.
            reports = [await j.coordinator.save() for _ in range(3)]
            tools.release(verify)
            await run

    # Breaks if SessionBook.readiness made a restart-only agent wait for boundaries.
    assert [r.published for r in reports] == [True] * 3, [r.blocked_by for r in reports]
    for report in reports:
        assert report.manifest is not None
        assert report.manifest.episodes == []
        assert sorted(f"{e.rollout_id}#{e.attempt}" for e in report.manifest.restarts) == busy
    assert_every_row_trained_once(j)


# --- save 5: the stall watchdog kept counting while the environment was parked -----------

STALL_TIMEOUT_S = 1.0
LONG_PREPARE_S = 2.5


async def test_stall_watchdog_does_not_count_a_park(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        fronted(cluster, A0) as fronts,
        job(
            cluster,
            job_config(tmp_path / "run"),
            fronts=fronts,
            stall_timeout_s=STALL_TIMEOUT_S,
        ) as j,
    ):
        run = await j.start()
        # A slow participant: the pause outlasts the stall timeout; every session waits at
        # the closed model gate meanwhile, so no row result arrives.
        fronts[A0].add(Fault.delay(LONG_PREPARE_S, path=PREPARE))
        report = await j.coordinator.save()
        # Breaks (RunStalledError raised here) if the stall watch (watch_stall) read a wall clock
        # instead of the barrier's pause clock.
        await run

    assert report.published, report.blocked_by
    assert report.pause_s > STALL_TIMEOUT_S
    assert_every_row_trained_once(j)


# --- save 12: one failed row ended the whole stream for its group ------------------------


async def test_one_failed_row_does_not_end_its_groups_stream(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots", tool_proxy=True) as cluster,
        fronted(cluster, A0, A1) as fronts,
        rig(
            cluster,
            tmp_path,
            run_urls={"replica-0": fronts[A0].url, "replica-1": fronts[A1].url},
        ) as r,
    ):
        r0 = cluster.replica("replica-0")
        assert r0.tools is not None
        first = [x.rollout_id for x in r.add_group(size=4)]
        # Row 1 fails alone, a transport failure: its episode's start is reset on the wire.
        r0.tools.add(Fault.reset(path="/episodes/start", when=rollout_is(first[1])))
        r0.on_gate(lambda gate: gate.close())  # its siblings wait at their first policy call
        run = asyncio.create_task(r.dispatcher.run_group("g"))

        def failed_row_finished() -> bool:
            row = r.ledger.current("g", 1)
            return row.rollout_id != first[1] and r.sealed(row.rollout_id)

        await eventually(failed_row_finished, "the failed row, re-sent on its own, finished")
        siblings = [r.ledger.current("g", row) for row in (0, 2, 3)]
        sent = {name: proxy.stats.by_route.get("POST /run", 0) for name, proxy in fronts.items()}
        assert not run.done()
        r0.on_gate(lambda gate: gate.open())
        outcome = await asyncio.wait_for(run, 10)

    assert outcome.ok
    # Breaks if Dispatcher._handle ended the stream on a failed row (or the agent's
    # /run stopped streaming after one): the siblings stayed in their first stream,
    # in flight under their first ids, while the failed row alone went out again.
    assert [(x.rollout_id, x.state, x.tries) for x in siblings] == [
        (first[i], RolloutState.DISPATCHED, 1) for i in (0, 2, 3)
    ]
    assert sent == {A0: 1, A1: 1}
    rows = [r.ledger.current("g", row) for row in range(4)]
    assert [(x.rollout_id, x.tries, x.replica) for x in rows[::2]] == [
        (first[0], 1, "replica-0"),
        (first[2], 1, "replica-0"),
    ]
    assert rows[1].rollout_id not in first and (rows[1].tries, rows[1].replica) == (2, "replica-1")
    assert r.replies[0].episode.rollout_id == rows[1].rollout_id


# --- save 12: a re-sent row waited behind the closed gate but counted as running ----------


async def test_resent_row_behind_closed_gate_is_not_in_flight(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots", replicas=1) as cluster,
        fronted(cluster, A0, RES0) as fronts,
        rig(
            cluster, tmp_path, fronts={RES0: fronts[RES0]}, run_urls={"replica-0": fronts[A0].url}
        ) as r,
    ):
        first = [x.rollout_id for x in r.add_group(size=2)]
        # The group's /run is on the wire when a save begins; it reaches the agent only once
        # the agent has closed admission for the cut, and is refused there.
        sent = fronts[A0].add(Fault.hold(path="/run"))
        prepare = fronts[RES0].add(Fault.hold(path=PREPARE))  # the save stays in its pause
        agent = r.roster.agent("replica-0")
        assert agent is not None
        run = asyncio.create_task(r.dispatcher.run_group("g"))
        await sent.wait()
        save = asyncio.create_task(r.coordinator.save())

        async def agent_closed() -> bool:
            return (await agent.status()).phase is Phase.PREPARED

        await eventually(agent_closed, "the agent closed admission for the cut")
        fronts[A0].release(sent)
        await eventually(lambda: r.dispatcher.waiting_rows == 2, "refused rows wait to go again")
        waiting = [(x.rollout_id, x.state, x.tries) for x in map(r.ledger.get, first)]
        in_flight = r.ledger.in_flight_count()
        assert not save.done()
        fronts[RES0].release(prepare)
        report = await save
        outcome = await asyncio.wait_for(run, 10)

    # Breaks if Dispatcher._refuse kept a refused row dispatched while it waits at the
    # barrier: it would be in the cut's scope (a restart) although nothing runs it.
    assert waiting == [(rid, RolloutState.QUEUED, 1) for rid in first]
    assert in_flight == 0
    assert report.published, report.blocked_by
    assert report.manifest is not None
    listed = [*report.manifest.episodes, *report.manifest.restarts, *report.manifest.finished]
    assert listed == []
    # Once the barrier reopened they went out under the same ids (they never ran).
    assert outcome.ok
    assert [(r.ledger.get(rid).state, r.ledger.get(rid).tries) for rid in first] == [
        (RolloutState.SEALED, 1)
    ] * 2
    assert r.dispatcher.resent_refused == 2


# --- save 14: a train step that ended during the save threw the snapshot away -------------


class StepEndingInASave:
    """Train step 1 starts, then ends only when the test says (while a save is held)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.may_end = asyncio.Event()
        self.ended_at: dict[int, float] = {}

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        if step == 1:
            self.started.set()
            await self.may_end.wait()
        self.ended_at[step] = time.time()
        return {"rollouts": float(len(batch))}


async def test_train_step_ending_during_save_does_not_discard_it(tmp_path: Path) -> None:
    hooks = StepEndingInASave()
    config = job_config(tmp_path / "run", train={"batch_size": 2, "checkpoint_every_steps": 1})
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        fronted(cluster, RES0) as fronts,
        job(cluster, config, fronts=fronts, hooks=hooks) as j,
    ):
        run = asyncio.create_task(j.trainer.run())
        await asyncio.wait_for(hooks.started.wait(), 10)
        held = fronts[RES0].add(Fault.hold(path=PREPARE))
        save = asyncio.create_task(j.coordinator.save())
        await held.wait()  # the save is in its pause, in prepare
        hooks.may_end.set()
        await eventually(lambda: j.trainer.stats.train_steps >= 1, "train step 1 ended")
        assert not save.done()
        fronts[RES0].release(held)
        report = await save
        await crash(run)  # right after this save: only it can be resumed from
        history = list(j.coordinator.history)

    # Breaks if the coordinator dropped a cut once the trainer's step moved under it.
    assert report.published, report.blocked_by
    assert [r.blocked_by for r in history if not r.published] == []
    manifest = j.store.load(report.snapshot_id)
    assert manifest.created_at <= hooks.ended_at[1] <= manifest.published_at
    # The rerun after the crash resumes from it: it composes with a durable train
    # checkpoint (the finished queue kept what step 1 consumed until that checkpoint). The save step 1's
    # checkpoint queued behind it may have published too before the crash landed.
    for later in j.store.list_snapshots():
        if later.published_at is not None and later.published_at > manifest.published_at:
            shutil.rmtree(j.store.snapshot_dir(later.snapshot_id))
    point = choose_resume_point(j.store, WorkdirRecord(j.config.workdir))
    assert point is not None and point.manifest.snapshot_id == report.snapshot_id


# --- save 17: a lost resume kept the environment closed for the whole 600 s lease --------

LEASE_DEADLINE_S = 1.0
LEASE_GRACE_S = 0.5


async def test_lost_resume_reopens_within_the_lease(tmp_path: Path) -> None:
    config = job_config(
        tmp_path / "run", snapshot={"keep": 100, "deadline_seconds": LEASE_DEADLINE_S}
    )
    async with (
        ScenarioCluster(tmp_path / "snapshots", lease_grace_s=LEASE_GRACE_S) as cluster,
        fronted(cluster, M0) as fronts,
        job(cluster, config, fronts=fronts) as j,
    ):
        run = await j.start()
        lost = fronts[M0].add(Fault.reset(path=RESUME, times=2))  # the resume and its retry
        report = await j.coordinator.save()
        saved_at = time.time()
        stuck = await j.direct[M0].status()

        async def reopened() -> bool:
            return (await j.direct[M0].status()).phase is Phase.IDLE

        took = await eventually(reopened, "the model server reopened by itself", within_s=10)
        reopened_at = time.time()
        after = await j.coordinator.save()
        await run

    assert lost.hits == 2
    assert report.published, report.blocked_by
    # Its gate stayed closed: nobody could resume it, only its lease could reopen it ...
    assert stuck.phase is Phase.COMMITTED and stuck.lease_expires_at is not None
    assert reopened_at >= stuck.lease_expires_at - 0.1
    # ... and the lease is the last deadline plus the grace: seconds, not minutes. Breaks if
    # Fence._extend_lease or ControlSettings.lease_grace_s stopped bounding it.
    assert stuck.lease_expires_at - saved_at <= LEASE_DEADLINE_S + LEASE_GRACE_S
    assert took <= LEASE_DEADLINE_S + LEASE_GRACE_S + 1.0, f"reopened after {took:.1f}s"
    assert after.published, after.blocked_by
    assert_every_row_trained_once(j)


# --- restore 4: the ledger/manifest mismatch error did not say which episodes differ -----


async def test_ledger_manifest_mismatch_names_the_episodes(tmp_path: Path) -> None:
    config = job_config(tmp_path / "run", tasks=8)
    async with ScenarioCluster(tmp_path / "snapshots") as cluster:
        async with job(cluster, config) as j:
            run = await j.start(in_flight=3)
            report = await j.coordinator.save()
            await run
        assert report.published and report.manifest is not None
        manifest = report.manifest
        listed = [*manifest.episodes, *manifest.restarts, *manifest.finished]
        assert len(listed) >= 2, "the cut held too few episodes to tamper with"
        moved, unsent = listed[0], listed[1]
        other = "replica-1" if moved.replica == "replica-0" else "replica-0"
        doc = read_trainer_document(j.store, report.snapshot_id, LEDGER_FILE)
        records = {r["rollout_id"]: r for r in doc["records"]}
        records[moved.rollout_id]["replica"] = other  # the ledger says another replica
        records[unsent.rollout_id]["state"] = RolloutState.QUEUED.value  # ... or never sent
        # A first try still queued is implied by its group (ledger schema 3): name it.
        named = {r["rollout_id"] for r in doc["records"]}
        named |= {final[3] for chunk in doc["archived"] for final in chunk}
        gid, row, rid = next(
            (gid, row, rid)
            for gid, group in doc["groups"].items()
            for row, rid in enumerate(group["rollout_ids"])
            if rid not in named
        )
        extra = {
            "task_id": doc["groups"][gid]["task_id"],
            "group_id": gid,
            "row": row,
            "rollout_id": rid,
            "attempt": 0,
            "state": RolloutState.DISPATCHED.value,  # ... or in flight
            "replica": "replica-0",
            "tries": 1,
        }
        doc["records"].append(extra)
        publish_tampered(j.store, report.snapshot_id, orjson.dumps(doc))

        point = choose_resume_point(j.store, WorkdirRecord(config.workdir))
        assert point is not None and point.manifest.snapshot_id == report.snapshot_id
        async with HttpClient(token=cluster.token) as http:
            clients = cluster.clients(http)
            with pytest.raises(RestoreError) as refused:
                await Restorer(clients).restore(point, step_record=WorkdirRecord(config.workdir))
            after = await statuses(clients)

    message = refused.value.message
    # Breaks if restore_checks.check_cut named counts instead of the episodes and their replicas.
    assert (
        f"{moved.rollout_id}#{moved.attempt} (ledger {other}, manifest {moved.replica})" in message
    )
    assert f"{unsent.rollout_id}#{unsent.attempt} on {unsent.replica}" in message
    assert f"{extra['rollout_id']}#{extra['attempt']} on replica-0" in message
    # It was refused before anything was installed.
    assert {s.phase for s in after.values()} == {Phase.IDLE}
    assert all(s.counts.get("restored", 0) == 0 for s in after.values())


def publish_tampered(store: SnapshotStore, snapshot_id: str, ledger: bytes) -> None:
    """Replace a published snapshot's ledger and recompute its digest in the manifest, as
    a writer with a bug (not a corrupt disk) would."""
    folder = Path(store.snapshot_dir(snapshot_id))
    (folder / LEDGER_FILE).write_bytes(ledger)
    manifest = store.load(snapshot_id)
    digest = digest_bytes(ledger)
    entry = FileEntry(path=LEDGER_FILE, sha256=digest.sha256, bytes=digest.bytes)
    files = {**manifest.files, LEDGER_FILE: entry}
    (folder / "manifest.json").write_bytes(
        encode_document(seal_manifest(manifest.model_copy(update={"files": files})))
    )
    store.verify(snapshot_id)  # every digest checks out: only the contents disagree


# --- restore 5: a failed restore resumed the environment twice --------------------------


async def test_failed_restore_resumes_each_participant_exactly_once(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    async with ScenarioCluster(root) as first, job(first, job_config(tmp_path / "run")) as j:
        run = await j.start(in_flight=3)
        report = await save_with_episodes(j, {"replica-0"})
        await crash(run)
    point = choose_resume_point(j.store, WorkdirRecord(j.config.workdir))
    assert point is not None and point.manifest.snapshot_id == report.snapshot_id
    saved = point.manifest.episodes
    calls: list[ControlCall] = []
    async with (
        ScenarioCluster(root) as fresh,
        fronted(fresh, RES1) as fronts,
        HttpClient(token=fresh.token) as http,
    ):
        # One participant's restore fails; the others install.
        fronts[RES1].add(
            Fault.error(
                422,
                {
                    "error": {
                        "code": "invalid_checkpoint_state",
                        "message": "injected: records unreadable",
                        "retryable": False,
                    }
                },
                path=RESTORE,
            )
        )
        clients = fresh.clients(http, urls={RES1: fronts[RES1].url}, spy=calls)
        with pytest.raises(RestoreError) as failed:
            await Restorer(clients).restore(point, step_record=WorkdirRecord(tmp_path))
        after = await statuses(fresh.clients(http))
        resumed_through_proxy = fronts[RES1].stats.by_route.get(f"POST {RESUME}", 0)
        retired = await next_attempt_refused(fresh, http, point, saved[0])

    assert "resources@replica-1" in failed.value.message and "injected" in failed.value.message
    (restore_id,) = {c.checkpoint_id for c in calls if c.verb == "restore"}
    resumes = [(c.participant, c.checkpoint_id) for c in calls if c.verb == "resume"]
    # Breaks if the cleanup is written in two places again (Installer.install's failure
    # path and _clean_up both resuming).
    assert sorted(resumes) == sorted((c.label, restore_id) for c in clients)
    assert resumed_through_proxy == 1
    # The one cleanup path also retired the next attempts everywhere: none can ever run.
    retires = {(c.participant, c.scope) for c in calls if c.verb == "retire"}
    assert retires == {(c.label, len(saved)) for c in clients}
    assert retired == "stale_attempt"
    assert {s.phase for s in after.values()} == {Phase.IDLE}
    assert all(s.counts.get("live", 0) == 0 for s in after.values())


async def next_attempt_refused(
    cluster: ScenarioCluster, http: HttpClient, point: Any, saved: Any
) -> str:
    """What the agent that saved ``saved`` answers to ``/run`` of its next attempt."""
    ledger = RecoveryLedger.from_document(point.ledger_doc)
    row = run_row(ledger, ledger.get(saved.rollout_id), attempt=saved.attempt + 1)
    (line,) = await play(http, cluster.replica(saved.replica).agent.url, [row])
    assert line["kind"] == "failed"
    return str(line["code"])


async def test_failed_restore_can_be_retried_into_the_same_servers(tmp_path: Path) -> None:
    root, config = tmp_path / "snapshots", job_config(tmp_path / "run")
    async with ScenarioCluster(root) as first, job(first, config) as j:
        run = await j.start(in_flight=3)
        await save_with_episodes(j, {"replica-0"})
        await crash(run)
    point = choose_resume_point(j.store, WorkdirRecord(config.workdir))
    assert point is not None
    async with (
        ScenarioCluster(root) as servers,
        fronted(servers, RES1) as fronts,
        HttpClient(token=servers.token) as http,
    ):
        fronts[RES1].add(
            Fault.error(
                422,
                {
                    "error": {
                        "code": "invalid_checkpoint_state",
                        "message": "injected: records unreadable",
                        "retryable": False,
                    }
                },
                path=RESTORE,
            )
        )
        proxied = servers.clients(http, urls={RES1: fronts[RES1].url})
        with pytest.raises(RestoreError):
            await Restorer(proxied).restore(point, step_record=WorkdirRecord(config.workdir))
        # The operator fixes the cause and runs the same command again on the same servers.
        restored = await Restorer(servers.clients(http)).restore(
            point, step_record=WorkdirRecord(config.workdir)
        )
        async with job(servers, config, restored=restored) as again:
            coordinator = again.trainer.coordinator
            assert coordinator is not None
            # Held through retention until the run publishes a snapshot of its own (it
            # publishes none here: tests/unit/trainer/test_coordinator_in_process.py).
            assert coordinator.store.pinned == {restored.snapshot_id}
            summary = await again.trainer.run()

    assert summary.failed_groups == {}
    assert_every_row_trained_once(again)


# --- restore 10: the functional test passed even if the episode started over -------------


CUT_TURNS = 1
"""Where the scenario's cut falls: after the episode's first turn and its tool results."""


async def test_functional_check_fails_if_a_restored_episode_started_over(tmp_path: Path) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots", replicas=1) as cluster,
        HttpClient() as http,
    ):
        (task,) = cluster.tasks(1)
        row = RunRow(task=task, group_id="g", row=0, episode=EpisodeId(rollout_id="r7"))
        (reply,) = await play(http, cluster.replicas[0].agent.url, [row])
    assert reply["kind"] == "finished" and reply["turns"] > CUT_TURNS
    messages: list[dict[str, Any]] = reply["messages"]
    turns: int = reply["turns"]
    cut = [i for i, m in enumerate(messages) if m["role"] == "assistant"][CUT_TURNS]
    assert "calendar_create_event" in orjson.dumps(messages[:cut]).decode()  # a side effect
    # A real episode as it is trained when it continued after the cut: one transcript, the
    # turns before the cut made by the saved attempt.
    continued = train_line(reply, "r7", messages, turns)
    # The same episode whose continued attempt began again at its prompt: every turn after
    # the saved ones is a regenerated one, counts and attempt order all consistent.
    started_over = train_line(reply, "r8", [*messages[:cut], *messages], turns + CUT_TURNS)
    workdir = tmp_path / "run"
    workdir.mkdir()
    lines = [orjson.dumps(x) + b"\n" for x in (continued, started_over)]
    (workdir / TRAIN_DATA_FILE).write_bytes(b"".join(lines))

    rollouts, unreadable = invariants.read_train_data(workdir)
    assert unreadable == []
    found = invariants.check_no_regenerated_turns(rollouts)
    # Breaks if invariants.check_no_regenerated_turns stopped reading a continued rollout's
    # transcript (the reference's functional test checked only the reward).
    assert {v.subject for v in found} == {"g row 1 (r8#1)"}, invariants.report(found)
    assert all(v.kind is invariants.Invariant.NO_REGENERATED_TURNS for v in found)


def train_line(
    reply: dict[str, Any], rollout_id: str, messages: list[dict[str, Any]], turns: int
) -> dict[str, Any]:
    """A ``train_data.jsonl`` line of a rollout continued (attempt 1) after the cut."""
    return {
        "task_id": reply["task_id"],
        "group_id": reply["group_id"],
        "row": 0 if rollout_id == "r7" else 1,
        "rollout_id": rollout_id,
        "attempt": 1,
        "reward": reply["reward"],
        "advantage": 0.0,
        "messages": messages,
        "train_step": 1,
        "policy_version": 0,
        "turns": turns,
        "model_calls": [{"turn": t, "attempt": int(t >= CUT_TURNS)} for t in range(turns)],
    }
