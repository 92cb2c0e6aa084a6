"""A test double of the Participant hooks, with readiness and failures the test controls.

It keeps a tiny state (episode key → turns completed), counts every hook call, and
tracks whether admission is open, so tests can check what the fence asked of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

from pydantic import JsonValue

from rollpoint.participant.participant import (
    Participant,
    Readiness,
    RetireOutcome,
    RetireOutcomeKind,
)
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind


class FakeClock:
    """Wall-clock stand-in: moves only when told to."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class HookFailure(RuntimeError):
    """What a hook raises when a test asks it to fail."""


class FakeParticipant:
    def __init__(
        self,
        *,
        kind: ParticipantKind = ParticipantKind.AGENT,
        name: str = "agent",
        replica: str = "replica-0",
        clock: FakeClock | None = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.replica = replica
        self.mode = CheckpointMode.TURN
        self.features: tuple[str, ...] = ("turn-boundary",)
        self.portable = True
        self.clock = clock
        self.admission_open = True
        self.calls: Counter[str] = Counter()
        self.blockers: list[str] = []
        self.restarts: list[EpisodeId] = []
        self.finished_unacked: list[EpisodeId] = []
        self.running: list[EpisodeId] = []
        self.state: dict[str, int] = {}
        """Episode key → turns completed: what export saves and install replaces."""
        self.fail: set[str] = set()
        """Names of hooks that raise :class:`HookFailure`."""
        self.export_gate: asyncio.Event | None = None
        """When set, export waits for this event (to hold a commit in flight)."""
        self._changed = asyncio.Event()

    def set_blockers(self, keys: list[str]) -> None:
        self.blockers = list(keys)
        self._changed.set()

    def _hook(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.fail:
            raise HookFailure(f"{name} failed on purpose")

    async def close_admission(self) -> None:
        self._hook("close_admission")
        self.admission_open = False

    async def open_admission(self) -> None:
        self._hook("open_admission")
        self.admission_open = True

    def readiness(self) -> Readiness:
        self._hook("readiness")
        return Readiness(
            ready=not self.blockers,
            blockers=list(self.blockers),
            blocker_count=len(self.blockers),
            restarts=list(self.restarts),
            finished_unacked=list(self.finished_unacked),
            counts={"sessions": len(self.state)},
        )

    async def wait_changed(self, timeout: float) -> None:  # noqa: ASYNC109
        self.calls["wait_changed"] += 1
        if self.clock is not None:
            self.clock.advance(timeout)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        self._changed.clear()

    async def export(self, scope: list[EpisodeId]) -> list[dict[str, JsonValue]]:
        self._hook("export")
        if self.export_gate is not None:
            await self.export_gate.wait()
        saved: list[dict[str, JsonValue]] = [
            {"episode": e.key, "turns": self.state.get(e.key, 0)} for e in scope
        ]
        replies: list[dict[str, JsonValue]] = [{"finished": e.key} for e in self.finished_unacked]
        return [*saved, *replies]

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        self._hook("install")
        wanted = {e.key for e in scope}
        new_state: dict[str, int] = {}
        for record in records:
            key, turns = record.get("episode"), record.get("turns")
            if key is None:
                continue
            if not isinstance(key, str) or not isinstance(turns, int):
                raise InvalidCheckpointStateError(f"bad record {record!r}")
            if key in wanted:
                next_key = EpisodeId.from_key(key).next_attempt().key
                new_state[next_key] = turns
        # All or nothing: the state changes only once every record was accepted.
        self.state = new_state
        return [e.next_attempt() for e in scope]

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        self._hook("retire")
        outcomes: list[RetireOutcome] = []
        for episode in list(self.running):
            if marks.get(episode.rollout_id, -1) >= episode.attempt:
                self.running.remove(episode)
                outcomes.append(RetireOutcome(episode=episode, outcome=RetireOutcomeKind.CANCELLED))
        for episode in self.finished_unacked:
            if marks.get(episode.rollout_id, -1) >= episode.attempt:
                outcomes.append(
                    RetireOutcome(episode=episode, outcome=RetireOutcomeKind.FINISHED_UNACKED)
                )
        return outcomes

    def forget(self, rollout_ids: list[str]) -> list[str]:
        self._hook("forget")
        return [r for r in rollout_ids if any(e.rollout_id == r for e in self.finished_unacked)]

    def ack(self, episodes: list[EpisodeId]) -> list[EpisodeId]:
        self._hook("ack")
        acked = [e for e in episodes if e in self.finished_unacked]
        self.finished_unacked = [e for e in self.finished_unacked if e not in acked]
        return acked

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self.state), "finished_unacked": len(self.finished_unacked)}

    def snapshot(self) -> dict[str, Any]:
        """What a refused call must leave untouched."""
        return {
            "admission_open": self.admission_open,
            "state": dict(self.state),
            "calls": {k: v for k, v in self.calls.items() if k not in ("readiness",)},
        }


def _conforms(participant: FakeParticipant) -> Participant:
    # Type-checks that the fake satisfies the protocol the servers implement.
    return participant
