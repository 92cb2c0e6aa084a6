"""The hooks a server implements to take part in checkpoints: the :class:`Participant` protocol.

Owns the contract between the fence (:mod:`rollpoint.participant.fence`, which runs the phase
machine, the lease, replays and retire marks) and a server's own state: the model server
(admission gate, call ledger), the agent server (sessions, finished replies) and the
resources server (per-episode tool state). A server implements these hooks and nothing
about phases, ids, deadlines or files: the fence decides when each hook runs and never
calls two of them at once, except the read-only :meth:`Participant.readiness`,
:meth:`Participant.stats` and :meth:`Participant.wait_changed`.

Hooks that a verb calls, in order:

- prepare → ``close_admission`` once, then (a :class:`JournalingParticipant`)
  ``journal_mark`` once: where its journal stands as the cut opens, saved in the
  commit's manifest; then ``readiness`` / ``wait_changed`` until ready or the deadline.
- commit → ``readiness`` (re-checked), ``export(scope)`` once per checkpoint; or, when the
  participant also has ``capture`` (:class:`CapturingParticipant`), ``capture(scope)`` in
  the pause and the function it returns in the writer's thread after it.
- resume, lease expiry, a failed prepare or restore → ``open_admission`` once.
- restore → ``close_admission``, then ``install(records, scope)``.
- retire / forget / ack → the hook of the same name.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import JsonValue

from rollpoint.protocol.control import Readiness, RetireOutcome, RetireOutcomeKind
from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind

__all__ = [
    "CapturingParticipant",
    "JournalingParticipant",
    "Participant",
    "Readiness",
    "RetireOutcome",
    "RetireOutcomeKind",
    "await_hook",
    "call_hook",
    "hook_error",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class Participant(Protocol):
    """What the fence needs from a server. Attributes may be plain attributes or properties."""

    @property
    def kind(self) -> ParticipantKind: ...

    @property
    def name(self) -> str:
        """The server's name, e.g. ``model``; with :attr:`replica` it names its state folder."""
        ...

    @property
    def replica(self) -> str:
        """The replica it belongs to, e.g. ``replica-0``."""
        ...

    @property
    def mode(self) -> CheckpointMode: ...
    @property
    def portable(self) -> bool:
        """Whether its saved episodes may be restored onto another replica (an elastic
        restore refuses to move state that is not); reported by status."""
        ...

    @property
    def features(self) -> tuple[str, ...]:
        """Additive capabilities reported by status (ignored by topology fingerprints)."""
        ...

    async def close_admission(self) -> None:
        """Stop taking new work: the model closes its gate (new calls wait, running calls
        finish); an agent parks sessions at turn boundaries; resources freeze tool calls.
        Return at once: the fence waits for readiness, not for this call."""
        ...

    async def open_admission(self) -> None:
        """Undo :meth:`close_admission` (resume, lease expiry, a failed prepare or restore).
        Must be safe to call when admission is already open."""
        ...

    def readiness(self) -> Readiness:
        """The current report. Called often while preparing: keep it O(1)-ish (counters,
        not scans over 100k sessions). Restarts (episodes a restart-only participant cannot
        capture) must never count as blockers. The fence caps ``blockers`` on the wire."""
        ...

    # The timeout is part of the contract (a bounded wait), not a cancellation knob.
    async def wait_changed(self, timeout: float) -> None:  # noqa: ASYNC109
        """Return when readiness may have changed, or after ``timeout`` seconds, whichever
        comes first (the fence waits on this instead of polling)."""
        ...

    async def export(self, scope: Sequence[EpisodeId]) -> list[dict[str, JsonValue]]:
        """The records of the episodes in ``scope`` (an agent adds its finished, unacked
        replies). Called at most once per checkpoint, with admission closed. ``scope`` is
        an :class:`~rollpoint.participant.episode_scope.EpisodeScope`: distinct, in key order, and
        cheapest read as keys (:func:`~rollpoint.participant.episode_scope.episode_pairs`).
        A record value may be a :class:`~rollpoint.tuning.deferred_value.DeferredValue`,
        made by the writer after the pause from a copy nobody changes."""
        ...

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        """Install the saved records of the episodes in ``scope``, all or nothing: on any
        error raise and leave the state as it was. Returns the next attempts made ready."""
        ...

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        """Stop work of retired attempts: ``marks`` maps rollout_id → highest retired
        attempt. One outcome per attempt found: cancelled, finished_unacked or unknown."""
        ...

    def forget(self, rollout_ids: list[str]) -> list[str]:
        """Drop what is kept about these rollouts; return the ids that were known."""
        ...

    def ack(self, episodes: list[EpisodeId]) -> list[EpisodeId]:
        """Release the finished replies of these episodes; return those that were held."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters shown by status (sessions, in flight, held replies...). Called on the
        control listener's thread while the data loop runs
        (:mod:`rollpoint.participant.control_listener`): read counters and sizes only; if it
        raises there it is called again on the data loop."""
        ...


@runtime_checkable
class CapturingParticipant(Participant, Protocol):
    """A participant whose export comes in two steps, so that its pause is a copy.

    ``capture(scope)`` runs in the pause, like ``export``, and returns a function that
    builds the records ``export(scope)`` would have returned. The fence calls that
    function in the writer's thread after the checkpoint resumed, while the server goes
    on: it must read only what the capture copied (values nobody changes afterwards).
    """

    async def capture(
        self, scope: Sequence[EpisodeId]
    ) -> Callable[[], list[dict[str, JsonValue]]]: ...

    def keep_current(self) -> None:
        """Start keeping what ``capture`` copies current in the background: the fence
        calls it once, on the event loop, when a coordinator first asks for its status (or
        first prepares), so a first checkpoint does not build every record in its pause."""
        ...

    async def aclose(self) -> None:
        """Stop what capturing started (a background sweep); the fence calls it when it
        closes."""
        ...


@runtime_checkable
class JournalingParticipant(Participant, Protocol):
    """A participant that journals its completed work (docs/journal.md).

    ``journal_mark()`` is called once per checkpoint, on the event loop, right after
    ``close_admission``: the position its journal has reached as the cut opens (the end
    of the last durable record), or None when it journals nothing now. The commit's
    manifest saves it; a restore from that snapshot replays the journal after it, and
    retention keeps every journal segment a kept snapshot's mark still needs. Keep it
    cheap: no waiting (start any follow-up, such as closing the active segment, in the
    background).
    """

    def journal_mark(self) -> JournalMark | None: ...


# --- calling a hook ------------------------------------------------------------------------
# A hook that raises one of our errors keeps it; anything else is a bug in the server, logged
# with its traceback and turned into a typed error naming the hook, so a verb never answers
# a bare 500.


def hook_error(hook: str, exc: Exception, cls: type[RollpointError]) -> RollpointError:
    if isinstance(exc, RollpointError):
        return exc
    log.error("participant hook %s failed", hook, exc_info=exc)
    return cls(f"participant {hook} failed: {type(exc).__name__}: {exc}")


def call_hook(hook: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except Exception as exc:
        raise hook_error(hook, exc, RollpointError) from None


async def await_hook(
    hook: str, awaitable: Awaitable[T], cls: type[RollpointError] = RollpointError
) -> T:
    try:
        return await awaitable
    except Exception as exc:
        raise hook_error(hook, exc, cls) from None
