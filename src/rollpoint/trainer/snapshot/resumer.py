"""The resumer: reopening every participant a save closed, exactly once.

Owns the resume that ends every save (the abort before a publish and the reopen after a
good cut are one path) and every restore (installed, or cleaned up after a failure: the
:class:`~rollpoint.trainer.restore.installer.Installer` resumes through it), in reverse prepare stages so callees reopen last, with one retry per
participant; and the participants whose resume was lost (:attr:`Resumer.unresumed`), resumed
again before the next save so its prepare does not find them still closed.

It does not decide when a save resumes, nor refuse a save while a participant stays closed
and unreachable (:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator` does both). A
participant it cannot reach reopens by itself when its lease lapses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from rollpoint.protocol.control import Phase
from rollpoint.protocol.errors import RollpointError, TransportError
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.snapshot.control_calls import PREPARE_STAGES, failure_line

log = logging.getLogger(__name__)


class Resumer:
    """Resumes the participants of each save and remembers those it could not reach."""

    def __init__(self) -> None:
        self.unresumed: dict[str, tuple[ParticipantClient, str]] = {}
        """By label: a participant whose resume failed twice, and the checkpoint it was for."""

    async def resume_all(self, checkpoint_id: str, clients: Iterable[ParticipantClient]) -> None:
        """Resume each participant once, callees last (reverse stages). A resume that fails is
        retried once on that participant only; its lease reopens it if that fails too."""
        by_stage = list(clients)
        for stage in reversed(PREPARE_STAGES):
            stage_clients = [p for p in by_stage if p.address.kind == stage]
            results = await asyncio.gather(
                *(p.resume(checkpoint_id) for p in stage_clients), return_exceptions=True
            )
            retry = [
                c
                for c, r in zip(stage_clients, results, strict=True)
                if isinstance(r, BaseException)
            ]
            if not retry:
                continue
            again = await asyncio.gather(
                *(p.resume(checkpoint_id) for p in retry), return_exceptions=True
            )
            for client, result in zip(retry, again, strict=True):
                if isinstance(result, BaseException):
                    log.warning(
                        "%s; resumed again before the next save, and its lease reopens it meanwhile",
                        failure_line(client, "resume", result),
                    )
                    self.unresumed[client.label] = (client, checkpoint_id)

    async def resume_leftovers(self, up: Iterable[ParticipantClient]) -> None:
        """Resume what a lost resume left closed, so the next prepare does not hit a
        participant still holding the last checkpoint (it would refuse: checkpoint_conflict).
        ``up`` is every participant of the replicas that are up now."""
        live = set(up)
        for label, (client, _) in list(self.unresumed.items()):
            if client not in live:
                del self.unresumed[label]  # its replica is down or was replaced
                continue
            try:
                # Resume what it holds, not what we last failed to resume: a prepare lost
                # in a partition leaves it on an older checkpoint, and resuming the newer
                # id is refused while it stays closed until its lease lapses.
                status = await client.status()
                if status.phase is not Phase.IDLE and status.checkpoint_id is not None:
                    await client.resume(status.checkpoint_id)
            except TransportError:
                continue  # still unreachable: the save will name it
            except RollpointError:
                pass  # already reopened (by its lease) and says so: nothing left to do
            del self.unresumed[label]
