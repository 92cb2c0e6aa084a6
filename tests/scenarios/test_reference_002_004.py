"""References 002 and 004: what the hardening of NeMo-RL #4501 fixed, as scenarios.

Its commits fix a restore into a deployment missing a saved participant, checkpoint-refused
rows of a cohort, broken streams re-sent under ids still running, replies on the wire at
the cut, a drain whose cost grew with every rollout, and several replicas in one cut. Each
test builds one of those situations on real servers and checks rollpoint's behaviour; each
says which of our lines would have to break for it to fail.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import Phase
from rollpoint.protocol.errors import RestoreError, StaleAttemptError
from rollpoint.protocol.ids import HEADER_ATTEMPT, HEADER_ROLLOUT_ID, HEADER_TURN
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.servers.agent.session_book import SessionBook
from rollpoint.store.participant_state import read_participant_state
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.testing import Fault, FaultProxy
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import (
    ResumePoint,
    choose_resume_point,
    read_trainer_document,
)
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.snapshot.publication import LEDGER_FILE
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from tests.scenarios.scenario_kit import (
    KINDS,
    PREPARE,
    ControlCall,
    RecordingHooks,
    ReplyRelay,
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

A0, RES0 = label(ParticipantKind.AGENT, "replica-0"), label(ParticipantKind.RESOURCES, "replica-0")
BOTH = ("replica-0", "replica-1")


def resume_point(workdir: Path, root: Path) -> ResumePoint:
    point = choose_resume_point(SnapshotStore(str(root)), WorkdirRecord(workdir))
    assert point is not None, "no snapshot to resume from"
    return point


# --- a restore into a deployment missing a participant the snapshot saved ------------------


async def test_restore_missing_a_saved_participant_is_refused_before_installing(
    tmp_path: Path,
) -> None:
    root, workdir = tmp_path / "snapshots", tmp_path / "run"
    async with ScenarioCluster(root) as two, job(two, job_config(workdir)) as j:
        run = await j.start(in_flight=3)
        await save_with_episodes(j, {"replica-0"})
        await crash(run)
    point = resume_point(workdir, root)
    async with (
        ScenarioCluster(root, replicas=1) as one,
        HttpClient(token=one.token) as http,
    ):
        clients = one.clients(http)
        # A deployment without a resources server: no live replica can take either
        # replica's state (a 2-replica snapshot onto 1 complete replica is an elastic restore).
        without = [c for c in clients if c.address.kind != ParticipantKind.RESOURCES]
        with pytest.raises(RestoreError) as refused:
            await Restorer(without).restore(point, step_record=WorkdirRecord(workdir))
        after = await statuses(clients)

    message = refused.value.message
    # Breaks if Restorer._check_topology ran after any install, or named no one.
    for replica in BOTH:
        assert f"resources 'resources' of {replica}" in message
    assert "model '" not in message and "agent '" not in message
    assert "nothing was installed" in message
    # The live participants (replica-0, whose episodes the snapshot holds) installed nothing.
    assert {s.phase for s in after.values()} == {Phase.IDLE}
    agent = after[label(ParticipantKind.AGENT, "replica-0")].counts
    assert (agent["live"], agent["restored"], agent["finished_unacked"]) == (0, 0, 0)
    assert after[label(ParticipantKind.RESOURCES, "replica-0")].counts["episodes"] == 0
    assert after[label(ParticipantKind.MODEL, "replica-0")].counts["recorded_calls"] == 0
    assert all(s.retired_rollouts == 0 for s in after.values())


# --- checkpoint-refused rows of a cohort ------------------------------------------------------


async def test_refused_rows_in_a_cohort_do_not_deadlock(tmp_path: Path) -> None:
    """A cohort verifier releases the admitted rows' results only once every row of the
    cohort has one; one row, re-sent after a failure, is refused because the agent is
    closed for a snapshot. It must go out again while its siblings' stream is still open."""
    cohort: set[str] = set()
    async with (
        ScenarioCluster(tmp_path / "snapshots", replicas=1, tool_proxy=True) as cluster,
        fronted(cluster, A0, RES0) as fronts,
        ReplyRelay(
            fronts[A0].url, hold=lambda line: line["episode"]["rollout_id"] in cohort
        ) as verifier,
        rig(
            cluster,
            tmp_path,
            fronts={RES0: fronts[RES0]},
            run_urls={"replica-0": verifier.url},
            concurrency=4,
        ) as r,
    ):
        tools = cluster.replicas[0].tools
        assert tools is not None
        first = [x.rollout_id for x in r.add_group(size=4)]
        cohort.update(first[i] for i in (0, 2, 3))
        # Row 1 fails at its start (the resources server's connection resets); its fresh
        # re-send is held on its way to the agent until the agent is closed for a cut.
        tools.add(Fault.reset(path="/episodes/start", when=rollout_is(first[1])))
        resend = fronts[A0].add(
            Fault.hold(path="/run", when=lambda q: first[0].encode() not in q.body)
        )
        agent = r.roster.agent("replica-0")
        assert agent is not None
        run = asyncio.create_task(r.dispatcher.run_group("g"))
        await resend.wait()

        async def siblings_finished() -> bool:
            return (await agent.status()).counts["finished_unacked"] == 3

        await eventually(siblings_finished, "the admitted rows finished; the verifier holds them")
        prepare = fronts[RES0].add(Fault.hold(path=PREPARE))
        save = asyncio.create_task(r.coordinator.save())

        async def agent_closed() -> bool:
            return (await agent.status()).phase is Phase.PREPARED

        await eventually(agent_closed, "the agent closed admission for the cut")
        fronts[A0].release(resend)
        await eventually(
            lambda: r.dispatcher.waiting_rows == 1, "the refused row waits to go again"
        )
        refused = r.ledger.current("g", 1)
        fronts[RES0].release(prepare)
        report = await save
        # Breaks if Dispatcher._refuse left the re-send until the stream ended: the
        # verifier never ends the stream without it, and this never happens.
        await eventually(
            lambda: r.sealed(refused.rollout_id),
            "the refused row went out again and finished, its siblings' stream still open",
            within_s=10,
        )
        assert not run.done()
        verifier.release()
        outcome = await asyncio.wait_for(run, 10)

    assert outcome.ok
    assert report.published, report.blocked_by
    assert report.manifest is not None
    # At the cut the siblings' replies were on the wire; the refused row was not in flight.
    assert {e.rollout_id for e in report.manifest.finished} == cohort
    assert report.manifest.episodes == report.manifest.restarts == []
    assert r.replies[0].episode.rollout_id == refused.rollout_id
    rows = [r.ledger.current("g", row) for row in range(4)]
    assert [(x.rollout_id, x.tries) for x in rows] == [
        (first[0], 1),
        (refused.rollout_id, 2),
        (first[2], 1),
        (first[3], 1),
    ]
    assert r.dispatcher.resent_refused == 1


