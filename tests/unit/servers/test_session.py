"""The session state machine (one transition table) and the saved form of a session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rollpoint.protocol.episode import ModelCall, RunRow, TaskRow
from rollpoint.protocol.errors import InvalidPhaseError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.session import (
    BOUNDARY_STATES,
    BUSY_STATES,
    LIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    Session,
    SessionRecord,
    SessionState,
)
from tests.support.records import read_back

S = SessionState


def _row(rollout_id: str = "r1", attempt: int = 0) -> RunRow:
    return RunRow(
        task=TaskRow(task_id="t1", environment="workplace", prompt="Schedule it."),
        group_id="g1",
        row=0,
        episode=EpisodeId(rollout_id=rollout_id, attempt=attempt),
    )


def test_the_table_covers_every_state_and_terminal_states_have_no_moves() -> None:
    assert set(TRANSITIONS) == set(SessionState)
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
    assert BOUNDARY_STATES | BUSY_STATES == LIVE_STATES
    assert not BOUNDARY_STATES & BUSY_STATES
    assert {S.STARTING, S.RUNNING_TOOLS, S.VERIFYING} == BUSY_STATES


def test_a_whole_episode_walks_the_table() -> None:
    seen: list[tuple[SessionState | None, SessionState]] = []
    session = Session(_row())
    session.observe(lambda _s, old, new: seen.append((old, new)))
    path = [
        S.AWAITING_MODEL,
        S.PARKED,
        S.RUNNING_TOOLS,
        S.AWAITING_MODEL,
        S.VERIFYING,
        S.FINISHED,
    ]
    for state in path:
        session.move(state)
    assert seen == [(None, S.STARTING), *zip([S.STARTING, *path[:-1]], path, strict=True)]
    assert session.state is S.FINISHED and not session.is_live


@pytest.mark.parametrize(
    ("start", "bad"),
    [
        (S.FINISHED, S.AWAITING_MODEL),
        (S.RESTORED, S.AWAITING_MODEL),
        (S.VERIFYING, S.PARKED),
        (S.CANCELLED, S.STARTING),
        (S.AWAITING_MODEL, S.STARTING),
    ],
)
def test_an_illegal_move_raises_and_changes_nothing(start: S, bad: S) -> None:
    session = Session(_row(), state=start)
    with pytest.raises(InvalidPhaseError, match=f"cannot move from {start} to {bad}"):
        session.move(bad)
    assert session.state is start


@given(st.lists(st.sampled_from(list(SessionState)), max_size=30))
def test_any_sequence_of_moves_follows_the_table(moves: list[SessionState]) -> None:
    session = Session(_row())
    observed: list[SessionState] = []
    session.observe(lambda _s, _old, new: observed.append(new))
    expected = [S.STARTING]
    for new in moves:
        before = session.state
        if new in TRANSITIONS[before]:
            session.move(new)
            expected.append(new)
        else:
            with pytest.raises(InvalidPhaseError):
                session.move(new)
            assert session.state is before
    assert observed == expected


def test_a_session_saves_and_restores_waiting_for_its_next_attempt() -> None:
    session = Session(_row("r7", 0))
    call = ModelCall(turn=0, attempt=0, response={"role": "assistant", "content": None})
    session.model_calls.append(call)
    session.messages.append({"role": "assistant", "content": None, "tool_calls": []})
    session.turn = 1
    session.pending_response = {"role": "assistant", "content": "done"}
    record = SessionRecord.model_validate(session.to_record().model_dump(mode="json"))

    restored = Session.from_record(record)
    assert restored.state is S.RESTORED
    assert restored.episode == EpisodeId(rollout_id="r7", attempt=1)
    assert restored.messages == session.messages
    assert restored.model_calls == [call]
    assert (restored.turn, restored.pending_response) == (1, session.pending_response)

    restored.continue_as(_row("r7", 1))
    assert restored.state is S.STARTING and restored.row.episode.attempt == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"turn": 2}, "turn 2 but 0 model calls"),
        ({"episode": {"rollout_id": "other", "attempt": 0}}, "row is for rollout"),
        ({"pending_response": {"role": "assistant"}}, "pending response before any"),
    ],
)
def test_an_inconsistent_record_is_refused(change: dict[str, object], message: str) -> None:
    good = Session(_row()).to_record().model_dump(mode="json")
    with pytest.raises(ValidationError, match=message):
        SessionRecord.model_validate({**good, **change})


def _play_turn(session: Session) -> None:
    message = {"role": "assistant", "content": f"turn {session.turn}"}
    session.model_calls.append(
        ModelCall(turn=session.turn, attempt=session.episode.attempt, response=message)
    )
    session.messages.append(message)
    session.turn += 1


def test_export_json_is_the_validated_record_dumped_across_exports_and_attempts() -> None:
    session = Session(_row("r7", 0))
    _play_turn(session)
    assert read_back(session.export_json()) == session.to_record().model_dump(mode="json")
    # Later exports encode only the new calls and messages; the whole record must still match.
    _play_turn(session)
    session.pending_response = {"role": "assistant", "content": "turn 1"}
    first = session.export_json()
    assert read_back(first) == session.to_record().model_dump(mode="json")
    restored = Session.from_record(SessionRecord.model_validate(read_back(first)))
    restored.continue_as(_row("r7", 1))
    _play_turn(restored)
    exported = restored.export_json()
    assert read_back(exported) == restored.to_record().model_dump(mode="json")
    assert exported["episode"] == {"rollout_id": "r7", "attempt": 1}
    # An export is a copy: the session going on does not change it.
    _play_turn(session)
    assert len(first["messages"]) == 3 and first["turn"] == 2


def test_a_call_added_is_dumped_then_and_never_again_by_an_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dumps: list[int] = []
    real = ModelCall.model_dump

    def counted(self: ModelCall, **kw: object) -> dict[str, object]:
        dumps.append(self.turn)
        return real(self, **kw)

    monkeypatch.setattr(ModelCall, "model_dump", counted)
    session = Session(_row("r7", 0))
    message = {"role": "assistant", "content": "turn 0"}
    session.add_model_call(ModelCall(turn=0, attempt=0, response=message))
    assert dumps == [0]  # on the data path
    session.messages.append(message)
    session.turn += 1
    record = session.export_json()
    assert dumps == [0]  # the checkpoint's export dumped nothing
    assert read_back(record)["model_calls"] == [
        ModelCall(turn=0, attempt=0, response=message).model_dump(mode="json")
    ]
    monkeypatch.undo()
    assert read_back(record) == session.to_record().model_dump(mode="json")


def test_an_export_encodes_only_what_was_appended_since_the_last_one() -> None:
    session = Session(_row("r7", 0))
    _play_turn(session)
    first = session.export_json()
    _play_turn(session)
    second = session.export_json()
    # The same encoded objects: nothing exported before was encoded again.
    assert all(a is b for a, b in zip(first["messages"], second["messages"], strict=False))
    assert all(a is b for a, b in zip(first["model_calls"], second["model_calls"], strict=False))
    assert second["row"] is first["row"]
    assert (len(first["messages"]), len(second["messages"])) == (2, 3)
    assert read_back(second) == session.to_record().model_dump(mode="json")
    # Replacing the lists (a restore does) drops what was encoded for the old ones.
    session.messages = [{"role": "user", "content": "other"}, *session.messages[1:]]
    third = session.export_json()
    assert third["messages"][0] is not second["messages"][0]
    assert read_back(third)["messages"][0] == {"role": "user", "content": "other"}


def test_a_message_orjson_cannot_encode_is_exported_as_is_for_the_write_to_name() -> None:
    session = Session(_row("r7", 0))
    odd = {"role": "tool", "tool_call_id": "c0", "content": {1j}}
    session.add_message(odd)
    assert session.export_json()["messages"][-1] is odd


def _apply_tools(session: Session) -> None:
    session.messages.append({"role": "tool", "tool_call_id": "c0", "content": "ok"})
    session.pending_response = None


# Same lengths, other contents: only the setters can tell.
def _replace_messages(session: Session) -> None:
    session.messages = [{"role": "user", "content": "other"}, *session.messages[1:]]


def _replace_calls(session: Session) -> None:
    call = ModelCall(turn=0, attempt=0, response={"role": "assistant", "content": "other"})
    session.model_calls = [call, *session.model_calls[1:]]


@pytest.mark.parametrize(
    "change",
    [
        _play_turn,
        _apply_tools,
        lambda s: s.messages.append({"role": "tool", "tool_call_id": "c1", "content": "x"}),
        lambda s: setattr(s, "pending_response", {"role": "assistant", "content": "again"}),
        _replace_messages,
        _replace_calls,
        lambda s: setattr(s, "turn", s.turn + 1),
        lambda s: setattr(s, "episode", s.episode.next_attempt()),
        lambda s: setattr(s, "row", s.row.model_copy(update={"row": 5})),
    ],
    ids=[
        "policy_call",
        "tools_applied",
        "message_appended",
        "pending_response",
        "messages_replaced",
        "calls_replaced",
        "turn",
        "episode",
        "row",
    ],
)
def test_export_json_reuses_the_record_until_a_change_and_never_changes_one_handed_out(
    change: Callable[[Session], None],
) -> None:
    session = Session(_row("r7", 0))
    _play_turn(session)
    session.pending_response = session.messages[-1]
    first = session.export_json()
    kept = read_back(first)
    assert session.export_json() is first  # nothing changed: the same record again
    change(session)
    second = session.export_json()
    assert read_back(first) == kept  # the session went on; the record handed out did not change
    assert second is not first and read_back(second) != kept
    assert read_back(second) == _unchecked_record(session)
    assert session.export_json() is second


def _unchecked_record(session: Session) -> dict[str, object]:
    # to_record() without its checks: a lone turn change makes an inconsistent record.
    record = SessionRecord.model_construct(
        episode=session.episode,
        row=session.row,
        messages=session.messages,
        turn=session.turn,
        model_calls=session.model_calls,
        pending_response=session.pending_response,
    )
    return record.model_dump(mode="json")


def test_a_continued_restored_session_exports_its_new_attempt() -> None:
    session = Session(_row("r7", 0))
    _play_turn(session)
    restored = Session.from_record(SessionRecord.model_validate(read_back(session.export_json())))
    first = restored.export_json()
    kept = read_back(first)
    restored.continue_as(_row("r7", 1).model_copy(update={"row": 3}))
    second = read_back(restored.export_json())
    assert read_back(first) == kept
    assert (second["episode"], second["row"]["row"]) == ({"rollout_id": "r7", "attempt": 1}, 3)
    assert second == restored.to_record().model_dump(mode="json")
