"""The in-flight samples of a run's event log, for ``rollpoint report``.

Owns :func:`sample_in_flight`: every :data:`~rollpoint.trainer.run_events.SAMPLE_EVERY_S`,
the episodes in flight on each up replica (the ledger's count) and each model server's call
counter (its status), appended to the run's event log as an :class:`InFlight` event. The
trainer loop runs it alongside the run when the run has an event log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.run_events import SAMPLE_EVERY_S, InFlight, RunEvents
from rollpoint.trainer.state.ledger import RecoveryLedger


async def sample_in_flight(
    roster: ReplicaRoster, ledger: RecoveryLedger, events: Callable[[], RunEvents]
) -> None:
    """Episodes in flight per replica (and each model server's call counter) every
    :data:`SAMPLE_EVERY_S`, for ``rollpoint report``, appended to ``events()`` (the run's
    event log as the trainer holds it at each sample). A status that does not answer
    within the period is left out of that sample; sampling never fails the run."""

    async def calls(name: str) -> tuple[str, int | None]:
        for client in roster.participants(name):
            if client.address.kind is ParticipantKind.MODEL:
                try:
                    status = await asyncio.wait_for(client.status(), SAMPLE_EVERY_S)
                except (RollpointError, TimeoutError):
                    return name, None
                return name, status.counts.get("calls_total")
        return name, None

    while True:
        up = list(roster.up)
        episodes = {name: ledger.in_flight_count(name) for name in up}
        answered = await asyncio.gather(*(calls(name) for name in up))
        events().append(
            InFlight(
                ts=time.time(),
                episodes=episodes,
                policy_calls={name: n for name, n in answered if n is not None},
            )
        )
        await asyncio.sleep(SAMPLE_EVERY_S)