# --- a broken or short stream re-sent under ids the agent may still run ---------------------


@pytest.mark.parametrize("how", ["broken", "ended_short"])
async def test_broken_stream_never_resends_under_an_id_that_may_still_run(
    tmp_path: Path, how: str
) -> None:
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        HttpClient(token=cluster.token) as http,
        AsyncExitStack() as stack,
    ):
        r0 = cluster.replica("replica-0")
        proxy: FaultProxy | None = None
        relay: ReplyRelay | None = None
        if how == "broken":
            proxy = await stack.enter_async_context(FaultProxy(r0.agent.url))
            run_url = proxy.url
        else:
            relay = await stack.enter_async_context(ReplyRelay(r0.agent.url, end_after=2))
            run_url = relay.url
        r = await stack.enter_async_context(rig(cluster, tmp_path, run_urls={r0.name: run_url}))
        first = r.add_group(size=4)
        old = [x.rollout_id for x in first]
        # Rows 0 and 1 already finished on replica-0's agent: the stream returns them at once.
        await play(http, r0.agent.url, [run_row(r.ledger, x) for x in first[:2]])
        r0.on_gate(lambda gate: gate.close())  # rows 2 and 3 run on, held at a policy call
        run = asyncio.create_task(r.dispatcher.run_group("g"))
        await eventually(lambda: len(r.replies) == 2, "the finished rows came back")
        if proxy is not None:
            await proxy.partition()  # the connection breaks; the agent runs on
        await eventually(
            lambda: all(r.ledger.current("g", row).rollout_id not in old for row in (2, 3)),
            "the rows that never came back were re-sent",
        )
        r0.on_gate(lambda gate: gate.open())
        outcome = await asyncio.wait_for(run, 10)
        late = await late_call_codes(cluster, http, r.ledger, old[2])
        left = r0.on_book(
            lambda book: [(book.session(rid), book.retire_mark(rid)) for rid in old[2:]]
        )

    assert outcome.ok
    rows = [r.ledger.current("g", row) for row in range(4)]
    assert [(x.rollout_id, x.tries) for x in rows[:2]] == [(old[0], 1), (old[1], 1)]
    # Breaks if Dispatcher._give_up / _abandon re-sent a lost row under its old id, or
    # before the agent had stopped it: new ids, the old tries retired first.
    for row in rows[2:]:
        assert row.rollout_id not in old and row.tries == 2 and row.state is RolloutState.SEALED
    assert [r.ledger.get(rid).state for rid in old[2:]] == [RolloutState.RETIRED] * 2
    assert r.dispatcher.retire_queue == set()
    assert left == [(None, 0), (None, 0)]  # no session on the agent, and marked retired
    assert late == ["stale_attempt", "stale_attempt"]
    if relay is not None:
        assert relay.cut == [old[2:]]


