"""One episode as the agent server plays it: the :class:`Session`, its states and its saved form.

Owns: the session state machine (:class:`SessionState` and the one transition table
:data:`TRANSITIONS`; an illegal move raises), which states count as *at a turn boundary*,
the conversation so far (OpenAI messages), the index of the next policy call, the policy
calls made, the assistant message whose tool calls are not applied yet, and the
:class:`SessionRecord` a checkpoint saves (with :class:`FinishedReplyRecord` for replies
held until acked).

Does not own: playing the episode (:mod:`rollpoint.gym.episode_runner`), the set of all
sessions, counters and parking (:mod:`rollpoint.gym.session_book`).

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

from pydantic import Field, JsonValue, model_validator

from rollpoint.protocol.episode import ModelCall, RowResult, RunReply, RunRow
from rollpoint.protocol.errors import InvalidPhaseError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.model_base import StrictModel


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
    """The mutable state of one episode in one agent server."""

    __slots__ = (
        "_calls_json",
        "_observer",
        "_row_json",
        "episode",
        "messages",
        "model_calls",
        "pending_response",
        "result",
        "row",
        "state",
        "task",
        "turn",
    )

    def __init__(self, row: RunRow, *, state: SessionState = SessionState.STARTING) -> None:
        self.row = row
        self.episode = row.episode
        self.state = state
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": row.task.prompt}]
        self.turn = 0
        self.model_calls: list[ModelCall] = []
        self.pending_response: dict[str, Any] | None = None
        self.task: asyncio.Task[RowResult] | None = None
        self.result: asyncio.Future[RowResult] | None = None
        self._observer: MoveObserver | None = None
        # Dumped now, on the data path, so a checkpoint does not in its pause.
        self._row_json: dict[str, Any] | None = row.model_dump(mode="json")
        self._calls_json: list[dict[str, Any]] = []
        """JSON forms of ``model_calls``, dumped once each: calls are only ever appended."""

    def observe(self, observer: MoveObserver) -> None:
        """Report every move from now on (and the current state, as a move from None)."""
        self._observer = observer
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
        self._row_json = None
        self.move(SessionState.STARTING)

    def to_record(self) -> SessionRecord:
        return SessionRecord(
            episode=self.episode,
            row=self.row,
            messages=self.messages,
            turn=self.turn,
            model_calls=self.model_calls,
            pending_response=self.pending_response,
        )

    def export_json(self) -> dict[str, Any]:
        """``to_record().model_dump(mode="json")``, without validating or dumping again
        what an earlier export already dumped: a checkpoint exports every session in its
        pause, so this is its per-session cost. The record is validated where it comes
        back from disk (:meth:`SessionBook.install`)."""
        if self._row_json is None:
            self._row_json = self.row.model_dump(mode="json")
        calls, cached = self.model_calls, self._calls_json
        if len(cached) > len(calls):
            cached.clear()
        cached.extend(call.model_dump(mode="json") for call in calls[len(cached) :])
        pending = self.pending_response
        return {
            "kind": "session",
            "episode": {"rollout_id": self.episode.rollout_id, "attempt": self.episode.attempt},
            "row": self._row_json,
            # Copies of the lists: the session appends to them once the cut reopens.
            "messages": list(self.messages),
            "turn": self.turn,
            "model_calls": list(cached),
            "pending_response": None if pending is None else dict(pending),
        }

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
        return session
