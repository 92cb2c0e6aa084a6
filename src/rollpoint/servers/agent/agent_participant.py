"""The agent server as a checkpoint participant: its session book behind the fence hooks.

Owns the mapping from the :class:`~rollpoint.participant.participant.Participant` hooks to the
:class:`~rollpoint.servers.agent.session_book.SessionBook`, which already speaks the checkpoint's
language (boundaries, readiness, export, install, retire, ack):

- close / open admission → close / open the turn boundaries (sessions park at their next
  boundary; new ``/run`` rows are refused with ``RowRefused``);
- readiness → every session at a boundary (a ``restart_only`` agent is always ready and
  lists its in-flight sessions as restarts);
- export(scope) → the sessions of the scope plus every finished, unacked reply; capture
  (scope) → the same in two steps (a copy of the book's state image in the pause, the
  scope's records out of it after);
  install → restored sessions waiting for their next attempt, all or nothing;
- retire / forget / ack → the book's.

Retired attempts are checked against the fence's retire marks, the one copy: the book
holds the fence's :class:`~rollpoint.participant.RetireMarks` (the agent server wires
``book.marks = fence.marks``) and ``/run`` admission reads them. The fence raises them
before :meth:`retire` runs, and marks a restore's saved attempts right after
:meth:`install` (boundaries are closed meanwhile, so no row is admitted in between);
forget drops them in the fence, and the book has nothing else to forget.

Does not own: sessions, parking (the book), marks, phases and leases (the fence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pydantic import JsonValue

from rollpoint.participant import Readiness, RetireOutcome
from rollpoint.protocol.control import JOURNAL
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

if TYPE_CHECKING:
    from rollpoint.servers.agent.agent_server import AgentServer


class AgentParticipant:
    """The :class:`~rollpoint.participant.participant.Participant` of one agent server."""

    kind = ParticipantKind.AGENT

    def __init__(self, server: AgentServer) -> None:
        self._server = server
        self._book = server.book

    @property
    def features(self) -> tuple[str, ...]:
        base = ("turn-boundary", "finished-replies")
        return (*base, JOURNAL) if self._server.settings.journal else base

    def journal_mark(self) -> JournalMark | None:
        """The turn journal's position as the cut opens (None without a journal)."""
        journal = self._book.journal
        return None if journal is None else journal.mark()

    @property
    def name(self) -> str:
        return self._server.settings.name

    @property
    def replica(self) -> str:
        return self._server.settings.replica

    @property
    def mode(self) -> CheckpointMode:
        return self._book.mode

    @property
    def portable(self) -> bool:
        """A restart-only server's episodes are bound to the process that ran them, so its
        snapshot never moves to another replica (an elastic restore refuses it)."""
        return self.mode is not CheckpointMode.RESTART_ONLY

    async def close_admission(self) -> None:
        self._book.close_boundaries()

    async def open_admission(self) -> None:
        self._book.open_boundaries()

    def readiness(self) -> Readiness:
        return self._book.readiness()

    async def wait_changed(self, timeout: float) -> None:  # noqa: ASYNC109
        await self._book.wait_changed(timeout)

    async def export(self, scope: Sequence[EpisodeId]) -> list[dict[str, JsonValue]]:
        return (await self.capture(scope))()

    async def capture(self, scope: Sequence[EpisodeId]) -> Callable[[], list[dict[str, JsonValue]]]:
        return await self._book.capture(scope)

    def keep_current(self) -> None:
        self._book.keep_current()

    async def aclose(self) -> None:
        await self._book.stop_capturing()

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        return self._book.install(records, scope)

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        return self._book.retire(marks)

    def forget(self, rollout_ids: list[str]) -> list[str]:
        # The marks are the fence's, which drops them itself; no other state is kept by
        # rollout (held replies go with ack).
        return []

    def ack(self, episodes: list[EpisodeId]) -> list[EpisodeId]:
        return self._book.ack(episodes)

    def stats(self) -> dict[str, int]:
        return self._book.counts()