async def late_call_codes(
    cluster: ScenarioCluster, http: HttpClient, ledger: RecoveryLedger, rollout_id: str
) -> list[str]:
    """What replica-0 answers a straggler of the old try: a policy call, and ``/run``."""
    r0 = cluster.replica("replica-0")
    record = ledger.get(rollout_id)
    headers = {HEADER_ROLLOUT_ID: rollout_id, HEADER_ATTEMPT: "0", HEADER_TURN: "1"}
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(StaleAttemptError) as model:
        await http.request_json(
            "POST", f"{r0.model.url}/v1/chat/completions", body=body, headers=headers
        )
    (line,) = await play(http, r0.agent.url, [run_row(ledger, record)])
    return [model.value.code, str(line.get("code"))]


# --- a reply on the wire at the cut -------------------------------------------------------


@pytest.mark.parametrize("crash_when", ["before_it_arrives", "after_it_arrives"])
async def test_reply_on_the_wire_at_the_cut_is_neither_lost_nor_trained_twice(
    tmp_path: Path, crash_when: str
) -> None:
    root, workdir = tmp_path / "snapshots", tmp_path / "run"
    config = job_config(workdir, train={"batch_size": 2, "checkpoint_every_steps": None})
    async with (
        ScenarioCluster(root) as first,
        ReplyRelay(
            first.replica("replica-0").agent.url, hold=lambda x: x["kind"] == "finished"
        ) as wire,
        job(first, config, run_urls={"replica-0": wire.url}) as j,
    ):
        run = asyncio.create_task(j.trainer.run())
        await eventually(lambda: bool(wire.held), "a finished reply on its way to the trainer")
        reply = wire.held[0]
        rollout_id = reply["episode"]["rollout_id"]
        report = await j.coordinator.save()
        if crash_when == "after_it_arrives":
            wire.release()
            await eventually(
                lambda: rollout_id in {x["rollout_id"] for x in j.train_rows()},
                "the reply arrived and was trained",
            )
        await crash(run)
        trained_before = [x["rollout_id"] for x in j.train_rows()]

    point = resume_point(workdir, root)
    assert point.manifest.snapshot_id == report.snapshot_id
    assert rollout_id in {e.rollout_id for e in point.manifest.finished}
    async with ScenarioCluster(root) as rerun, HttpClient(token=rerun.token) as http:
        restored = await Restorer(rerun.clients(http)).restore(
            point, step_record=WorkdirRecord(workdir)
        )
        hooks = RecordingHooks()
        async with job(rerun, config, restored=restored, hooks=hooks) as again:
            await again.trainer.run()
            rows = again.train_rows()
            every_row = again.every_row()

    # Before the crash it was trained once (after_it_arrives) or never reached training.
    assert trained_before.count(rollout_id) == (crash_when == "after_it_arrives")
    # Breaks if Restorer dropped a finished reply of the cut (lost) or _cut_back kept the
    # copy trained after the cut (twice).
    assert sorted((x["group_id"], x["row"]) for x in rows) == sorted(every_row)
    (line,) = [x for x in rows if x["rollout_id"] == rollout_id]
    # Adopted under its own identity: the very reply the agent held at the cut (its calls'
    # measured latencies too), not a rerun that happens to say the same.
    assert line["attempt"] == reply["episode"]["attempt"] == 0
    (sample,) = [s for s in hooks.samples if s.rollout_id == rollout_id]
    assert sample.messages == reply["messages"]
    assert [c.model_dump(mode="json") for c in sample.model_calls] == reply["model_calls"]
    assert restored.adopted == len(point.manifest.finished)


