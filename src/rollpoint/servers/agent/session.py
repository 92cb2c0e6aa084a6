"""One episode as the agent server plays it: the :class:`Session`, its states and its saved form.

Owns: the session state machine (:class:`SessionState` and the one transition table
:data:`TRANSITIONS`; an illegal move raises), which states count as *at a turn boundary*,
the conversation so far (OpenAI messages), the index of the next policy call, the policy
calls made, the assistant message whose tool calls are not applied yet, and the
:class:`SessionRecord` a checkpoint saves (with :class:`FinishedReplyRecord` for replies
held until acked), built again only when the session changed since its last export.

Does not own: playing the episode (:mod:`rollpoint.servers.agent.episode_runner`), the set of all
sessions, counters and parking (:mod:`rollpoint.servers.agent.session_book`).

States and moves (the table :data:`TRANSITIONS` is the truth)::

    restored       → starting
    starting       → awaiting_model | running_tools | parked | verifying
    awaiting_model → running_tools | parked | verifying
    running_tools  → awaiting_model | parked | verifying
    parked         → awaiting_model | running_tools | verifying
    verifying      → finished
    any live state → failed | cancelled   (restored: cancelled only)

A session is *at a turn boundary* in ``restored``, ``parked`` and ``awaiting_model`` (a
policy call in flight is held by the model server's closed gate during a checkpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, JsonValue, model_validator

from rollpoint.protocol.episode import ModelCall, RowResult, RunReply, RunRow
from rollpoint.protocol.errors import InvalidPhaseError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.model_base import StrictModel
from rollpoint.servers.agent.session_parts import PART_ITEMS, grow_parts
from rollpoint.tuning.seam import encoded, encoded_or_itself


class SessionState(StrEnum):
    RESTORED = "restored"
    """Installed from a checkpoint; waits for ``/run`` of its next attempt."""
    STARTING = "starting"
    """Opening (or finding) the episode on the resources server."""
    AWAITING_MODEL = "awaiting_model"
    """A policy call is in flight. At a boundary: a checkpoint holds it at the model gate."""
    PARKED = "parked"
    """Between turns, waiting for the book's boundaries to reopen."""
    RUNNING_TOOLS = "running_tools"
    """Applying the tool calls of the last policy response."""
    VERIFYING = "verifying"
    """The episode is over; the resources server is scoring it."""
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    """Stopped on purpose (its attempt was retired, or the server shut down)."""


_S = SessionState
_ENDS = frozenset({_S.FAILED, _S.CANCELLED})

TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    _S.RESTORED: frozenset({_S.STARTING, _S.CANCELLED}),
    _S.STARTING: frozenset({_S.AWAITING_MODEL, _S.PARKED, _S.RUNNING_TOOLS, _S.VERIFYING}) | _ENDS,
    _S.AWAITING_MODEL: frozenset({_S.PARKED, _S.RUNNING_TOOLS, _S.VERIFYING}) | _ENDS,
    _S.PARKED: frozenset({_S.AWAITING_MODEL, _S.RUNNING_TOOLS, _S.VERIFYING}) | _ENDS,
    _S.RUNNING_TOOLS: frozenset({_S.AWAITING_MODEL, _S.PARKED, _S.VERIFYING}) | _ENDS,
    _S.VERIFYING: frozenset({_S.FINISHED}) | _ENDS,
    _S.FINISHED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}

TERMINAL_STATES = frozenset({_S.FINISHED, _S.FAILED, _S.CANCELLED})
LIVE_STATES = frozenset(SessionState) - TERMINAL_STATES
BOUNDARY_STATES = frozenset({_S.RESTORED, _S.AWAITING_MODEL, _S.PARKED})
"""Live states a checkpoint can cut at: nothing is half applied."""
BUSY_STATES = LIVE_STATES - BOUNDARY_STATES
"""Live states that block a checkpoint: the session is talking to the resources server."""

MoveObserver = Callable[["Session", "SessionState | None", "SessionState"], None]


class SessionRecord(StrictModel):
    """A live session as a checkpoint saves it (always at a turn boundary)."""

    kind: Literal["session"] = "session"
    episode: EpisodeId
    """The attempt saved; the restored session waits for ``episode.next_attempt()``."""
    row: RunRow
    messages: list[dict[str, JsonValue]]
    turn: Annotated[int, Field(ge=0)]
    """Index of the next policy call (= policy calls made so far)."""
    model_calls: list[ModelCall]
    pending_response: dict[str, JsonValue] | None = None
    """The last assistant message when its tool calls were not applied yet."""
    loop_state: JsonValue = None
    """A custom agent loop's state after the last applied turn (``rollpoint.agent_loops``)."""

    @model_validator(mode="after")
    def _consistent(self) -> SessionRecord:
        if self.row.episode.rollout_id != self.episode.rollout_id:
            raise ValueError(
                f"row is for rollout {self.row.episode.rollout_id!r}, "
                f"record for {self.episode.rollout_id!r}"
            )
        if len(self.model_calls) != self.turn:
            raise ValueError(f"turn {self.turn} but {len(self.model_calls)} model calls")
        if self.pending_response is not None and self.turn == 0:
            raise ValueError("a pending response before any policy call")
        return self


