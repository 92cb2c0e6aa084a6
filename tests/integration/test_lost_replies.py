"""Lost replies on real servers: retire first, then adopt what had finished or re-send fresh.

A proxy in front of an agent drops one row's result line on purpose, after the agent
finished the row, and ends the stream there: the reply is lost on the wire while the agent
holds it. The trainer must fetch that reply (same rollout id and attempt, nothing rerun),
seal and ack it, re-send fresh only the rows that were still running (after retiring their
old tries), and keep every later snapshot committing with no reply left stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rollpoint.app.config import RunConfig, SnapshotConfig, TrainConfig
from rollpoint.http.app import create_app
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.episode import RunReply, RunRequest
from rollpoint.protocol.ids import EpisodeId, new_rollout_id
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.servers.model.model_server import model_server_of
from rollpoint.testing.local_cluster import LocalCluster, LocalReplica, ThreadServer
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from rollpoint.trainer.train_hooks import TrainSample
from rollpoint.trainer.trainer import Trainer
from tests.support.direct_play import play, play_directly
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

TOKEN = "lost-replies-test-token"


@dataclass
class LossyAgent:
    """A ``/run`` proxy that loses one row's result once: it waits for the line (the agent
    has finished that row and holds its reply), drops it and ends the stream right there."""

    upstream: str
    lose_at: Callable[[int], int | None]
    """Rows in a request -> index of the result line to lose, or None to pass it through."""
    lost: list[tuple[EpisodeId, float]] = field(default_factory=list)
    """What was lost, and when (Unix time)."""
    server: ThreadServer | None = None
    spent: bool = False

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self) -> None:
        self.server = ThreadServer(self._app())

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _app(self) -> FastAPI:
        http: list[HttpClient] = []

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            http.append(HttpClient())
            yield
            await http[0].aclose()

        app = create_app("lossy agent proxy", lifespan=lifespan)

        @app.post("/run")
        async def run(request: Request) -> StreamingResponse:
            body = orjson.loads(await request.body())
            rows = len(RunRequest.model_validate(body).rows)
            lose = None if self.spent else self.lose_at(rows)
            self.spent = self.spent or lose is not None
            return StreamingResponse(self._relay(http[0], body, lose))

        return app

    async def _relay(self, http: HttpClient, body: Any, lose: int | None) -> AsyncIterator[bytes]:
        index = 0
        async for line in http.stream_ndjson(f"{self.upstream}/run", body):
            if index == lose:
                episode = EpisodeId.model_validate(line["episode"])
                self.lost.append((episode, time.time()))
                return  # the stream is cut here: the agent finished this row, we saw nothing
            index += 1
            yield orjson.dumps(line) + b"\n"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    root = str(tmp_path / "snapshots")
    with LocalCluster(replicas=1, latency_ms=5.0, snapshot_root=root) as c:
        try:
            yield c
        finally:
            for replica in c.replicas:
                replica.on_gate(lambda gate: gate.open())


@contextlib.contextmanager
def lossy(replica: LocalReplica, lose_at: Callable[[int], int | None]) -> Iterator[LossyAgent]:
    proxy = LossyAgent(replica.agent.url, lose_at)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def held_replies(replica: LocalReplica) -> list[str]:
    return replica.on_book(lambda book: sorted(e.key for e in book.finished_unacked()))


def agent_holds(replica: LocalReplica, rollout_id: str) -> tuple[bool, int | None]:
    """Whether the agent runs a session of the rollout, and its retire mark there."""
    return replica.on_book(
        lambda book: (book.session(rollout_id) is not None, book.retire_mark(rollout_id))
    )


def calls_total(replica: LocalReplica) -> int:
    return replica.model.call(lambda: model_server_of(replica.model.app).calls_total)


class RecordingHooks:
    def __init__(self) -> None:
        self.samples: list[TrainSample] = []

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        self.samples.extend(batch)
        return {"loss": 0.0}


async def test_a_reply_lost_after_the_agent_finished_is_adopted_and_snapshots_keep_committing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    (replica,) = cluster.replicas
    config = RunConfig(
        workdir=tmp_path / "run",
        environment="workplace",
        group_size=2,
        replicas=1,
        concurrency=4,
        max_turns=12,
        train=TrainConfig(batch_size=4),
        snapshot=SnapshotConfig(every_seconds=0.1, deadline_seconds=5, keep=100),
    )
    hooks = RecordingHooks()
    with lossy(replica, lambda rows: rows - 1 if rows >= 2 else None) as proxy:
        async with HttpClient(token=TOKEN) as http:
            control = cluster.control_plane(http, tmp_path)
            trainer = Trainer(
                config.trainer_settings(),
                cluster.deployment(**{replica.name: proxy.url}),
                cluster.tasks(10),
                hooks=hooks,
                control=control,
            )
            summary = await asyncio.wait_for(trainer.run(), 30)
            control.metrics.close()

    assert summary.episodes == 20 and not summary.failed_groups
    assert trainer.dispatcher is not None and trainer.coordinator is not None
    ((lost, lost_at),) = proxy.lost
    record = trainer.ledger.get(lost.rollout_id)
    # The row was sealed under the try that was lost: same rollout id, same attempt, first try.
    assert (record.state, record.attempt, record.tries) == (RolloutState.SEALED, 0, 1)
    assert trainer.ledger.current(record.group_id, record.row).rollout_id == lost.rollout_id
    assert trainer.dispatcher.adopted == 1
    assert trainer.dispatcher.resent_fresh == 0
    trained = {(s.rollout_id, s.attempt) for s in hooks.samples}
    assert (lost.rollout_id, lost.attempt) in trained and len(trained) == 20
    # Nothing was rerun: every policy call the model server ever served is one of the
    # trained episodes' calls.
    assert calls_total(replica) == sum(len(s.model_calls) for s in hooks.samples)
    # Snapshots went on committing after the loss, and no reply is left on the agent.
    history = trainer.coordinator.history
    assert history and all(r.published for r in history), [r.blocked_by for r in history]
    after = [r for r in history if r.manifest is not None and r.manifest.created_at > lost_at]
    assert len(after) >= 3
    assert held_replies(replica) == []


async def test_a_cut_stream_adopts_the_finished_row_and_resends_only_the_running_ones(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    (replica,) = cluster.replicas
    with lossy(replica, lambda rows: 1 if rows == 4 else None) as proxy:
        async with (
            HttpClient(token=TOKEN) as http,
            dispatcher_with_control(
                cluster, http, tmp_path, run_urls={replica.name: proxy.url}
            ) as h,
        ):
            first = h.add_group(cluster)
            # Rows 0 and 1 already finished on the agent: the stream returns them at once
            # (the proxy loses row 1's line and cuts the stream) while rows 2 and 3 are held
            # at their first policy call, still running.
            await play_directly(h.ledger, replica.agent.url, rows=[0, 1])
            replica.on_gate(lambda gate: gate.close())
            run = asyncio.create_task(h.dispatcher.run_group("g"))
            await eventually(
                lambda: h.dispatcher.resent_fresh == 2, "the two running rows re-sent fresh"
            )
            # The running rows' old tries were retired (cancelled on the agent) before their
            # rows went out again: none waits in the retire queue, the agent runs neither.
            for old in first[2:]:
                assert h.ledger.get(old).state is RolloutState.RETIRED
                assert agent_holds(replica, old) == (False, 0)  # no session; marked retired
            assert h.dispatcher.retire_queue == set()
            replica.on_gate(lambda gate: gate.open())
            outcome = await asyncio.wait_for(run, 10)
            await h.releases.flush()

    assert outcome.ok
    ((lost, _),) = proxy.lost
    assert lost.rollout_id == first[1]
    rows = [h.ledger.current("g", row) for row in range(4)]
    assert [r.state for r in rows] == [RolloutState.SEALED] * 4
    # Rows 0 and 1 (the lost one adopted, not rerun) kept their first ids...
    assert [(r.rollout_id, r.attempt, r.tries) for r in rows[:2]] == [
        (first[0], 0, 1),
        (first[1], 0, 1),
    ]
    # ...and only the rows that never came back went out again, under new ids.
    for row in rows[2:]:
        assert row.rollout_id not in first and row.tries == 2
    assert h.dispatcher.adopted == 1
    assert sorted(r.episode.rollout_id for r in h.replies) == sorted(r.rollout_id for r in rows)
    assert held_replies(replica) == []


async def test_finished_replies_no_current_try_wants_are_acked_away_at_the_next_snapshot(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    (replica,) = cluster.replicas
    config = RunConfig(
        workdir=tmp_path / "run",
        environment="workplace",
        group_size=4,
        replicas=1,
        concurrency=4,
        max_turns=12,
        snapshot=SnapshotConfig(every_seconds=None, deadline_seconds=5),
    )
    async with HttpClient(token=TOKEN) as http:
        control = cluster.control_plane(http, tmp_path)
        (task,) = cluster.tasks(1)
        trainer = Trainer(
            config.trainer_settings(),
            cluster.deployment(),
            [task],
            hooks=SimulatedTrainer(),
            control=control,
        )
        ledger, gid = trainer.ledger, f"{task.task_id}-g0"
        # Row 0: a try the trainer gave up on (its row went on under a new id) that then
        # finished on the agent anyway.
        given_up = ledger.dispatch(ledger.current(gid, 0).rollout_id, replica.name)
        ledger.abandon(given_up.rollout_id)
        # Row 1: the current try, on the wire: finished on the agent, reply not arrived.
        on_the_wire = ledger.dispatch(ledger.current(gid, 1).rollout_id, replica.name)
        # A try the trainer never knew (a previous run's, say).
        unknown = EpisodeId(rollout_id=new_rollout_id(), attempt=0)
        await play(
            replica.agent.url,
            [
                (given_up.episode, given_up.group_id, given_up.row),
                (on_the_wire.episode, on_the_wire.group_id, on_the_wire.row),
                (unknown, gid, 2),
            ],
            task=task,
        )
        assert len(held_replies(replica)) == 3

        coordinator = trainer.coordinator
        assert coordinator is not None
        # Without it the release batcher's flush would retire the given-up try first (and
        # ack its reply away itself: the test below); here prepare must find it.
        coordinator.before_save = None
        await coordinator.discover()
        first = await coordinator.save()
        second = await coordinator.save()
        control.metrics.close()

    assert first.published and second.published, (first.blocked_by, second.blocked_by)
    assert (first.acked_away, second.acked_away) == (2, 0)
    # The current try's reply is kept, exported with the cut and listed as finished.
    assert held_replies(replica) == [on_the_wire.key]
    for report in (first, second):
        assert report.manifest is not None
        assert [e.rollout_id for e in report.manifest.finished] == [on_the_wire.rollout_id]


async def test_the_release_batcher_acks_away_the_reply_of_a_given_up_try_it_retires(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    (replica,) = cluster.replicas
    async with HttpClient(token=TOKEN) as http:
        control = cluster.control_plane(http, tmp_path)
        ledger = RecoveryLedger()
        (task,) = cluster.tasks(1)
        ledger.add_group(task, "g", 2)
        # The dispatcher gave up on it without an answer from the agent (fallback path),
        # and the agent finished it anyway.
        given_up = ledger.dispatch(ledger.current("g", 0).rollout_id, replica.name)
        ledger.abandon(given_up.rollout_id)
        await play(replica.agent.url, [(given_up.episode, "g", 0)], task=task)
        releases = ReleaseBatcher(control.participants, ledger)
        await releases.flush()
        control.metrics.close()

    assert ledger.get(given_up.rollout_id).state is RolloutState.RETIRED
    assert (releases.retired, releases.acked_away) == (1, 1)
    assert held_replies(replica) == []


async def test_with_its_agent_unreachable_a_given_up_try_is_resent_fresh_and_left_to_retire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    with LocalCluster(
        replicas=2, latency_ms=5.0, snapshot_root=str(tmp_path / "snapshots")
    ) as cluster:
        r0 = cluster.replicas[0]
        processes = ProcessGroup(tmp_path / "logs", env={CONTROL_TOKEN_ENV: TOKEN})
        try:
            spec = ServerSpec(
                kind="agent", name="agent-replica-0", settings=cluster.agent_settings(0)
            )
            (agent,) = await processes.start([spec])
            async with (
                HttpClient(token=TOKEN) as http,
                dispatcher_with_control(
                    cluster, http, tmp_path, agent_urls={r0.name: agent.url}
                ) as h,
            ):
                first = h.add_group(cluster)
                r0.on_gate(lambda gate: gate.close())  # every row held at its first call
                run = asyncio.create_task(h.dispatcher.run_group("g"))
                await eventually(
                    lambda: h.ledger.in_flight_count(r0.name) == 4,
                    "all four rows in flight on replica-0",
                )
                agent.process.kill()  # mid-stream: no one is left to answer the retire
                outcome = await asyncio.wait_for(run, 10)
                await h.releases.flush()  # still unreachable: the retire stays queued
        finally:
            r0.on_gate(lambda gate: gate.open())
            await processes.stop()

    assert outcome.ok
    rows = [h.ledger.current("g", row) for row in range(4)]
    assert all(r.state is RolloutState.SEALED and r.tries == 2 for r in rows)
    assert {r.replica for r in rows} == {"replica-1"}
    assert h.dispatcher.adopted == 0
    assert {e.rollout_id for e in h.dispatcher.retire_queue} == set(first)
    assert all(h.ledger.get(rid).state is RolloutState.ABANDONED for rid in first)


# --- helpers -------------------------------------------------------------------------


@dataclass
class DispatchHarness:
    ledger: RecoveryLedger
    barrier: DispatchBarrier
    releases: ReleaseBatcher
    dispatcher: Dispatcher
    replies: list[RunReply]

    def add_group(self, cluster: LocalCluster, size: int = 4) -> list[str]:
        (task,) = cluster.tasks(1)
        return [r.rollout_id for r in self.ledger.add_group(task, "g", size)]


@asynccontextmanager
async def dispatcher_with_control(
    cluster: LocalCluster,
    http: HttpClient,
    tmp_path: Path,
    *,
    run_urls: dict[str, str] | None = None,
    agent_urls: dict[str, str] | None = None,
) -> AsyncIterator[DispatchHarness]:
    """A dispatcher that retires through a release batcher, as the trainer wires it.

    ``agent_urls`` replaces agents (started elsewhere) for everything; ``run_urls`` only
    where ``/run`` goes (a proxy), control calls still reaching the agent itself."""
    ledger, barrier, replies = RecoveryLedger(), DispatchBarrier(), []
    agents = agent_urls or {}
    control = cluster.control_plane(http, tmp_path, agent_urls=agents)
    roster = ReplicaRoster.of_deployment(
        cluster.deployment(**{**agents, **(run_urls or {})}), control.participants
    )
    releases = ReleaseBatcher(roster, ledger, barrier=barrier)

    async def on_reply(reply: RunReply) -> None:
        record = ledger.seal(reply.episode.rollout_id)
        assert record.replica is not None
        releases.sealed(reply.episode, record.replica)
        replies.append(reply)

    async with HttpClient() as data:
        dispatcher = Dispatcher(
            ledger,
            roster.deployment(),
            data,
            concurrency=8,
            max_turns=12,
            row_timeout_s=30,
            barrier=barrier,
            on_reply=on_reply,
            roster=roster,
            releases=releases,
        )
        try:
            yield DispatchHarness(ledger, barrier, releases, dispatcher, replies)
        finally:
            await dispatcher.aclose()
            control.metrics.close()