# --- the pause does not grow with the rollouts already finished ----------------------------

SEALED = 6000
ROWS_IN_FLIGHT = 2
"""Per replica: one group of this many rows on each."""


@dataclass
class CutShape:
    calls: list[tuple[str, str, int | None]]
    """Every control call of the save: participant, verb, episodes named."""
    live_records: int
    archived_records: int
    restarts: int


async def cut_of(
    cluster: ScenarioCluster, http: HttpClient, *, sealed: int
) -> tuple[CutShape, RecoveryLedger]:
    """One save whose ledger holds the same rows in flight and ``sealed`` finished ones."""
    ledger = RecoveryLedger()
    (task,) = cluster.tasks(1)

    def group(group_id: str) -> list[str]:
        rows = ledger.add_group(
            task.model_copy(update={"task_id": group_id}), group_id, ROWS_IN_FLIGHT
        )
        return [x.rollout_id for x in rows]

    for i in range(sealed // 2):
        for rollout_id in group(f"done-{i}"):
            ledger.dispatch(rollout_id, BOTH[i % 2])
            ledger.finish(rollout_id)
            ledger.seal(rollout_id)
    for replica in BOTH:
        for rollout_id in group(f"live-{replica}"):
            ledger.dispatch(rollout_id, replica)
    log: list[ControlCall] = []
    store = SnapshotStore(cluster.snapshot_root, keep=100)
    coordinator = SnapshotCoordinator(
        cluster.clients(http, spy=log),
        store=store,
        ledger=ledger,
        finished_queue=FinishedQueue(),
        barrier=DispatchBarrier(),
        # A long deadline: no lease renewal lands inside either save.
        config=SaveSettings(deadline_seconds=60),
        metrics=TrainerMetrics(),
        trainer_state=lambda: {"train_step": 0, "policy_version": 0},
        config_fingerprint={},
    )
    report = await coordinator.save()
    assert report.published and report.manifest is not None, report.blocked_by
    doc = read_trainer_document(store, report.snapshot_id, LEDGER_FILE)
    shape = CutShape(
        calls=sorted((c.participant, c.verb, c.scope) for c in log),
        live_records=len(doc["records"]),
        archived_records=sum(len(chunk) for chunk in doc["archived"]),
        restarts=len(report.manifest.restarts),
    )
    return shape, ledger


async def test_pause_does_not_grow_with_finished_rollouts(tmp_path: Path) -> None:
    """Structural, not timed: what a cut does with none and with thousands of finished
    rollouts in the ledger is the same work."""
    async with (
        ScenarioCluster(tmp_path / "snapshots") as cluster,
        HttpClient(token=cluster.token) as http,
    ):
        none, _ = await cut_of(cluster, http, sealed=0)
        many, ledger = await cut_of(cluster, http, sealed=SEALED)

    # Breaks if the coordinator's scope came from anything but RecoveryLedger.in_flight, or
    # if it scanned finished rollouts (a drain, a per-rollout check) inside the pause.
    assert many.calls == none.calls
    scopes = {(verb, scope) for _, verb, scope in many.calls if verb == "commit"}
    assert scopes == {("commit", ROWS_IN_FLIGHT)}
    assert many.restarts == none.restarts == ROWS_IN_FLIGHT * len(BOTH)
    # The ledger capture's live part is the same; the finished ones sit in the archive...
    assert many.live_records == none.live_records == ROWS_IN_FLIGHT * len(BOTH)
    assert (none.archived_records, many.archived_records) == (0, SEALED)
    # ... whose full chunks a capture shares instead of copying (RecoveryLedger.capture).
    one, two = ledger.capture().archived, ledger.capture().archived
    assert len(one) > 1 and all(a is b for a, b in zip(one[:-1], two[:-1], strict=True))


# --- more than one replica in one cut --------------------------------------------------------


async def test_more_than_one_replica_in_one_cut(tmp_path: Path) -> None:
    root, workdir = tmp_path / "snapshots", tmp_path / "run"
    # Enough rows that a loaded machine's slow saves still meet both replicas mid-episode.
    config = job_config(workdir, tasks=24)
    async with ScenarioCluster(root) as first, job(first, config) as j:
        run = await j.start(in_flight=4)
        report = await save_with_episodes(j, set(BOTH))
        await crash(run)
    manifest = report.manifest
    assert manifest is not None
    # One cut: both replicas' participants, every one committed under the cut's id (the
    # read refuses state of another checkpoint).
    assert sorted((p.kind, p.replica) for p in manifest.participants) == sorted(
        (k, r) for k in KINDS for r in BOTH
    )
    for p in manifest.participants:
        read_participant_state(
            j.store.participant_dir(manifest.snapshot_id, p.kind, p.instance),
            kind=p.kind.value,
            instance=p.instance,
            checkpoint_id=manifest.checkpoint_id,
            root=j.store.root,
        )
    point = resume_point(workdir, root)
    assert point.manifest.snapshot_id == manifest.snapshot_id
    async with ScenarioCluster(root) as rerun, HttpClient(token=rerun.token) as http:
        restored = await Restorer(rerun.clients(http)).restore(
            point, step_record=WorkdirRecord(workdir)
        )
        pinned = {e.rollout_id: restored.ledger.get(e.rollout_id) for e in manifest.episodes}
        placed = {e.rollout_id: holders(rerun, e.rollout_id) for e in manifest.episodes}
        recorded = {
            (rep.name, e.rollout_id): await recorded_calls(http, rep.model.url, e.rollout_id)
            for rep in rerun.replicas
            for e in manifest.episodes
        }
        hooks = RecordingHooks()
        async with job(rerun, config, restored=restored, hooks=hooks) as again:
            await again.trainer.run()
            rows = again.train_rows()
            every_row = again.every_row()
            final = {
                e.rollout_id: again.trainer.ledger.get(e.rollout_id) for e in manifest.episodes
            }
        left = {e.rollout_id: holders(rerun, e.rollout_id) for e in manifest.episodes}

    assert sorted((x["group_id"], x["row"]) for x in rows) == sorted(every_row)
    for saved in manifest.episodes:
        # Breaks if RecoveryLedger.continue_attempt or Installer.install lost the replica:
        # the next attempt is pinned to the replica that saved it, and only that replica's
        # agent holds the restored session ...
        pin = pinned[saved.rollout_id]
        assert (pin.replica, pin.attempt, pin.state) == (
            saved.replica,
            saved.attempt + 1,
            RolloutState.QUEUED,
        )
        assert placed[saved.rollout_id] == [saved.replica]
        # ... and the episode continued there, as its next attempt, to the end.
        record = final[saved.rollout_id]
        assert (record.replica, record.attempt, record.state) == (
            saved.replica,
            saved.attempt + 1,
            RolloutState.SEALED,
        )
        (line,) = [x for x in rows if x["rollout_id"] == saved.rollout_id]
        assert line["attempt"] == saved.attempt + 1
        # Continued from the saved session, not started over elsewhere: the turns before
        # the cut are the saved attempt's, and no restored session was left waiting.
        (sample,) = [x for x in hooks.samples if x.rollout_id == saved.rollout_id]
        before_cut = [c.attempt for c in sample.model_calls if c.turn < saved.turns_completed]
        assert before_cut == [saved.attempt] * saved.turns_completed
        assert left[saved.rollout_id] == []
        # Its saved policy calls went back to the model server of that replica only.
        other = next(name for name in BOTH if name != saved.replica)
        assert recorded[(other, saved.rollout_id)] == 0
        assert recorded[(saved.replica, saved.rollout_id)] >= saved.turns_completed


def holders(cluster: ScenarioCluster, rollout_id: str) -> list[str]:
    """The replicas whose agent holds a session of ``rollout_id``."""

    def holds(book: SessionBook) -> bool:
        return book.session(rollout_id) is not None

    return [rep.name for rep in cluster.replicas if rep.on_book(holds)]


async def recorded_calls(http: HttpClient, model_url: str, rollout_id: str) -> int:
    reply = await http.get_json(f"{model_url}/rollpoint/v1/calls?rollout_id={rollout_id}")
    return len(reply["calls"])
