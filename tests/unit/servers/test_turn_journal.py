"""The agent's turn journal: a session brought to its last journaled turn from its prompt or
from a snapshot's saved turn (its tools pending or applied), never past a gap or from a
later attempt; a park appends nothing; a finished reply checked against the journaled one."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from rollpoint.protocol.episode import ModelCall, RunReply, RunRow, TaskRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.episode_runner import held_calls
from rollpoint.servers.agent.session import Session, SessionRecord
from rollpoint.servers.agent.turn_journal import TurnJournal
from rollpoint.store.journal import Journal
from rollpoint.store.journal_format import journal_key
from rollpoint.store.journal_shipping import journal_relative

FOLDER = journal_relative("agent", "agent", "replica-0")


def row(attempt: int = 0) -> RunRow:
    return RunRow(
        task=TaskRow(task_id="t1", environment="workplace", prompt="Book two rooms."),
        group_id="g1",
        row=0,
        episode=EpisodeId(rollout_id="r1", attempt=attempt),
    )


def open_journal(tmp_path: Path) -> TurnJournal:
    return TurnJournal(Journal.open(str(tmp_path / FOLDER)), FOLDER)


def policy_call(session: Session, text: str, tools: bool) -> None:
    """A policy call as the runner applies it (the response pending)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools:
        message["tool_calls"] = [
            {"id": f"c{session.turn}", "type": "function", "function": {"name": "f"}}
        ]
    session.add_model_call(
        ModelCall(
            turn=session.turn,
            attempt=session.episode.attempt,
            response=message,
            completion_id=f"cmpl-{session.turn}",
        )
    )
    session.add_message(message)
    session.turn += 1
    session.pending_response = message


def tools_applied(session: Session) -> None:
    session.add_message({"role": "tool", "tool_call_id": f"c{session.turn - 1}", "content": "ok"})
    session.pending_response = None


def state(session: Session) -> tuple[Any, ...]:
    return (
        [dict(m) for m in session.messages],  # copies: the session goes on appending
        [c.model_dump() for c in session.model_calls],
        session.turn,
        session.pending_response,
    )


async def play(journal: TurnJournal, session: Session, turns: int) -> list[tuple[Any, ...]]:
    """``turns`` turns with tools, each boundary journaled; the state after each."""
    seen = []
    for i in range(turns):
        policy_call(session, f"step {i}", tools=True)
        journal.turn(session)
        seen.append(state(session))
        tools_applied(session)
        journal.turn(session)
        journal.turn(session)  # parked at the same boundary: nothing new
        seen.append(state(session))
    return seen


async def test_a_fresh_session_resumes_at_the_last_journaled_turn(tmp_path: Path) -> None:
    journal = open_journal(tmp_path)
    played = Session(row())
    await play(journal, played, 3)
    assert journal.counts.turns == 6  # two boundaries a turn; the park appended nothing
    await journal.close()

    again = open_journal(tmp_path)  # a new process
    session = Session(row(attempt=1))
    assert again.resume(session) == 3
    assert state(session) == state(played)
    assert again.resume(Session(row(attempt=1))) == 0  # used once
    await again.close()


@pytest.mark.parametrize("saved_at", [0, 1, 2, 3])
async def test_a_session_restored_at_a_snapshot_turn_goes_on_to_the_journaled_one(
    tmp_path: Path, saved_at: int
) -> None:
    """The snapshot saved the session with turn ``saved_at``'s tools pending (or at the
    start); the journal holds three turns: the session ends up where the journal does."""
    journal = open_journal(tmp_path)
    played = Session(row())
    states = await play(journal, played, 3)
    await journal.close()
    record = (
        Session(row()).to_record()
        if saved_at == 0
        else SessionRecord.model_validate(
            {
                "episode": {"rollout_id": "r1", "attempt": 0},
                "row": row().model_dump(mode="json"),
                "messages": states[2 * saved_at - 2][0],
                "turn": states[2 * saved_at - 2][2],
                "model_calls": states[2 * saved_at - 2][1],
                "pending_response": states[2 * saved_at - 2][3],
            }
        )
    )
    session = Session.from_record(record)
    session.continue_as(row(attempt=1))

    again = open_journal(tmp_path)
    again.resume(session)
    assert state(session) == state(played)
    await again.close()


