"""The stuck watchdog: calls waiting on a peer that answers none of them.

Owns :class:`StuckWatch`. A policy engine that lists its models but never answers a chat
call, or a resources server whose tool hangs, leaves rows in flight and nothing said until
the row timeout (minutes) gives them up one try at a time. The watchdog asks each up
replica's model and resources servers for their status about once a second (their control
routes, not the data plane the calls wait on):

- a model server with calls in flight (or waiting at its gate) whose answered-call count
  does not move is waiting on the engine;
- a resources server whose data loop does not run while episodes are in flight on its
  replica is stuck itself (a hung tool on its event loop holds every data route): its
  status does not answer, or, served by its control listener on a loop of its own, says
  the data loop has been quiet longer than a tick (``data_loop_quiet_ms``).

Time paused by a snapshot is not counted (the dispatch barrier's pause clock). After
``warn_s`` of this on one peer, one warning names the peer's URL and how many calls wait;
after ``stop_s``, :meth:`StuckWatch.run` returns the one line the run stops with (the
trainer then takes a snapshot and raises :class:`~rollpoint.protocol.errors.RunStuckError`).
Progress on the peer resets both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.state.ledger import RecoveryLedger

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Peer:
    answered: int | None = None
    """The model server's answered-call count at the last progress (None: not read yet)."""
    quiet_since: float | None = None
    """The pause clock when it last made progress with calls waiting (None: nothing waits)."""
    warned: bool = False


class StuckWatch:
    """Watches every up replica's model and resources servers; see the module docstring."""

    def __init__(
        self,
        roster: ReplicaRoster,
        ledger: RecoveryLedger,
        *,
        policy_url: Callable[[], str],
        clock: Callable[[], float],
        warn_s: float | None,
        stop_s: float | None,
    ) -> None:
        self._roster = roster
        self._ledger = ledger
        self._policy_url = policy_url
        self._clock = clock
        self.warn_s = warn_s
        self.stop_s = stop_s
        self._peers: dict[tuple[str, ParticipantKind], _Peer] = {}
        self.warnings: list[str] = []
        """Every warning said, in order (for tests and the report)."""

    @property
    def tick_s(self) -> float:
        shortest = min(s for s in (self.warn_s, self.stop_s, 4.0) if s is not None)
        return min(1.0, shortest / 4)

    async def run(self) -> str:
        """Watch until a peer is stuck for ``stop_s``; return the line to stop with."""
        if self.warn_s is None and self.stop_s is None:
            await asyncio.Event().wait()  # off: never returns
        while True:
            await asyncio.sleep(self.tick_s)
            stuck = await self.check()
            if stuck is not None:
                return stuck

    async def check(self) -> str | None:
        """One round over the up replicas; the stop line when one is stuck that long."""
        reads = [
            self._read(name, client)
            for name in self._roster.up
            for client in self._roster.participants(name)
            if client.address.kind in (ParticipantKind.MODEL, ParticipantKind.RESOURCES)
        ]
        for line in await asyncio.gather(*reads):
            if line is not None:
                return line
        return None

    async def _read(self, replica: str, client: ParticipantClient) -> str | None:
        kind = client.address.kind
        peer = self._peers.setdefault((replica, kind), _Peer())
        try:
            status = await asyncio.wait_for(client.status(), self.tick_s)
            counts: dict[str, int] | None = status.counts
            data_loop_quiet = (status.data_loop_quiet_ms or 0) / 1000
        except (RollpointError, TimeoutError):
            counts, data_loop_quiet = None, 0.0
        now = self._clock()
        if kind is ParticipantKind.MODEL:
            waiting = (
                self._ledger.in_flight_count(replica)
                if counts is None
                else counts.get("in_flight", 0) + counts.get("waiting", 0)
            )
            answered = None if counts is None else counts.get("calls_total")
            moved = answered is not None and answered != peer.answered
            if answered is not None:
                peer.answered = answered
        else:
            waiting = self._ledger.in_flight_count(replica)
            moved = counts is not None and data_loop_quiet < self.tick_s
        if waiting == 0 or moved:
            self._progress(peer, replica, kind, client)
            return None
        if peer.quiet_since is None:
            peer.quiet_since = now
            return None
        quiet = now - peer.quiet_since
        what = self._what(replica, kind, client, waiting, quiet)
        if self.stop_s is not None and quiet >= self.stop_s:
            return f"{what}; stopped by the watchdog after {self.stop_s:g}s (watchdog.stop_seconds)"
        if self.warn_s is not None and quiet >= self.warn_s and not peer.warned:
            peer.warned = True
            then = (
                f"; the run stops after {self.stop_s:g}s of this (watchdog.stop_seconds)"
                if self.stop_s is not None
                else ""
            )
            line = f"{what}{then}"
            self.warnings.append(line)
            log.warning("%s", line)
        return None

    def _progress(
        self, peer: _Peer, replica: str, kind: ParticipantKind, client: ParticipantClient
    ) -> None:
        if peer.warned:
            log.warning("%s answers again", self._name(replica, kind, client))
        peer.quiet_since = None
        peer.warned = False

    def _name(self, replica: str, kind: ParticipantKind, client: ParticipantClient) -> str:
        if kind is ParticipantKind.MODEL:
            return f"the policy engine at {self._policy_url()}"
        return f"{replica}'s resources server at {self._roster.endpoints(replica).resources_url}"

    def _what(
        self,
        replica: str,
        kind: ParticipantKind,
        client: ParticipantClient,
        waiting: int,
        quiet: float,
    ) -> str:
        calls = "call" if waiting == 1 else "calls"
        if kind is ParticipantKind.MODEL:
            via = self._roster.endpoints(replica).model_url
            return (
                f"the policy engine at {self._policy_url()} has answered none of the "
                f"{waiting} {calls} waiting on it for {quiet:.0f}s ({replica}'s model "
                f"server at {via})"
            )
        return (
            f"{self._name(replica, kind, client)} has not answered for {quiet:.0f}s with "
            f"{waiting} episodes in flight on {replica}"
        )
