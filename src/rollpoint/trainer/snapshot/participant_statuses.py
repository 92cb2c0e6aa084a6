"""Participant statuses: who each participant of the snapshots said it is.

Owns the answers to ``status`` (kind, name, replica, checkpoint mode, features), asked of
every participant as the run starts and of a replica's new servers at the first save after
it came back; the refusals on discovery (a server that says it is another kind than the
trainer addresses; restart-only servers unless ``snapshot.allow_restart_only``); and what a
manifest says of the participants: their entries (:meth:`ParticipantStatuses.entries`) and
the topology fingerprint (:meth:`ParticipantStatuses.fingerprint`).

It does not decide when to ask nor retry a participant that did not answer
(:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator` does).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from rollpoint.protocol.control import StatusReply, Verb
from rollpoint.protocol.errors import ConfigError, RollpointError
from rollpoint.protocol.manifest import ParticipantEntry, topology_fingerprint
from rollpoint.protocol.participant import CheckpointMode
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.snapshot.control_calls import blocker
from rollpoint.trainer.snapshot.cut import SaveBlocked

__all__ = ["ParticipantStatuses"]

log = logging.getLogger(__name__)


class ParticipantStatuses:
    """The status each participant answered, by client."""

    def __init__(self) -> None:
        # Keyed by client: a replica that comes back gets new clients, asked afresh.
        self._statuses: dict[ParticipantClient, StatusReply] = {}

    def __contains__(self, client: ParticipantClient) -> bool:
        return client in self._statuses

    def __getitem__(self, client: ParticipantClient) -> StatusReply:
        return self._statuses[client]

    async def ask(self, clients: list[ParticipantClient], *, allow_restart_only: bool) -> None:
        """Ask each of ``clients`` who it is, once. One that does not answer raises
        :class:`SaveBlocked`; a wrong kind, or restart-only servers not allowed, raise
        :class:`ConfigError`."""
        replies = await asyncio.gather(*(p.status() for p in clients), return_exceptions=True)
        for client, reply in zip(clients, replies, strict=True):
            if isinstance(reply, BaseException):
                found = blocker(client.label, Verb.STATUS, reply)
                detail = reply.message if isinstance(reply, RollpointError) else repr(reply)
                said = f"participant {client.label} did not answer status: {detail}"
                raise SaveBlocked([replace(found, message=said)])
            if reply.kind != client.address.kind:
                raise ConfigError(
                    f"{client.label} says it is a {reply.kind} server, not a {client.address.kind}"
                )
            self._statuses[client] = reply
        restart_only = [
            c.label for c in clients if self._statuses[c].mode == CheckpointMode.RESTART_ONLY
        ]
        if restart_only and not allow_restart_only:
            raise ConfigError(
                f"restart-only server(s) {', '.join(restart_only)}: their in-flight episodes would start over "
                "after a crash; set snapshot.allow_restart_only: true to accept that"
            )
        if restart_only:
            log.warning(
                "restart-only servers accepted: %s (their episodes restart after a crash)",
                restart_only,
            )

    def entries(self, clients: list[ParticipantClient]) -> list[ParticipantEntry]:
        """Manifest entries of ``clients``, once discovered."""
        entries = []
        for client in clients:
            status = self._statuses[client]
            instance = f"{status.name}-{status.replica}"
            entries.append(
                ParticipantEntry(
                    kind=status.kind,
                    name=status.name,
                    replica=status.replica,
                    mode=status.mode,
                    instance=instance,
                    manifest_path=f"participants/{status.kind.value}/{instance}/manifest.json",
                )
            )
        return entries

    def fingerprint(self, clients: list[ParticipantClient]) -> str:
        return topology_fingerprint(
            [
                # The digests are the store's, stamped at publication: not the topology.
                e.model_dump(mode="json", exclude={"sha256", "bytes"}) | {"features": []}
                for e in self.entries(clients)
            ]
        )
