"""A saved session as a header and full transcript parts: parts made once, joined back whole."""

from __future__ import annotations

from typing import Any

import pytest

from rollpoint.protocol.episode import ModelCall, RunRow, TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.session import Session
from rollpoint.servers.agent.session_parts import PART_ITEMS, join_parts
from tests.support.records import read_back


def _session(turns: int) -> Session:
    row = RunRow(
        task=TaskRow(task_id="t1", environment="workplace", prompt="Schedule it."),
        group_id="g1",
        row=0,
        episode=EpisodeId(rollout_id="r1", attempt=0),
    )
    session = Session(row)
    for _ in range(turns):
        _turn(session)
    return session


def _turn(session: Session) -> None:
    message: dict[str, Any] = {"role": "assistant", "content": f"turn {session.turn}"}
    session.add_model_call(ModelCall(turn=session.turn, attempt=0, response=message))
    session.add_message(message)
    session.add_message({"role": "tool", "content": "done", "tool_call_id": "c"})
    session.turn += 1


def test_a_long_session_saves_full_parts_once_and_a_header_of_the_rest() -> None:
    session = _session(10)  # 21 messages, 10 calls

    header, *parts = session.export_records()

    assert [(p["field"], p["index"], len(p["items"])) for p in parts] == [
        ("messages", 0, PART_ITEMS),
        ("messages", 1, PART_ITEMS),
        ("model_calls", 0, PART_ITEMS),
    ]
    assert (header["message_parts"], header["call_parts"]) == (2, 1)
    assert (len(header["messages"]), len(header["model_calls"])) == (21 - 16, 10 - 8)
    # A turn later: a new header, the same part objects (a writer references them).
    _turn(session)
    again = session.export_records()
    assert again[0] is not header and all(a is b for a, b in zip(again[1:], parts, strict=True))
    assert session.export_records() is again  # nothing changed: the same records


def test_the_parts_join_back_into_the_whole_session() -> None:
    session = _session(10)
    saved = read_back(list(session.export_records()))

    (whole,) = join_parts(saved[::-1])  # in any order

    assert whole == read_back(session.export_json())


def test_a_missing_part_is_refused_naming_the_session() -> None:
    saved = read_back(list(_session(10).export_records()))
    without = [r for r in saved if not (r["kind"] == "session_part" and r["index"] == 1)]

    with pytest.raises(InvalidCheckpointStateError, match="session r1#0 names 2 messages parts"):
        join_parts(without)


def test_a_part_without_its_session_is_refused() -> None:
    saved = read_back(list(_session(10).export_records()))

    with pytest.raises(InvalidCheckpointStateError, match="saved without their session"):
        join_parts(saved[1:])