class FinishedReplyRecord(StrictModel):
    """A finished reply not yet acked, saved with the sessions so no finished work is lost."""

    kind: Literal["finished_reply"] = "finished_reply"
    reply: RunReply


BookRecord = Annotated[SessionRecord | FinishedReplyRecord, Field(discriminator="kind")]


class Session:
    """The mutable state of one episode in one agent server.

    What a checkpoint saves of it (row, episode, messages, turn, model calls, pending
    response) sits behind properties whose setters count a change, so :meth:`export_json`
    hands out the record it built last time while nothing in it changed. The two lists are
    append-only (the runner appends to them in place; replacing one goes through its
    setter), so their lengths complete the count.
    """

    __slots__ = (
        "_calls_json",
        "_changed_hook",
        "_changes",
        "_episode",
        "_exported",
        "_loop_state",
        "_messages",
        "_messages_json",
        "_model_calls",
        "_observer",
        "_parts",
        "_pending_response",
        "_row",
        "_row_json",
        "_split",
        "_turn",
        "result",
        "state",
        "task",
    )

    def __init__(self, row: RunRow, *, state: SessionState = SessionState.STARTING) -> None:
        self._changes = 0
        self._exported: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        """The last record :meth:`export_json` built, with the change stamp it was built at."""
        self._row = row
        self._episode = row.episode
        self.state = state
        self._messages: list[dict[str, Any]] = [{"role": "user", "content": row.task.prompt}]
        self._turn = 0
        self._model_calls: list[ModelCall] = []
        self._pending_response: dict[str, Any] | None = None
        self._loop_state: JsonValue = None
        self.task: asyncio.Task[RowResult] | None = None
        self.result: asyncio.Future[RowResult] | None = None
        self._observer: MoveObserver | None = None
        self._changed_hook: Callable[[str], None] | None = None
        # Encoded now, on the data path, so a checkpoint does not in its pause.
        self._row_json: orjson.Fragment | None = encoded(row.model_dump(mode="json"))
        self._calls_json: list[orjson.Fragment] = []
        """Encoded ``model_calls``, once each: calls are only ever appended."""
        self._messages_json: list[Any] = []
        """Encoded ``messages``, once each at the first export after the append (messages
        are only ever appended and never changed)."""
        self._parts: tuple[int, list[dict[str, Any]], list[dict[str, Any]]] | None = None
        """The attempt they are saved for, then the message and model-call parts made so
        far (:mod:`rollpoint.servers.agent.session_parts`): each made once."""
        self._split: tuple[dict[str, Any], tuple[dict[str, Any], ...]] | None = None
        """The last :meth:`export_json` record and :meth:`export_records` made of it."""

    # --- what a checkpoint saves: every setter counts a change -------------------------

    @property
    def row(self) -> RunRow:
        return self._row

    @row.setter
    def row(self, row: RunRow) -> None:
        self._row = row
        self._row_json = None
        self._changed()

    @property
    def episode(self) -> EpisodeId:
        return self._episode

    @episode.setter
    def episode(self, episode: EpisodeId) -> None:
        self._episode = episode
        self._changed()

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far: append to it, never change or drop a message in it."""
        return self._messages

    @messages.setter
    def messages(self, messages: list[dict[str, Any]]) -> None:
        self._messages = messages
        self._messages_json = []
        self._parts = None
        self._changed()

    @property
    def turn(self) -> int:
        return self._turn

    @turn.setter
    def turn(self, turn: int) -> None:
        self._turn = turn
        self._changed()

    @property
    def model_calls(self) -> list[ModelCall]:
        """The policy calls made: append to it, never change or drop a call in it."""
        return self._model_calls

    @model_calls.setter
    def model_calls(self, calls: list[ModelCall]) -> None:
        self._model_calls = calls
        self._calls_json = []
        self._parts = None
        self._changed()

    def add_model_call(self, call: ModelCall) -> None:
        """Append ``call`` and dump it now, on the data path: a checkpoint exports every
        session that made a call since the last one inside its pause."""
        self._model_calls.append(call)
        if len(self._calls_json) == len(self._model_calls) - 1:
            self._calls_json.append(encoded(call.model_dump(mode="json")))
        self._changed()

    def add_message(self, message: dict[str, Any]) -> None:
        """Append ``message`` to the conversation (and report the change)."""
        self._messages.append(message)
        self._changed()

    def _changed(self) -> None:
        self._changes += 1
        if self._changed_hook is not None:
            self._changed_hook(self._episode.rollout_id)

    @property
    def pending_response(self) -> dict[str, Any] | None:
        return self._pending_response

    @pending_response.setter
    def pending_response(self, response: dict[str, Any] | None) -> None:
        self._pending_response = response
        self._changed()

    @property
    def loop_state(self) -> JsonValue:
        """A custom agent loop's state, saved with the session (JSON, never changed in
        place: the loop returns a new value each turn)."""
        return self._loop_state

    @loop_state.setter
    def loop_state(self, state: JsonValue) -> None:
        self._loop_state = state
        self._changed()

    def observe(self, observer: MoveObserver, changed: Callable[[str], None] | None = None) -> None:
        """Report every move from now on (and the current state, as a move from None), and
        with ``changed`` (called with the rollout id) every change of what a checkpoint
        saves that goes through this class (setters, :meth:`add_model_call`,
        :meth:`add_message`)."""
        self._observer = observer
        self._changed_hook = changed
        observer(self, None, self.state)

    @property
    def key(self) -> str:
        return self.episode.key

    @property
    def at_boundary(self) -> bool:
        return self.state in BOUNDARY_STATES

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    def move(self, new: SessionState) -> None:
        """Apply one transition of :data:`TRANSITIONS`; anything else is a bug and raises."""
        old = self.state
        if new not in TRANSITIONS[old]:
            raise InvalidPhaseError(f"session {self.key}: cannot move from {old} to {new}")
        self.state = new
        if self._observer is not None:
            self._observer(self, old, new)

    def continue_as(self, row: RunRow) -> None:
        """Take up a restored session under the attempt ``row`` names."""
        self.row = row
        self.episode = row.episode
        self.move(SessionState.STARTING)

    def to_record(self) -> SessionRecord:
        return SessionRecord(
            episode=self.episode,
            row=self.row,
            messages=self.messages,
            turn=self.turn,
            model_calls=self.model_calls,
            pending_response=self.pending_response,
            loop_state=self.loop_state,
        )

    def export_json(self) -> dict[str, Any]:
        """``to_record().model_dump(mode="json")`` ready for orjson, without validating or
        encoding again what an earlier export already encoded: the book's state image calls
        it for every session that changed, between checkpoints and in their pauses.

        The row, each model call and each message are :class:`orjson.Fragment` s, encoded
        once in the session's life (:mod:`rollpoint.tuning.encoded_json`);
        ``orjson.loads(orjson.dumps(record))`` is the plain dump. Why: a session lives
        through many checkpoints, and encoding its whole transcript again in every one was
        most of a snapshot write's time (254 MiB of sessions: 0.64 s of orjson per write as
        plain dicts, 0.33 s with the parts pre-encoded).

        A session that did not change since its last export gets the same dict again; one
        that did gets a new one. Either way a record handed out is never changed afterwards
        (a checkpoint writes it while the session goes on), so treat it as read-only. The
        record is validated where it comes back from disk (:meth:`SessionBook.install`)."""
        stamp = (self._changes, len(self._messages), len(self._model_calls))
        exported = self._exported
        if exported is not None and exported[0] == stamp:
            return exported[1]
        if self._row_json is None:
            self._row_json = encoded(self._row.model_dump(mode="json"))
        calls, cached = self._model_calls, self._calls_json
        cached.extend(encoded(call.model_dump(mode="json")) for call in calls[len(cached) :])
        messages, done = self._messages, self._messages_json
        done.extend(encoded_or_itself(message) for message in messages[len(done) :])
        pending = self._pending_response
        record = {
            "kind": "session",
            "episode": {"rollout_id": self._episode.rollout_id, "attempt": self._episode.attempt},
            "row": self._row_json,
            # Copies of the lists: the session appends to them once the cut reopens.
            "messages": list(done),
            "turn": self._turn,
            "model_calls": list(cached),
            "pending_response": None if pending is None else dict(pending),
            "loop_state": self._loop_state,
        }
        self._exported = (stamp, record)
        return record

    def export_records(self) -> tuple[dict[str, Any], ...]:
        """:meth:`export_json` as a checkpoint writes it: the header, then the parts of the
        transcript (:mod:`rollpoint.servers.agent.session_parts`). Full parts are made once
        and handed out again as the same objects; an unchanged session gets the same tuple."""
        record = self.export_json()
        split = self._split
        if split is not None and split[0] is record:
            return split[1]
        attempt = self._episode.attempt
        if self._parts is None or self._parts[0] != attempt:
            self._parts = (attempt, [], [])
        _, message_parts, call_parts = self._parts
        saved_for = record["episode"]
        grow_parts(message_parts, "messages", record["messages"], saved_for)
        grow_parts(call_parts, "model_calls", record["model_calls"], saved_for)
        header = {
            **record,
            "messages": record["messages"][len(message_parts) * PART_ITEMS :],
            "model_calls": record["model_calls"][len(call_parts) * PART_ITEMS :],
            "message_parts": len(message_parts),
            "call_parts": len(call_parts),
        }
        out = (header, *message_parts, *call_parts)
        self._split = (record, out)
        return out

    @classmethod
    def from_record(cls, record: SessionRecord) -> Session:
        """A restored session waiting for the attempt after the one saved."""
        session = cls(record.row, state=SessionState.RESTORED)
        session.episode = record.episode.next_attempt()
        session.messages = [dict(m) for m in record.messages]
        session.turn = record.turn
        session.model_calls = list(record.model_calls)
        if record.pending_response is not None:
            session.pending_response = dict(record.pending_response)
        session.loop_state = record.loop_state
        return session
