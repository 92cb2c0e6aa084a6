"""The resources server as a checkpoint participant: per-episode tool state behind the fence hooks.

Owns the mapping from the :class:`~rollpoint.participant.participant.Participant` hooks to the
:class:`~rollpoint.servers.resources.episode_service.ResourcesService`:

- close / open admission → freeze / thaw (tool calls wait at the gate, none is failed);
- readiness → ready iff no tool call is in flight;
- export(scope) → one ``episode_state`` record per scoped rollout with state here (the
  environment's exact export plus the idempotency table), naming the scoped episode;
  capture(scope) → the same in two steps (a copy of the service's state image in the
  pause, the records out of it after); a state not packed yet is packed by the
  snapshot's writer, after the pause (a ``DeferredValue``, see
  :meth:`~rollpoint.servers.resources.episode_service.ResourcesService.capture`);
  install → those records back (from a file or straight from an export), all or nothing;
- retire → ``unknown`` for every rollout: this server runs no episodes, it only answers
  calls, and the fence refuses calls of retired attempts; forget → drop the rollouts'
  state; ack → nothing is held here.

The checkpoint mode is the environment's. A ``restart_only`` environment (math) exports
nothing, installs nothing and never blocks: its episodes start over, and the agent lists
them as restarts. An ``external`` one is saved like a ``turn`` one, except that each
episode's record holds the version of its outside state instead of an export; install
continues only the episodes whose state is still there at that version and leaves the rest
out of its reply, so the trainer restarts them
(:mod:`~rollpoint.servers.resources.external_state`).

Does not own: the state, the gate and idempotency (the service), phases, leases and
retire marks (the fence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pydantic import JsonValue

from rollpoint.participant import Readiness, RetireOutcome, RetireOutcomeKind
from rollpoint.protocol.control import JOURNAL
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

if TYPE_CHECKING:
    from rollpoint.servers.resources.episode_service import ResourcesService


class ResourcesParticipant:
    """The :class:`~rollpoint.participant.participant.Participant` of one resources server."""

    kind = ParticipantKind.RESOURCES

    def __init__(self, service: ResourcesService) -> None:
        self._service = service

    @property
    def features(self) -> tuple[str, ...]:
        base = ("freeze", "tool-idempotency")
        return (*base, JOURNAL) if self._service.tool_journal is not None else base

    def journal_mark(self) -> JournalMark | None:
        """The tool journal's position as the cut opens (None without a journal)."""
        journal = self._service.tool_journal
        return None if journal is None else journal.mark()

    @property
    def name(self) -> str:
        return self._service.name

    @property
    def replica(self) -> str:
        return self._service.replica

    @property
    def mode(self) -> CheckpointMode:
        return self._service.environment.checkpoint_mode

    @property
    def portable(self) -> bool:
        """A restart-only server's episodes are bound to the process that ran them, so its
        snapshot never moves to another replica (an elastic restore refuses it)."""
        return self.mode is not CheckpointMode.RESTART_ONLY

    @property
    def _captures(self) -> bool:
        # An external environment's episodes are saved too: their task, idempotency table
        # and the version of their outside state (never the state itself).
        return self.mode in (CheckpointMode.TURN, CheckpointMode.EXTERNAL)

    async def close_admission(self) -> None:
        self._service.freeze()

    async def open_admission(self) -> None:
        self._service.thaw()

    def readiness(self) -> Readiness:
        in_flight = self._service.in_flight if self._captures else 0
        return Readiness(ready=in_flight == 0, blocker_count=in_flight, counts=self.stats())

    async def wait_changed(self, timeout: float) -> None:  # noqa: ASYNC109
        await self._service.wait_changed(timeout)

    async def export(self, scope: Sequence[EpisodeId]) -> list[dict[str, JsonValue]]:
        return (await self.capture(scope))()

    async def capture(self, scope: Sequence[EpisodeId]) -> Callable[[], list[dict[str, JsonValue]]]:
        if not self._captures:
            return list
        return await self._service.capture(scope)

    def keep_current(self) -> None:
        if self._captures:
            self._service.keep_current()

    async def aclose(self) -> None:
        await self._service.aclose()

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        if not self._captures:
            return []
        installed = set(self._service.install(records, scope))
        saved: dict[str, EpisodeId] = {}
        for episode in scope:
            held = saved.get(episode.rollout_id)
            if episode.rollout_id in installed and (held is None or episode.attempt > held.attempt):
                saved[episode.rollout_id] = episode
        return [saved[r].next_attempt() for r in sorted(saved)]

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        return [
            RetireOutcome(
                episode=EpisodeId(rollout_id=rollout_id, attempt=mark),
                outcome=RetireOutcomeKind.UNKNOWN,
            )
            for rollout_id, mark in marks.items()
        ]

    def forget(self, rollout_ids: list[str]) -> list[str]:
        service = self._service
        return [r for r in dict.fromkeys(rollout_ids) if service.release([r])]

    def ack(self, episodes: list[EpisodeId]) -> list[EpisodeId]:
        return []

    def stats(self) -> dict[str, int]:
        service = self._service
        out = {
            "episodes": service.episode_count,
            "in_flight": service.in_flight,
            "waiting": service.waiting,
        }
        if service.tool_journal is not None:
            out["journal_read_ms"] = service.tool_journal.journal.read_back_ms
        return out
