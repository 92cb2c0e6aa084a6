"""A try of a row as the recovery ledger keeps it, and the legal moves between its states.

Owns :class:`RolloutState` (where one try stands), :class:`LedgerMove` (the verbs that move
it), :data:`TRANSITIONS` (the one table of legal moves: anything not in it is refused),
:class:`LedgerRecord` (one immutable try of one row) and :class:`LedgerGroup` (one prompt
group's task, size and failure). It keeps no tries and applies no move: the indices over
the records and the one place a move happens are :class:`.ledger.RecoveryLedger`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rollpoint.protocol.ids import EpisodeId

__all__ = [
    "ARCHIVED_STATES",
    "TRANSITIONS",
    "LedgerGroup",
    "LedgerMove",
    "LedgerRecord",
    "RolloutState",
]


class RolloutState(StrEnum):
    """Where one try of one row stands."""

    QUEUED = "queued"
    """Waiting to be sent: new, refused at admission, continued after a restore, or a fresh
    re-send. Nothing runs it and it is not in flight, even while it waits behind the
    closed dispatch barrier. A replica set on a queued try pins where it must go."""
    DISPATCHED = "dispatched"
    """Sent to one replica's agent, which holds it: in flight, and in a snapshot's scope."""
    FINISHED = "finished"
    """Its reply arrived and is being sealed."""
    SEALED = "sealed"
    """Its reply is in the finished queue: final for training. Archived."""
    ABANDONED = "abandoned"
    """The trainer gave up on this try (transport failure, deadline, broken stream, failed
    group). The environment may still run it: it waits to be retired there."""
    RETIRED = "retired"
    """Retired on every participant: nothing of it runs any more. Archived."""


class LedgerMove(StrEnum):
    """The verbs that move a try between states."""

    DISPATCH = "dispatch"
    REQUEUE = "requeue"
    """Refused at admission: it never ran, so it keeps its identity and spends no try."""
    CONTINUE = "continue"
    """Saved by a snapshot and restored: it continues as ``attempt + 1`` on the replica
    holding its restored state (the one that saved it, or another after an elastic restore)."""
    PIN = "pin"
    """Queued after a restore, its work journaled on one replica (issue 35): it goes there,
    where the servers' journals let it go on from its last journaled turn."""
    FINISH = "finish"
    SEAL = "seal"
    ABANDON = "abandon"
    RETIRE = "retire"


S, M = RolloutState, LedgerMove
TRANSITIONS: dict[tuple[RolloutState, LedgerMove], RolloutState] = {
    (S.QUEUED, M.DISPATCH): S.DISPATCHED,
    (S.QUEUED, M.ABANDON): S.ABANDONED,  # its group failed before it was sent
    (S.QUEUED, M.PIN): S.QUEUED,
    (S.DISPATCHED, M.REQUEUE): S.QUEUED,
    (S.DISPATCHED, M.CONTINUE): S.QUEUED,
    (S.DISPATCHED, M.FINISH): S.FINISHED,
    (S.DISPATCHED, M.ABANDON): S.ABANDONED,
    (S.FINISHED, M.SEAL): S.SEALED,
    (S.FINISHED, M.ABANDON): S.ABANDONED,  # its group failed before the reply was sealed
    (S.ABANDONED, M.RETIRE): S.RETIRED,
}
"""Every legal move: ``(state, move) -> next state``. Anything else is refused."""
del S, M

ARCHIVED_STATES = frozenset({RolloutState.SEALED, RolloutState.RETIRED})


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """One try of one row. Immutable: every move replaces the record."""

    task_id: str
    group_id: str
    row: int
    rollout_id: str
    attempt: int
    state: RolloutState
    replica: str | None
    """The replica that holds it (dispatched), held it, or must take it (a queued continue)."""
    tries: int
    """How many fresh rollout ids this row has used, this one included (1 for the first)."""

    _episode: EpisodeId | None = field(default=None, init=False, repr=False, compare=False)
    _record: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def snapshot_record(self, make: Callable[[LedgerRecord], dict[str, Any]]) -> dict[str, Any]:
        """``make(self)``, made the first time only and the same object afterwards.

        A try in flight is one snapshot record (:meth:`LedgerCapture.as_records`); handed
        the very dict it wrote before, the writer references it by identity instead of
        encoding and hashing 100k unchanged tries every snapshot (``snapshot_growth_100k``,
        ``write``). Two threads racing here both make an equal dict; either is kept.
        """
        if self._record is None:
            object.__setattr__(self, "_record", make(self))
        assert self._record is not None
        return self._record

    @property
    def episode(self) -> EpisodeId:
        # Built once per record: a snapshot asks every try in flight for it inside its
        # pause (10k models cost ~10 ms), and a record never changes once made.
        if self._episode is None:
            object.__setattr__(
                self, "_episode", EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt)
            )
        assert self._episode is not None
        return self._episode

    @property
    def key(self) -> str:
        return f"{self.rollout_id}#{self.attempt}"

    @property
    def untouched(self) -> bool:
        """A first try nothing has happened to yet: its group's entry implies all of it."""
        return (
            self.state is RolloutState.QUEUED
            and self.tries == 1
            and self.attempt == 0
            and self.replica is None
        )

    def describe(self) -> str:
        """``r7#0 (row 2 of g1, dispatched on replica-0)``: for error messages and logs."""
        where = f" on {self.replica}" if self.replica else ""
        return f"{self.key} (row {self.row} of {self.group_id}, {self.state}{where})"


@dataclass(frozen=True, slots=True)
class LedgerGroup:
    task_id: str
    group_size: int
    failed: str | None = None
    """Why the group failed, or None while it can still be trained."""
