"""The agent server's turn journal: each completed turn and each finished reply, durable.

Owns: the agent server's :class:`~rollpoint.store.journal.Journal` (a folder in the snapshot
store, ``<store>/journal/agent/<name>-<replica>/``), what its records hold, and bringing a
session to its last journaled turn after a crash (docs/journal.md).

Records, queued as the session goes on (a turn: not waited for, see :meth:`TurnJournal.turn`)
or made durable before the reply is handed on::

    turn   agent|<rollout>|a<attempt>|t<t>     what turn t added: {"turn", "messages",
                                               "model_call", "pending", "loop_state"}
    reply  reply|<rollout>|a<attempt>|t<turns> the finished RunReply

A turn is journaled at each turn boundary where the session changed: after its policy call
(the response pending, tool calls not applied) and again after its tools (the last record of
a key answers it). ``messages`` is what turn ``t`` added to the conversation: its assistant
message, then its tool results; ``model_call`` the policy call with its token data.

**Resuming** (:meth:`TurnJournal.resume`): the journal of an earlier process of this server
(what the journal held when it was opened) is indexed by rollout and turn. A session that
starts or continues here (fresh from its prompt, or restored from a snapshot at turn ``k``)
is brought forward turn by turn through the journaled turns from where it stands, as long
as they follow on: the restored episode continues at its last journaled turn, not the
snapshot's. A journaled attempt above the session's is never used. The journal of an
attempt at or below it is, whichever attempt it was (a restored session runs under the next
attempt; a row the snapshot held queued is sent again under its own): the same rollout is
the same row and the same conversation. The resources server rebuilds the episode's state
to match (:meth:`~rollpoint.servers.resources.tool_journal.ToolJournal.catch_up`) when the
episode starts.

**Adopting**: a row whose rollout finished before the crash resumes at its last journaled
turn, its final answer pending, so only the verdict is asked again (on the state the
resources server rebuilt from its journal: the environment's own final-state log and
rewards stay its own); no policy or tool call is made again. Its journaled reply is the
check (:meth:`TurnJournal.check`: a different verdict is a warning naming the episode).
That is what covers the trainer's seals after the last snapshot: a reply sealed, acked and
dropped by the agent before the crash is in the journal, and the restored trainer, which
re-sends the row (its snapshot held it queued or in flight), gets it back from here.

Only what an earlier process journaled is indexed (what this process journals is in its
memory already), and each entry is dropped once used, so the index holds the work a crash
interrupted. Does not own: sessions or admission (:mod:`.session_book`), the segment format,
group commit or retention (:mod:`rollpoint.store.journal`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from rollpoint.protocol.episode import ModelCall, RunReply
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.manifest import JournalMark
from rollpoint.servers.agent.session import Session
from rollpoint.store.journal import Journal, Position
from rollpoint.store.journal_format import journal_key
from rollpoint.store.journal_shipping import (
    Shipping,
    journal_relative,
    journal_url,
    open_store_journal,
)

log = logging.getLogger(__name__)

TURN = "turn"
REPLY = "reply"


@dataclass(slots=True)
class TurnJournalCounts:
    turns: int = 0
    """Turns journaled by this process."""
    replies: int = 0
    """Finished replies journaled by this process."""
    resumed_turns: int = 0
    """Turns of earlier processes a session was brought through (not played again)."""
    resumed_sessions: int = 0
    adopted: int = 0
    """Rows answered with a reply an earlier process journaled (not run again)."""
    recovered: int = 0
    """Records found in the journal when it was opened."""


def _parse(key: str) -> tuple[str, int, int]:
    # <kind>|<rollout>|a<attempt>|t<turn>: journal_key refuses parts with '|'.
    _, rollout_id, attempt, turn = key.split("|")[:4]
    return rollout_id, int(attempt[1:]), int(turn[1:])


def _last_assistant(messages: list[dict[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return index
    return len(messages)


class TurnJournal:
    """The journal of one agent server; open with :meth:`open`."""

    def __init__(self, journal: Journal, relative: str) -> None:
        self.journal = journal
        self.shipping: Shipping | None = None
        """Shipping the journal to an fsspec store from this machine's spool (None: the
        store is a local folder, the journal is in it): :mod:`rollpoint.store.journal_shipping`."""
        self.relative = relative
        self.counts = TurnJournalCounts()
        self._turns: dict[str, dict[int, tuple[int, str]]] = {}
        """Earlier processes' turns: rollout → turn → (highest attempt, its key)."""
        self._replies: dict[str, tuple[int, str]] = {}
        """Earlier processes' finished replies: rollout → (attempt, key)."""
        self._written: dict[str, tuple[int, int, int, bool]] = {}
        """rollout → (attempt, turn, messages, pending) as last journaled: a boundary passed
        again with nothing new (a park) appends nothing."""
        for rec in journal.records_after():
            if rec.kind == TURN:
                rollout_id, attempt, turn = _parse(rec.key)
                turns = self._turns.setdefault(rollout_id, {})
                if turn not in turns or turns[turn][0] <= attempt:
                    turns[turn] = (attempt, rec.key)
            elif rec.kind == REPLY:
                rollout_id, attempt, _ = _parse(rec.key)
                if rollout_id not in self._replies or self._replies[rollout_id][0] <= attempt:
                    self._replies[rollout_id] = (attempt, rec.key)
            else:
                continue
            self.counts.recovered += 1

    @classmethod
    async def open(cls, folder: str, relative: str, *, window_s: float) -> TurnJournal:
        journal = await asyncio.to_thread(Journal.open, folder, window_s=window_s)
        return await asyncio.to_thread(cls, journal, relative)

    def rollouts(self) -> list[str]:
        """The rollouts an earlier process journaled turns of, still to be resumed here."""
        return sorted(self._turns)

    def pending(self, restored: dict[str, int]) -> tuple[int, int]:
        """(turns, finished replies) an earlier process journaled that are still to be
        resumed or adopted; a turn at or below where a restored session (rollout → turn)
        stands is the snapshot's, not counted."""
        turns = sum(
            sum(1 for t in by_turn if t >= restored.get(rollout_id, 0))
            for rollout_id, by_turn in self._turns.items()
        )
        return turns, len(self._replies)

    def mark(self) -> JournalMark:
        """Where the journal stands as a cut opens (the commit saves it)."""
        if self.journal.forget_removed():
            self._turns = {
                rid: kept
                for rid, turns in self._turns.items()
                if (kept := {t: v for t, v in turns.items() if v[1] in self.journal})
            }
            self._replies = {r: v for r, v in self._replies.items() if v[1] in self.journal}
        position = self.journal.checkpoint()
        return JournalMark(folder=self.relative, segment=position.segment, offset=position.offset)

    # --- appending -------------------------------------------------------------------------

    def turn(self, session: Session) -> None:
        """Journal the session's last turn as it stands at this boundary (if it changed).

        Queued, not waited for: the session goes on while it is made durable. A turn record
        only lets a resume skip ahead; the policy call and tool calls it holds are already
        durable in the model and resources servers' journals (each before its reply was
        handed on), which answer them when a resume starts from an earlier turn. Waiting
        here cost two group commits a turn, as many as those two journals together
        (docs/log/journal-2026-12.md). The journal makes records durable in order, so the
        finished reply (awaited, :meth:`reply`) is durable only after every turn before it.
        Raises at once when the journal is broken (an earlier write failed)."""
        last = session.turn - 1
        if last < 0:
            return
        rollout_id, attempt = session.episode.rollout_id, session.episode.attempt
        messages = session.messages
        pending = session.pending_response
        stamp = (attempt, session.turn, len(messages), pending is None)
        if self._written.get(rollout_id) == stamp:
            return
        value = {
            "turn": session.turn,
            "messages": messages[_last_assistant(messages) :],
            "model_call": session.model_calls[last].model_dump(mode="json"),
            "pending": pending,
            "loop_state": session.loop_state,
        }
        durable = self.journal.append_soon(
            journal_key("agent", rollout_id, attempt, last), TURN, orjson.dumps(value), json=True
        )
        durable.add_done_callback(self._turn_written)
        self._written[rollout_id] = stamp
        self.counts.turns += 1

    def _turn_written(self, durable: asyncio.Future[Position]) -> None:
        # Every later append fails too (the journal is broken), and the next boundary's or
        # the reply's raises for its session: one line here, for the record that failed.
        if not durable.cancelled() and (exc := durable.exception()) is not None:
            log.warning("agent journal %s: a turn record was not written: %s", self.relative, exc)

    async def reply(self, reply: RunReply) -> None:
        """Journal a finished reply before it is handed on."""
        episode = reply.episode
        key = journal_key(REPLY, episode.rollout_id, episode.attempt, reply.turns)
        await self.journal.append_json(key, REPLY, reply.model_dump(mode="json"))
        self._written.pop(episode.rollout_id, None)
        self.counts.replies += 1

    # --- after a crash ---------------------------------------------------------------------

    def check(self, reply: RunReply) -> None:
        """A row resumed from the journal finished again: when an earlier process journaled
        it finished, the verdict must be the one it journaled (warn, naming the episode,
        when the environment judged the rebuilt state otherwise)."""
        rollout_id = reply.episode.rollout_id
        found = self._replies.pop(rollout_id, None)
        if found is None or found[0] > reply.episode.attempt:
            return
        rec = self.journal.lookup(found[1])
        if rec is None:
            return
        journaled = RunReply.model_validate(rec.value())
        self.counts.adopted += 1
        if (journaled.reward, journaled.turns) != (reply.reward, reply.turns):
            log.warning(
                "episode %s: finished again from the journal with reward %s after %d turns, "
                "journaled with reward %s after %d (an environment that is not deterministic?)",
                reply.episode.key,
                reply.reward,
                reply.turns,
                journaled.reward,
                journaled.turns,
            )

    def resume(self, session: Session) -> int:
        """Bring ``session`` (fresh, or restored from a snapshot) through the turns an earlier
        process journaled after where it stands; returns how many it went through."""
        rollout_id = session.episode.rollout_id
        turns = self._turns.pop(rollout_id, None)
        if not turns:
            return 0
        applied = 0
        turn = session.turn - 1 if session.pending_response is not None else session.turn
        while turn in turns:
            attempt, key = turns[turn]
            if attempt > session.episode.attempt:
                break
            rec = self.journal.lookup(key)
            if rec is None:
                break
            value: dict[str, Any] = rec.value()
            if turn == session.turn - 1:
                # The session has this turn's policy call, its tools not applied yet.
                if value["pending"] is not None:
                    break  # journaled no further than the session stands
                start = _last_assistant(session.messages)
                session.messages = [*session.messages[:start], *value["messages"]]
            else:
                for message in value["messages"]:
                    session.add_message(message)
                session.add_model_call(ModelCall.model_validate(value["model_call"]))
                session.turn = value["turn"]
            session.pending_response = value["pending"]
            session.loop_state = value["loop_state"]
            applied += 1
            turn += 1
            if value["pending"] is not None:
                break  # its tools come next: a later turn cannot have been journaled whole
        if applied:
            self.counts.resumed_sessions += 1
            self.counts.resumed_turns += applied
        return applied

    async def close(self) -> None:
        if self.shipping is not None:
            await self.shipping.aclose()  # what is left shipped, while the journal is open
        await self.journal.close()


async def open_turn_journal(
    snapshot_root: str | None, name: str, replica: str, *, window_s: float
) -> TurnJournal:
    if snapshot_root is None:
        raise ConfigError(f"agent server {name}/{replica}: journal needs a snapshot store")
    relative = journal_relative("agent", name, replica)
    folder = journal_url(snapshot_root, relative)
    journal, shipping = await open_store_journal(snapshot_root, relative, window_s=window_s)
    opened = await asyncio.to_thread(TurnJournal, journal, relative)
    opened.shipping = shipping
    log.info(
        "agent server %s/%s: turn journal %s holds %d records",
        name,
        replica,
        folder,
        opened.counts.recovered,
    )
    return opened