async def test_a_gap_or_a_later_attempt_stops_the_resume(tmp_path: Path) -> None:
    journal = open_journal(tmp_path)
    played = Session(row(attempt=2))
    await play(journal, played, 2)
    await journal.close()

    again = open_journal(tmp_path)
    earlier = Session(row(attempt=1))  # the journal's turns are of a later attempt
    assert again.resume(earlier) == 0 and earlier.turn == 0
    await again.close()


async def test_a_reply_finished_again_is_checked_against_the_journaled_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = open_journal(tmp_path)
    session = Session(row())
    await play(journal, session, 1)
    reply = RunReply(
        episode=session.episode,
        task_id="t1",
        group_id="g1",
        row=0,
        reward=1.0,
        messages=session.messages,
        model_calls=session.model_calls,
        turns=session.turn,
        finish_reason="final",
    )
    await journal.reply(reply)
    await journal.close()

    again = open_journal(tmp_path)
    other = reply.model_copy(
        update={"episode": EpisodeId(rollout_id="r1", attempt=1), "reward": 0.0}
    )
    with caplog.at_level(logging.WARNING, logger="rollpoint.servers.agent.turn_journal"):
        again.check(other)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "r1#1" in warning and "reward 0.0" in warning and "reward 1.0" in warning
    assert again.counts.adopted == 1
    await again.close()


async def test_a_turn_is_queued_without_waiting_and_durable_before_its_reply(
    tmp_path: Path,
) -> None:
    """A boundary does not wait for its turn's fsync; the finished reply, which is awaited,
    is durable only after every turn record before it."""
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def held_fsync(fd: int) -> None:
        if armed.is_set():  # not while the journal opens (its first segment's header)
            entered.set()
            release.wait(30)
        os.fsync(fd)

    journal = TurnJournal(Journal.open(str(tmp_path / FOLDER), fsync=held_fsync), FOLDER)
    armed.set()
    session = Session(row())
    policy_call(session, "done", tools=False)
    journal.turn(session)  # returns with its record queued, the fsync held
    await asyncio.to_thread(entered.wait, 30)
    assert journal.journal.lookup(journal_key("agent", "r1", 0, 0)) is None
    reply = asyncio.create_task(
        journal.reply(
            RunReply(
                episode=session.episode,
                task_id="t1",
                group_id="g1",
                row=0,
                reward=1.0,
                messages=session.messages,
                model_calls=session.model_calls,
                turns=session.turn,
                finish_reason="final",
            )
        )
    )
    await asyncio.sleep(0)
    assert not reply.done()
    release.set()
    await reply
    assert journal.journal.lookup(journal_key("agent", "r1", 0, 0)) is not None
    await journal.close()


def test_a_continued_session_names_the_tool_calls_whose_results_it_holds() -> None:
    """What the agent's episode start tells the resources server it holds (the server
    refuses to continue without them): each applied turn's routable calls, not the pending
    turn's (its tools not applied yet), nor a call whose name no route takes (answered by
    the agent itself)."""
    session = Session(row())
    assert held_calls(session) == []
    policy_call(session, "step 0", tools=True)
    assert held_calls(session) == []  # turn 0's tools pending
    tools_applied(session)
    assert held_calls(session) == [(0, 0)]
    policy_call(session, "step 1", tools=True)
    session.model_calls[1].response["tool_calls"].append(  # type: ignore[union-attr]
        {"id": "bad", "type": "function", "function": {"name": "no such/tool"}}
    )
    session.model_calls[1].response["tool_calls"].append(  # type: ignore[union-attr]
        {"id": "c1b", "type": "function", "function": {"name": "g"}}
    )
    tools_applied(session)
    assert held_calls(session) == [(0, 0), (1, 0), (1, 2)]
    policy_call(session, "the answer", tools=False)
    assert held_calls(session) == [(0, 0), (1, 0), (1, 2)]
