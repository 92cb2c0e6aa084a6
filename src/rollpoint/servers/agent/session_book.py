"""Every session of one agent server, the finished replies it holds, and the boundary gate.

Owns: admitting ``/run`` rows (run, join a running session, replay a finished reply,
continue a restored session, or refuse), one asyncio task per session (owned here, never by
a request: a client that goes away cancels nothing), per-state counters (readiness is O(1)
with any number of sessions), the boundary gate that parks sessions for a checkpoint,
finished replies held until acked (bounded), and the export/install of sessions for
checkpoints. It reads the retire marks (:attr:`SessionBook.marks`, the fence's own
:class:`~rollpoint.participant.RetireMarks` once a control plane is mounted) and keeps none
of its own: the fence raises them before it calls :meth:`SessionBook.retire`, which stops
the attempts they cover. Each session's record is kept current in a
:class:`~rollpoint.participant.state_image.StateImage` (sessions report their moves and changes to
it), so a checkpoint's capture copies records instead of exporting 50k sessions in its pause.

Does not own: how an episode is played (the ``play`` function, normally
:meth:`rollpoint.servers.agent.episode_runner.EpisodeRunner.play`), HTTP, or checkpoint phases (the
fence calls :meth:`close_boundaries`, :meth:`readiness`, :meth:`export`, ...). What a play
function is handed is in :mod:`.play_contract`; the saved form a capture reads, in
:mod:`.book_records`.

Row admission, in order: a held finished reply is returned as is; an attempt at or under its
rollout's retire mark (:attr:`SessionBook.marks`) is refused (``stale_attempt``); a row for another environment is a data
failure; a rollout that holds another attempt here is a transport failure
(``attempt_conflict``: retire the old one first); a running session of the same attempt is
joined; while boundaries are closed a new row is refused (:class:`RowRefused`: it never ran);
a restored session continues under the attempt it waits for; otherwise a new session starts.

The boundaries are the SDK's :class:`~rollpoint.participant.AdmissionGate`, the one gate
all three servers use: closing it refuses new rows, parks running sessions at their next
boundary (counted as ``waiting``) and its change signal carries the sessions' moves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from pydantic import JsonValue, TypeAdapter, ValidationError

from rollpoint.participant import AdmissionGate, RetireMarks, StateImage
from rollpoint.protocol.control import (
    MAX_REPORTED_BLOCKERS,
    Readiness,
    RetireOutcome,
    RetireOutcomeKind,
)
from rollpoint.protocol.episode import RowRefused, RowResult, RunReply, RunRow
from rollpoint.protocol.errors import (
    AttemptCancelledError,
    AttemptConflictError,
    EnvironmentMismatchError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    RollpointError,
    StaleAttemptError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.servers.agent.book_records import SessionEntry, select_records
from rollpoint.servers.agent.play_contract import PlayFn, TurnBoundary, row_failure
from rollpoint.servers.agent.session import (
    BUSY_STATES,
    LIVE_STATES,
    BookRecord,
    FinishedReplyRecord,
    Session,
    SessionRecord,
    SessionState,
)
from rollpoint.servers.agent.session_parts import join_parts
from rollpoint.servers.agent.turn_journal import TurnJournal
from rollpoint.tuning.seam import encoded

__all__ = ["PlayFn", "SessionBook", "SessionEntry", "TurnBoundary", "row_failure", "select_records"]

log = logging.getLogger(__name__)

_RECORDS = TypeAdapter(list[BookRecord])
EVICTION_LOG_EVERY = 1000


def _done(result: RowResult) -> asyncio.Future[RowResult]:
    future: asyncio.Future[RowResult] = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


class SessionBook:
    """All sessions and held replies of one agent server. One event loop, no threads."""

    def __init__(
        self,
        play: PlayFn,
        *,
        environment: str,
        mode: CheckpointMode = CheckpointMode.TURN,
        max_finished_replies: int = 10_000,
    ) -> None:
        if max_finished_replies < 1:
            raise ValueError("max_finished_replies must be at least 1")
        self._play = play
        self.environment = environment
        self.mode = mode
        self.max_finished_replies = max_finished_replies
        self._sessions: dict[str, Session] = {}
        """Live sessions (restored ones included) by rollout id: one attempt at a time."""
        self._by_state: dict[SessionState, dict[str, Session]] = {s: {} for s in LIVE_STATES}
        self._finished: dict[str, RunReply] = {}
        """Held replies by episode key, oldest first."""
        self._finished_json: dict[str, tuple[RunReply, dict[str, Any]]] = {}
        """The record a checkpoint exported for a held reply, with the reply it was made
        of: replies are immutable, so each is dumped once however many checkpoints hold it."""
        self._held: dict[str, set[int]] = {}
        """rollout_id → attempts whose finished reply is held (an index of ``_finished``)."""
        self.marks = RetireMarks()
        """The retire marks ``/run`` admission reads: the fence's (the agent server sets
        ``book.marks = fence.marks`` when it mounts the control plane). Without a control
        plane nothing retires, and these stay empty. The book never writes them."""
        self._evicted = 0
        self._gate = AdmissionGate()
        """The turn boundaries: closed for a checkpoint. New rows are refused while it is
        closed (never held: a refused row never ran), running sessions wait at their next
        boundary, and every session move wakes its watchers (the fence's readiness wait)."""
        self._turn_boundary = TurnBoundary(self)
        self._image: StateImage[SessionEntry] = StateImage(
            self._image_entry, lambda: list(self._sessions), name="sessions"
        )
        self.journal: TurnJournal | None = None
        """The turn journal while ``journal`` is on (:mod:`.turn_journal`): each turn is
        journaled at its boundary, each finished reply before it is handed on, and a row an
        earlier process left unfinished resumes at its last journaled turn."""

    # --- admission ---------------------------------------------------------------------

    def submit(self, row: RunRow) -> asyncio.Future[RowResult]:
        """The future result of one row. Never cancel it: joiners of the same session share it."""
        episode = row.episode
        reply = self._finished.get(episode.key)
        if reply is not None:
            return _done(reply)
        mark = self.marks.get(episode.rollout_id)
        if mark is not None and episode.attempt <= mark:
            err = StaleAttemptError(f"attempt {episode.key} was retired (mark {mark})")
            return _done(row_failure(row, err))
        if row.task.environment != self.environment:
            return _done(row_failure(row, EnvironmentMismatchError(self._env_message(row))))
        live = self._sessions.get(episode.rollout_id)
        if live is not None and live.episode.attempt != episode.attempt:
            return _done(row_failure(row, self._attempt_conflict(row, live)))
        if live is not None and live.state is not SessionState.RESTORED:
            assert live.result is not None
            return live.result
        if not self._gate.is_open:
            reason = "turn boundaries are closed for a checkpoint; send the row again later"
            return _done(
                RowRefused(episode=episode, group_id=row.group_id, row=row.row, reason=reason)
            )
        if live is not None:
            live.continue_as(row)
            if self.journal is not None:
                self.journal.resume(live)
            return self._launch(live)
        session = Session(row)
        if self.journal is not None:
            self.journal.resume(session)
        self._sessions[episode.rollout_id] = session
        session.observe(self._on_move, self._image.changed)
        return self._launch(session)

    def _env_message(self, row: RunRow) -> str:
        return (
            f"row {row.episode.key} is a {row.task.environment!r} task; "
            f"this agent serves {self.environment!r}"
        )

    def _attempt_conflict(self, row: RunRow, live: Session) -> AttemptConflictError:
        # A plumbing race (an old try still here), not bad data: the error is retryable, so
        # the row is a transport failure and a fresh re-send fixes it.
        return AttemptConflictError(
            f"rollout {row.episode.rollout_id} is at attempt {live.episode.attempt} here "
            f"({live.state}); retire it before sending attempt {row.episode.attempt}"
        )

    def _launch(self, session: Session) -> asyncio.Future[RowResult]:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[RowResult] = loop.create_future()
        session.result = result
        session.task = loop.create_task(self._drive(session), name=f"episode {session.key}")
        session.task.add_done_callback(lambda task: self._settle(session, task))
        return result

    async def _drive(self, session: Session) -> RowResult:
        try:
            reply = await self._play(session, self._turn_boundary)
            if session.state is not SessionState.VERIFYING:
                raise InvalidPhaseError(f"session {session.key} ended in {session.state}")
            if self.journal is not None:
                self.journal.check(reply)
                await self.journal.reply(reply)  # durable before it is handed on
            return reply
        except Exception as exc:
            if not isinstance(exc, RollpointError):
                log.exception("episode %s failed", session.key)
            return row_failure(session.row, exc)

    def _settle(self, session: Session, task: asyncio.Task[RowResult]) -> None:
        # A done callback: runs even when the task was cancelled before its first step.
        if task.cancelled() or session.state is SessionState.CANCELLED:
            # Retire may have reported "cancelled" just before the task returned: keep its word.
            stopped = AttemptCancelledError(
                f"attempt {session.key} was stopped (retired, or the server stopped)"
            )
            # The session's attempt, which a restored session's saved row may predate.
            result: RowResult = row_failure(session.row, stopped, session.episode)
            if session.is_live:
                session.move(SessionState.CANCELLED)
        else:
            result = task.result()
            if isinstance(result, RunReply):
                if session.is_live:
                    session.move(SessionState.FINISHED)
                self._hold(result)
            elif session.is_live:
                session.move(SessionState.FAILED)
        if session.result is not None and not session.result.done():
            session.result.set_result(result)

    # --- boundaries --------------------------------------------------------------------

    @property
    def boundaries_open(self) -> bool:
        return self._gate.is_open

    def close_boundaries(self) -> None:
        """From now on sessions park at their next boundary and new rows are refused."""
        self._gate.close()

    def open_boundaries(self) -> None:
        self._gate.open()

    async def boundary(self, session: Session) -> None:
        """A turn boundary of ``session``: its turn journaled (with a journal), then it
        returns at once while open, else parks it."""
        if self.journal is not None:
            self.journal.turn(session)  # queued: durable shortly, in order (see its docstring)
        if self._gate.is_open:
            return
        session.move(SessionState.PARKED)
        await self._gate.wait_open()

    async def hold_reply(self, session: Session) -> None:
        """A policy reply of ``session`` arrived: while boundaries are closed it waits here,
        unapplied, and the session stays ``awaiting_model`` (at a boundary)."""
        await self._gate.wait_open()

    def readiness(self) -> Readiness:
        """Whether every session is at a boundary. O(number of states), not of sessions."""
        counts = {str(state): len(sessions) for state, sessions in self._by_state.items()}
        counts["finished_unacked"] = len(self._finished)
        finished = [reply.episode for reply in self._finished.values()]
        if self.mode is not CheckpointMode.TURN:
            # Only a restart-only agent scans: it has nothing to wait for, only a list to give.
            restarts = [
                s.episode for s in self._sessions.values() if s.state is not SessionState.RESTORED
            ]
            return Readiness(
                ready=True, restarts=restarts, finished_unacked=finished, counts=counts
            )
        busy = sum(len(self._by_state[s]) for s in BUSY_STATES)
        blockers = [
            s.key
            for s in islice(
                (s for state in BUSY_STATES for s in self._by_state[state].values()),
                MAX_REPORTED_BLOCKERS,
            )
        ]
        return Readiness(
            ready=busy == 0,
            blockers=blockers,
            blocker_count=busy,
            finished_unacked=finished,
            counts=counts,
        )

    async def wait_changed(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait for any session move or boundary change; False when ``timeout`` passed first."""
        return await self._gate.wait_changed(timeout)

    def _notify(self) -> None:
        self._gate.notify()

    def _on_move(self, session: Session, old: SessionState | None, new: SessionState) -> None:
        rollout_id = session.episode.rollout_id
        if old is not None and old in LIVE_STATES:
            self._by_state[old].pop(rollout_id, None)
        if new in LIVE_STATES:
            self._by_state[new][rollout_id] = session
        elif self._sessions.get(rollout_id) is session:
            del self._sessions[rollout_id]
        self._image.changed(rollout_id)
        self._notify()

    # --- counts ------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = {str(state): len(sessions) for state, sessions in self._by_state.items()}
        out["live"] = len(self._sessions)
        out["finished_unacked"] = len(self._finished)
        out["retired_rollouts"] = len(self.marks)
        if self.journal is not None:
            restored = {rid: s.turn for rid, s in self._by_state[SessionState.RESTORED].items()}
            turns, replies = self.journal.pending(restored)
            out["journal_turns"] = turns
            out["journal_replies"] = replies
            out["journal_resumed_turns"] = self.journal.counts.resumed_turns
            out["journal_adopted"] = self.journal.counts.adopted
            out["journal_read_ms"] = self.journal.journal.read_back_ms
        return out

    def session(self, rollout_id: str) -> Session | None:
        return self._sessions.get(rollout_id)

    # --- finished replies --------------------------------------------------------------

    def _hold(self, reply: RunReply) -> None:
        key = reply.episode.key
        if key not in self._finished and len(self._finished) >= self.max_finished_replies:
            oldest = next(iter(self._finished))
            self._release(oldest)
            self._evicted += 1
            if self._evicted % EVICTION_LOG_EVERY == 1:
                log.warning(
                    "dropped %d finished replies never acked (max_finished_replies=%d); "
                    "latest dropped: %s",
                    self._evicted,
                    self.max_finished_replies,
                    oldest,
                )
        self._finished[key] = reply
        self._held.setdefault(reply.episode.rollout_id, set()).add(reply.episode.attempt)

    def _release(self, key: str) -> RunReply | None:
        reply = self._finished.pop(key, None)
        self._finished_json.pop(key, None)
        if reply is not None:
            attempts = self._held.get(reply.episode.rollout_id)
            if attempts is not None:
                attempts.discard(reply.episode.attempt)
                if not attempts:
                    del self._held[reply.episode.rollout_id]
        return reply

    def finished_unacked(self) -> list[EpisodeId]:
        return [reply.episode for reply in self._finished.values()]

    def finished_reply(self, episode: EpisodeId) -> RunReply | None:
        return self._finished.get(episode.key)

    def ack(self, episodes: Iterable[EpisodeId]) -> list[EpisodeId]:
        """Release held replies; returns the episodes that were held (acking twice is a no-op)."""
        released = []
        for episode in episodes:
            if self._release(episode.key) is not None:
                released.append(episode)
        if released:
            self._notify()
        return released

    # --- retire / forget ---------------------------------------------------------------

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        """Stop each rollout's live attempt at or under its mark in ``marks`` (the marks the
        fence now holds, already raised) and report what was found for each."""
        outcomes: list[RetireOutcome] = []
        for rollout_id, mark in marks.items():
            found = False
            live = self._sessions.get(rollout_id)
            if live is not None and live.episode.attempt <= mark:
                outcomes.append(self._outcome(live.episode, RetireOutcomeKind.CANCELLED))
                self._cancel(live)
                found = True
            # The held attempts of this rollout, not every number up to the mark: a mark
            # may be huge, and this runs on the event loop.
            for held in sorted(a for a in self._held.get(rollout_id, ()) if a <= mark):
                reply = self._finished.get(f"{rollout_id}#{held}")
                if reply is not None:
                    outcomes.append(
                        self._outcome(reply.episode, RetireOutcomeKind.FINISHED_UNACKED)
                    )
                    found = True
            if not found:
                unknown = EpisodeId(rollout_id=rollout_id, attempt=mark)
                outcomes.append(self._outcome(unknown, RetireOutcomeKind.UNKNOWN))
        return outcomes

    @staticmethod
    def _outcome(episode: EpisodeId, kind: RetireOutcomeKind) -> RetireOutcome:
        return RetireOutcome(episode=episode, outcome=kind)

    def _cancel(self, session: Session) -> None:
        # Detach at once so the next attempt of this rollout is admitted right away; the
        # task sees CancelledError at its next step and makes no further move.
        session.move(SessionState.CANCELLED)
        if session.task is not None:
            session.task.cancel()

    def retire_mark(self, rollout_id: str) -> int | None:
        """The mark ``/run`` admission reads for ``rollout_id`` (see :attr:`marks`)."""
        return self.marks.get(rollout_id)

    # --- export / install --------------------------------------------------------------

    def export(self, scope: Iterable[EpisodeId]) -> list[dict[str, JsonValue]]:
        """Records of the live sessions in ``scope`` plus every held finished reply.

        An episode of the scope that is not live here (finished, or never seen) adds no
        session record. A scoped session away from a boundary raises
        :class:`InvalidPhaseError`. A restart-only agent exports no sessions.
        """
        return select_records(self._image.capture_now(), scope, self._finished_records())

    async def capture(self, scope: Iterable[EpisodeId]) -> Callable[[], list[dict[str, JsonValue]]]:
        """:meth:`export` in two steps: now, a copy of every session's record (only those
        changed since the image's last sweep are built, yielding the event loop between
        chunks) and of the held replies; later, from any thread, the scope's records out of
        that copy. Sessions do not move while boundaries are closed, which is when a
        checkpoint calls it."""
        finished = self._finished_records()
        image = await self._image.capture()
        return lambda: select_records(image, scope, finished)

    def keep_current(self) -> None:
        """Keep every session's record current from now on (see :class:`StateImage`)."""
        if self.mode is CheckpointMode.TURN:
            self._image.keep_current()

    async def stop_capturing(self) -> None:
        """Stop the state image's background sweep (the server is closing)."""
        await self._image.aclose()

    def _image_entry(self, rollout_id: str) -> SessionEntry | None:
        """The state image's entry of a rollout: its live session's record (what it is
        doing, away from a boundary), or no entry (not live here, or a restart-only agent)."""
        live = self._sessions.get(rollout_id)
        if live is None or self.mode is not CheckpointMode.TURN:
            return None
        if not live.at_boundary:
            return live.episode.attempt, f"session {live.key} is {live.state}"
        return live.episode.attempt, live.export_records()

    def _finished_records(self) -> list[dict[str, JsonValue]]:
        """The dump of each ``FinishedReplyRecord(reply=...)``, without validating the reply
        again, and made once per held reply: the record of one held at the last export is
        handed out again (never changed, like the reply it is made of). The reply is a
        pre-encoded :class:`orjson.Fragment`, as in :meth:`Session.export_json`: a held
        reply is written by every checkpoint until the trainer acks it."""
        cache = self._finished_json
        records: list[dict[str, JsonValue]] = []
        for key, reply in self._finished.items():
            cached = cache.get(key)
            if cached is None or cached[0] is not reply:
                reply_json = encoded(reply.model_dump(mode="json"))
                cached = (reply, {"kind": "finished_reply", "reply": reply_json})
                cache[key] = cached
            records.append(cached[1])
        return records

    def install(
        self, records: list[Any], scope: Iterable[EpisodeId] | None = None
    ) -> list[EpisodeId]:
        """Install exported records, all or nothing; returns the attempts now awaited.

        Sessions (only those whose saved episode is in ``scope``, when given) become
        ``restored`` sessions waiting for their next attempt; held replies are held again.
        Any invalid record, or a rollout running here, raises
        :class:`InvalidCheckpointStateError` and changes nothing.
        """
        sessions, replies = self._validate(records, scope)
        for record in sessions:
            old = self._sessions.get(record.episode.rollout_id)
            if old is not None:
                old.move(SessionState.CANCELLED)
            session = Session.from_record(record)
            self._sessions[session.episode.rollout_id] = session
            session.observe(self._on_move, self._image.changed)
        for reply in replies:
            self._hold(reply)
        self._notify()
        return [record.episode.next_attempt() for record in sessions]

    def _validate(
        self, records: list[Any], scope: Iterable[EpisodeId] | None
    ) -> tuple[list[SessionRecord], list[RunReply]]:
        try:
            parsed = _RECORDS.validate_python(join_parts(records))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidCheckpointStateError(f"agent record {where}: {first['msg']}") from None
        wanted = None if scope is None else {e.key for e in scope}
        sessions = [
            r
            for r in parsed
            if isinstance(r, SessionRecord) and (wanted is None or r.episode.key in wanted)
        ]
        replies = [r.reply for r in parsed if isinstance(r, FinishedReplyRecord)]
        if sessions and self.mode is not CheckpointMode.TURN:
            raise InvalidCheckpointStateError(
                f"a {self.mode} agent cannot install sessions ({sessions[0].episode.key})"
            )
        seen: set[str] = set()
        for record in sessions:
            rollout_id = record.episode.rollout_id
            if rollout_id in seen:
                raise InvalidCheckpointStateError(f"rollout {rollout_id} saved twice")
            seen.add(rollout_id)
            live = self._sessions.get(rollout_id)
            if live is not None and live.state is not SessionState.RESTORED:
                raise InvalidCheckpointStateError(
                    f"rollout {rollout_id} is running here as {live.key} ({live.state})"
                )
        return sessions, replies

    # --- shutdown ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel every running session and wait for them to stop."""
        await self._image.aclose()
        tasks = [s.task for s in self._sessions.values() if s.task is not None]
        for session in list(self._sessions.values()):
            self._cancel(session)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
