"""The session book: row admission, task ownership, parking, readiness, export/install, retire.

The play function is a stand-in for the episode runner with the same boundary points, so
the book is tested without sockets; the real runner is exercised in
``tests/integration/test_agent_server.py``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.participant import RetireMarks, control_fence
from rollpoint.protocol.control import ForgetRequest, RetireOutcomeKind, RetireRequest
from rollpoint.protocol.episode import (
    ModelCall,
    RowFailure,
    RowRefused,
    RowResult,
    RunReply,
    RunRow,
    TaskRow,
)
from rollpoint.protocol.errors import (
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
    RollpointError,
    TransportError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.agent.agent_server import AgentSettings, agent_server_of, create_agent_app
from rollpoint.servers.agent.play_contract import TurnBoundary
from rollpoint.servers.agent.session import Session, SessionState
from rollpoint.servers.agent.session_book import SessionBook
from rollpoint.servers.agent.session_parts import join_parts
from tests.support.records import read_back

S = SessionState


def _row(rollout_id: str, attempt: int = 0, env: str = "workplace", row: int = 0) -> RunRow:
    return RunRow.model_validate(
        {
            "task": {"task_id": "t1", "environment": env, "prompt": "Do the task."},
            "group_id": "g1",
            "row": row,
            "episode": {"rollout_id": rollout_id, "attempt": attempt},
        }
    )


class FakePlay:
    """Plays ``turns`` policy calls, each with one tool call, at the runner's boundary points.

    ``model`` and ``tools`` are gates (set = pass) for the policy call (from turn
    ``model_gate_from`` on) and the tool step.
    """

    def __init__(self, turns: int = 2, error: RollpointError | None = None) -> None:
        self.turns = turns
        self.error = error
        self.model = asyncio.Event()
        self.model.set()
        self.tools = asyncio.Event()
        self.tools.set()
        self.model_gate_from = 0
        self.plays = 0
        self.policy_calls: list[tuple[str, int]] = []

    async def __call__(self, session: Session, boundary: TurnBoundary) -> RunReply:
        self.plays += 1
        if self.error is not None:
            raise self.error
        while True:
            await boundary(session)
            if session.pending_response is not None:
                session.move(S.RUNNING_TOOLS)
                await self.tools.wait()
                session.messages.append({"role": "tool", "tool_call_id": "c", "content": "ok"})
                session.pending_response = None
                continue
            if session.turn >= self.turns:
                session.move(S.VERIFYING)
                return self._reply(session)
            session.move(S.AWAITING_MODEL)
            if session.turn >= self.model_gate_from:
                await self.model.wait()
            await boundary.hold_reply(session)
            message: dict[str, Any] = {"role": "assistant", "content": f"turn {session.turn}"}
            self.policy_calls.append((session.key, session.turn))
            session.model_calls.append(
                ModelCall(turn=session.turn, attempt=session.episode.attempt, response=message)
            )
            session.messages.append(message)
            session.turn += 1
            session.pending_response = message

    @staticmethod
    def _reply(session: Session) -> RunReply:
        return RunReply(
            episode=session.episode,
            task_id=session.row.task.task_id,
            group_id=session.row.group_id,
            row=session.row.row,
            reward=1.0,
            messages=session.messages,
            model_calls=session.model_calls,
            turns=session.turn,
            finish_reason="max_turns",
        )


async def _settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def _result(future: asyncio.Future[RowResult]) -> RowResult:
    return await asyncio.wait_for(asyncio.shield(future), 2)


def _book(play: FakePlay, **kw: Any) -> SessionBook:
    return SessionBook(play, environment="workplace", **kw)


async def test_rows_run_as_tasks_of_the_book_and_finished_replies_are_held() -> None:
    play = FakePlay()
    book = _book(play)
    futures = [book.submit(_row(f"r{i}")) for i in range(3)]
    results = [await _result(f) for f in futures]
    assert all(isinstance(r, RunReply) and r.turns == 2 for r in results)
    assert {e.key for e in book.finished_unacked()} == {"r0#0", "r1#0", "r2#0"}
    assert book.counts()["live"] == 0


async def test_a_finished_row_sent_again_returns_the_stored_reply_without_running() -> None:
    play = FakePlay()
    book = _book(play)
    first = await _result(book.submit(_row("r1")))
    again = await _result(book.submit(_row("r1")))
    assert again == first
    assert play.plays == 1 and len(play.policy_calls) == 2


async def test_a_running_row_sent_again_joins_the_same_session() -> None:
    play = FakePlay()
    play.model.clear()
    book = _book(play)
    first = book.submit(_row("r1"))
    await _settle()
    second = book.submit(_row("r1"))
    assert second is first
    play.model.set()
    assert isinstance(await _result(second), RunReply)
    assert play.plays == 1


async def test_a_row_of_another_environment_is_a_data_failure_naming_both() -> None:
    book = _book(FakePlay())
    result = await _result(book.submit(_row("r1", env="math")))
    assert isinstance(result, RowFailure) and not result.transport
    assert "'math'" in result.message and "'workplace'" in result.message


@pytest.mark.parametrize(
    ("error", "transport"),
    [(TransportError("model server down"), True), (NotFoundError("unknown episode"), False)],
)
async def test_a_failed_row_never_ends_its_siblings(error: RollpointError, transport: bool) -> None:
    good, bad = FakePlay(), FakePlay(error=error)

    async def play(session: Session, boundary: TurnBoundary) -> RunReply:
        chosen = bad if session.episode.rollout_id == "bad" else good
        return await chosen(session, boundary)

    book = SessionBook(play, environment="workplace")
    failed, fine = book.submit(_row("bad")), book.submit(_row("good"))
    failure = await _result(failed)
    assert isinstance(failure, RowFailure)
    assert (failure.transport, failure.code) == (transport, error.code)
    assert isinstance(await _result(fine), RunReply)
    assert book.finished_unacked() == [EpisodeId(rollout_id="good")]


async def test_closed_boundaries_park_sessions_refuse_new_rows_and_reopening_finishes() -> None:
    play = FakePlay()
    play.tools.clear()
    book = _book(play)
    running = [book.submit(_row(f"r{i}")) for i in range(2)]
    await _settle()
    book.close_boundaries()
    play.tools.set()  # the tool steps end while closed: the sessions park at the next boundary
    await _settle()
    assert book.counts()[S.PARKED] == 2
    assert all(book.session(f"r{i}").turn == 1 for i in range(2))  # type: ignore[union-attr]
    assert book.readiness().ready

    refused = await _result(book.submit(_row("late")))
    assert isinstance(refused, RowRefused) and refused.episode.rollout_id == "late"
    assert book.session("late") is None

    book.open_boundaries()
    assert all(isinstance(r, RunReply) for r in [await _result(f) for f in running])


async def test_readiness_counts_busy_sessions_as_blockers_and_wait_changed_wakes() -> None:
    play = FakePlay()
    play.tools.clear()
    book = _book(play)
    future = book.submit(_row("r1"))
    await _settle()
    book.close_boundaries()
    report = book.readiness()
    assert not report.ready
    assert (report.blockers, report.blocker_count) == (["r1#0"], 1)
    assert report.counts[S.RUNNING_TOOLS] == 1

    watcher = asyncio.create_task(book.wait_changed(5))
    await _settle()
    assert not watcher.done()
    play.tools.set()  # the tool step ends; the next boundary parks the session
    assert await asyncio.wait_for(watcher, 1)
    await _settle()
    assert book.readiness().ready
    assert book.counts()[S.PARKED] == 1
    book.open_boundaries()
    await _result(future)


async def test_awaiting_a_held_policy_call_counts_as_at_a_boundary() -> None:
    play = FakePlay()
    play.model.clear()
    book = _book(play)
    book.submit(_row("r1"))
    await _settle()
    assert book.counts()[S.AWAITING_MODEL] == 1
    book.close_boundaries()
    assert book.readiness().ready
    await book.aclose()


async def test_export_then_install_continues_from_the_saved_turn() -> None:
    play = FakePlay(turns=3)
    play.model.clear()
    play.model_gate_from = 1
    book = _book(play)
    book.submit(_row("r1"))
    await _settle()
    # Turn 0 is done (tools applied); turn 1's policy call runs. Cut, then let it answer:
    # the reply is held unapplied, so the session is saved as before turn 1.
    assert play.policy_calls == [("r1#0", 0)]
    book.close_boundaries()
    play.model.set()
    await _settle()
    assert book.session("r1").state is S.AWAITING_MODEL  # type: ignore[union-attr]
    records = read_back(book.export([EpisodeId(rollout_id="r1")]))
    saved = [r for r in records if r["kind"] == "session"]
    assert len(saved) == 1
    assert (saved[0]["turn"], saved[0]["pending_response"]) == (1, None)
    await book.aclose()

    play2 = FakePlay(turns=3)
    fresh = _book(play2)
    assert fresh.install(records) == [EpisodeId(rollout_id="r1", attempt=1)]
    assert fresh.counts()[S.RESTORED] == 1
    assert fresh.readiness().ready

    stale = await _result(fresh.submit(_row("r1", attempt=0)))
    assert isinstance(stale, RowFailure) and stale.code == "attempt_conflict"
    reply = await _result(fresh.submit(_row("r1", attempt=1)))
    assert isinstance(reply, RunReply)
    assert reply.episode == EpisodeId(rollout_id="r1", attempt=1)
    assert [(c.turn, c.attempt) for c in reply.model_calls] == [(0, 0), (1, 1), (2, 1)]
    # Turn 0 (done before the cut) is not played again; turn 1 (running at the cut) is.
    assert play2.policy_calls == [("r1#1", 1), ("r1#1", 2)]
    tool_results = [m for m in reply.messages if m["role"] == "tool"]
    assert len(tool_results) == 3


async def test_a_reply_landing_during_a_cut_is_applied_once_it_reopens() -> None:
    play = FakePlay(turns=2)
    play.model.clear()
    book = _book(play)
    future = book.submit(_row("r1"))
    await _settle()
    book.close_boundaries()
    play.model.set()
    await _settle()
    session = book.session("r1")
    assert session is not None
    assert (session.state, session.turn, session.pending_response) == (S.AWAITING_MODEL, 0, None)
    assert book.readiness().ready
    book.open_boundaries()
    reply = await _result(future)
    assert isinstance(reply, RunReply) and reply.turns == 2
    # The held reply was applied, not asked for again.
    assert play.policy_calls == [("r1#0", 0), ("r1#0", 1)]


async def test_export_refuses_a_scoped_session_that_is_not_at_a_boundary() -> None:
    play = FakePlay()
    play.tools.clear()
    book = _book(play)
    book.submit(_row("r1"))
    await _settle()
    with pytest.raises(InvalidPhaseError, match="r1#0 is running_tools"):
        book.export([EpisodeId(rollout_id="r1")])
    await book.aclose()


async def test_export_includes_held_replies_and_install_holds_them_again() -> None:
    book = _book(FakePlay())
    await _result(book.submit(_row("done")))
    records = read_back(book.export([]))
    assert [r["kind"] for r in records] == ["finished_reply"]
    fresh = _book(FakePlay())
    assert fresh.install(records) == []
    assert fresh.finished_unacked() == [EpisodeId(rollout_id="done")]


async def test_an_export_reuses_the_records_of_what_did_not_change_and_never_changes_them() -> None:
    play = FakePlay(turns=3)
    book = _book(play)
    await _result(book.submit(_row("done")))
    play.model.clear()
    play.model_gate_from = 1
    book.submit(_row("a"))
    book.submit(_row("b"))
    await _settle()
    scope = [EpisodeId(rollout_id="a"), EpisodeId(rollout_id="b")]
    first = (await book.capture(scope))()
    kept = read_back(first)
    # Session a makes its next policy call and gets the reply (as the runner does).
    a = book.session("a")
    assert a is not None and a.at_boundary
    message: dict[str, Any] = {"role": "assistant", "content": "turn 1"}
    a.model_calls.append(ModelCall(turn=1, attempt=0, response=message))
    a.messages.append(message)
    a.turn += 1
    a.pending_response = message
    second = (await book.capture(scope))()
    assert read_back(first) == kept  # what the first export handed out did not change
    assert [r["kind"] for r in second] == ["session", "session", "finished_reply"]
    assert (second[0]["turn"], second[0]["pending_response"]) == (2, message)
    assert join_parts(read_back(second))[0] == a.to_record().model_dump(mode="json")
    assert second[0] is not first[0]
    assert second[1] is first[1]  # b did not change: its record is handed out again
    assert second[2] is first[2]  # nor did the held reply
    book.ack([EpisodeId(rollout_id="done")])
    assert [r["kind"] for r in (await book.capture(scope))()] == ["session", "session"]
    await book.aclose()


async def test_install_is_all_or_nothing() -> None:
    play = FakePlay()
    play.model.clear()
    source = _book(play)
    source.submit(_row("a"))
    source.submit(_row("b"))
    await _settle()
    records = read_back(source.export([EpisodeId(rollout_id="a"), EpisodeId(rollout_id="b")]))
    await source.aclose()

    target = _book(FakePlay())
    broken = [records[0], {**records[1], "turn": "many"}]
    with pytest.raises(InvalidCheckpointStateError, match="turn"):
        target.install(broken)
    assert target.counts()["live"] == 0

    blocker = FakePlay()
    blocker.model.clear()
    busy = _book(blocker)
    busy.submit(_row("b"))
    await _settle()
    with pytest.raises(InvalidCheckpointStateError, match="rollout b is running here"):
        busy.install(records)
    assert busy.session("a") is None
    await busy.aclose()


async def test_install_keeps_only_the_scope_when_given() -> None:
    play = FakePlay()
    play.model.clear()
    source = _book(play)
    source.submit(_row("a"))
    source.submit(_row("b"))
    await _settle()
    records = read_back(source.export([EpisodeId(rollout_id="a"), EpisodeId(rollout_id="b")]))
    await source.aclose()
    target = _book(FakePlay())
    assert target.install(records, scope=[EpisodeId(rollout_id="b")]) == [
        EpisodeId(rollout_id="b", attempt=1)
    ]
    assert target.session("a") is None


async def test_retire_cancels_running_reports_finished_and_refuses_later_calls() -> None:
    play = FakePlay()
    book = _book(play)
    await _result(book.submit(_row("done")))
    play.model.clear()
    running = book.submit(_row("run"))
    await _settle()

    # As the fence does: raise the marks (the one copy, which the book reads), then retire.
    outcomes = book.retire(book.marks.raise_to({"run": 0, "done": 0, "ghost": 2}))
    by_key = {o.episode.key: o.outcome for o in outcomes}
    assert by_key == {
        "run#0": RetireOutcomeKind.CANCELLED,
        "done#0": RetireOutcomeKind.FINISHED_UNACKED,
        "ghost#2": RetireOutcomeKind.UNKNOWN,
    }
    cancelled = await _result(running)
    assert isinstance(cancelled, RowFailure) and cancelled.code == "cancelled"
    assert book.session("run") is None

    refused = await _result(book.submit(_row("run", attempt=0)))
    assert isinstance(refused, RowFailure) and refused.code == "stale_attempt"
    # A retired attempt that finished is still fetched by a re-send: no rerun.
    assert isinstance(await _result(book.submit(_row("done"))), RunReply)
    # The next attempt is admitted.
    play.model.set()
    assert isinstance(await _result(book.submit(_row("run", attempt=1))), RunReply)

    assert book.marks.drop(["run", "never"]) == ["run"]
    assert book.retire_mark("run") is None


async def test_admission_reads_the_marks_it_holds_and_keeps_none_of_its_own() -> None:
    book = _book(FakePlay())
    shared = RetireMarks()
    book.marks = shared
    shared.raise_to({"r": 1})  # raised by their owner only: the book's retire never ran
    refused = await _result(book.submit(_row("r", attempt=1)))
    assert isinstance(refused, RowFailure) and refused.code == "stale_attempt"
    assert book.counts()["retired_rollouts"] == 1
    # Retiring through the book writes no mark: a second copy could drift from the fence's.
    book.retire({"q": 0})
    assert shared.get("q") is None and book.retire_mark("q") is None


async def test_the_agent_server_reads_its_fences_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "book-marks-token-0123456789")
    settings = AgentSettings(
        model_url="http://127.0.0.1:9",
        resources_url="http://127.0.0.1:9",
        environment="workplace",
        snapshot_root=str(tmp_path),
    )
    app = create_agent_app(settings)
    fence = control_fence(app)
    assert fence is not None
    book = agent_server_of(app).book
    assert book.marks is fence.marks
    await fence.retire(RetireRequest(episode_ids=[EpisodeId(rollout_id="r", attempt=1)]))
    refused = await _result(book.submit(_row("r", attempt=1)))
    assert isinstance(refused, RowFailure) and refused.code == "stale_attempt"
    await fence.forget(ForgetRequest(rollout_ids=["r"]))
    assert book.retire_mark("r") is None
    await fence.aclose()


async def test_ack_releases_held_replies_and_is_idempotent() -> None:
    book = _book(FakePlay())
    await _result(book.submit(_row("r1")))
    episode = EpisodeId(rollout_id="r1")
    assert book.ack([episode]) == [episode]
    assert book.ack([episode]) == []
    assert book.finished_unacked() == []


async def test_the_bound_on_held_replies_drops_the_oldest_and_warns_per_thousand(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = _book(FakePlay(turns=0), max_finished_replies=2)
    caplog.set_level(logging.WARNING, logger="rollpoint.servers.agent.session_book")
    for i in range(1004):
        await _result(book.submit(_row(f"r{i}")))
    assert [e.rollout_id for e in book.finished_unacked()] == ["r1002", "r1003"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "dropped 1 finished" in warnings[0] and "dropped 1001 finished" in warnings[1]


async def test_restart_only_reports_restarts_never_blocks_and_exports_no_sessions() -> None:
    play = FakePlay()
    play.tools.clear()
    book = _book(play, mode=CheckpointMode.RESTART_ONLY)
    book.submit(_row("r1"))
    await _settle()
    assert book.counts()[S.RUNNING_TOOLS] == 1
    report = book.readiness()
    assert report.ready and report.blocker_count == 0
    assert report.restarts == [EpisodeId(rollout_id="r1")]
    assert book.export([EpisodeId(rollout_id="r1")]) == []
    session_record = {
        "kind": "session",
        "episode": {"rollout_id": "x", "attempt": 0},
        "row": _row("x").model_dump(mode="json"),
        "messages": [],
        "turn": 0,
        "model_calls": [],
    }
    with pytest.raises(InvalidCheckpointStateError, match="restart_only"):
        book.install([session_record])
    await book.aclose()


async def test_aclose_cancels_running_sessions() -> None:
    play = FakePlay()
    play.model.clear()
    book = _book(play)
    future = book.submit(_row("r1"))
    await _settle()
    await book.aclose()
    result = await _result(future)
    assert isinstance(result, RowFailure) and result.transport
    assert book.counts()["live"] == 0


def test_task_rows_are_valid() -> None:
    # Guard the helper: a typo in the row builder would make every test above meaningless.
    assert _row("r1").task == TaskRow(task_id="t1", environment="workplace", prompt="Do the task.")


async def test_a_capture_builds_what_the_plain_export_returns() -> None:
    play = FakePlay()
    play.model.clear()
    book = _book(play)
    count = 300
    for i in range(count):
        book.submit(_row(f"r{i}"))
    await _settle()
    book.close_boundaries()
    scope = [EpisodeId(rollout_id=f"r{i}") for i in range(count)]
    records = (await book.capture(scope))()
    assert read_back(records) == read_back(book.export(scope))
    assert [r["episode"]["rollout_id"] for r in records] == [f"r{i}" for i in range(count)]  # type: ignore[index]
    await book.aclose()
