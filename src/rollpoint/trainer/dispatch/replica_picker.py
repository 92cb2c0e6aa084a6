"""Replica picker: which up replica a new send goes to, and which replicas are suspect.

Owns the *suspect* marks: a replica whose stream broke (or that reported a transport
failure) is suspect for :data:`SUSPECT_REPLICA_S` unless it answers a row meanwhile, and
new sends prefer the others, so re-sends do not keep hitting a dead agent. Among the
rest it picks the up replica with the fewest rows in flight (by the ledger), ties by name.
It does not mark replicas up or down (the :class:`~rollpoint.trainer.control.replica_roster.ReplicaRoster`
does) and does not send anything.
"""

from __future__ import annotations

import time

from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.state.ledger import RecoveryLedger

SUSPECT_REPLICA_S = 5.0
"""After a transport failure, a replica gets no new rows for this long unless every
replica is suspect or it answers a row meanwhile."""


class ReplicaPicker:
    def __init__(self, roster: ReplicaRoster, ledger: RecoveryLedger) -> None:
        self._roster = roster
        self._ledger = ledger
        self._suspect_until: dict[str, float] = {}

    def least_loaded(self) -> str:
        """The healthy up replica with the fewest rows in flight; ties go by name."""
        now = time.monotonic()
        return min(
            self._roster.up,
            key=lambda name: (
                self._suspect_until.get(name, 0.0) > now,
                self._ledger.in_flight_count(name),
                name,
            ),
        )

    def all_suspect(self) -> bool:
        now = time.monotonic()
        return all(self._suspect_until.get(name, 0.0) > now for name in self._roster.up)

    def suspect(self, replica: str) -> None:
        self._suspect_until[replica] = time.monotonic() + SUSPECT_REPLICA_S

    def trust(self, replica: str) -> None:
        """It answered a row, or it serves again after a restart: no longer suspect."""
        self._suspect_until.pop(replica, None)
