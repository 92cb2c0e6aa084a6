"""The replica roster: which replicas are up, where they live, and their control clients.

Owns the trainer's one view of the environment deployment while a run goes on: each
replica's endpoints (they change when the runtime restarts a replica on new ports), whether
it is up, and the control client of each of its participants (rebuilt for the new URLs when
it comes back). The dispatcher sends only to up replicas; the snapshot coordinator and the
release batcher talk only to the participants of up replicas.

It does not notice a replica dying (the runtime does, and tells the
:class:`~rollpoint.trainer.trainer.Trainer`, which marks it here) nor decide what
becomes of the work a lost replica held (the dispatcher does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import BadRequestError, ConfigError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.participant_client import ParticipantClient

_URL_OF_KIND = {
    ParticipantKind.MODEL: "model_url",
    ParticipantKind.AGENT: "agent_url",
    ParticipantKind.RESOURCES: "resources_url",
}


class ReplicaRoster:
    """Every replica of one deployment, up or down, with its participants' clients."""

    def __init__(
        self,
        replicas: Iterable[ReplicaEndpoints],
        participants: Iterable[ParticipantClient] = (),
        *,
        policy_url: str = "",
    ) -> None:
        self._endpoints = {r.name: r for r in replicas}
        self._policy_url = policy_url
        self._clients: dict[str, list[ParticipantClient]] = {name: [] for name in self._endpoints}
        for client in participants:
            clients = self._clients.get(client.address.replica)
            if clients is None:
                raise ConfigError(
                    f"participant {client.label} names a replica the deployment does not have"
                )
            clients.append(client)
        self._down: set[str] = set()
        self._some_up = asyncio.Event()
        self._some_up.set()

    @classmethod
    def of_deployment(
        cls, deployment: Deployment, participants: Iterable[ParticipantClient] = ()
    ) -> ReplicaRoster:
        return cls(deployment.replicas, participants, policy_url=deployment.policy_url)

    @classmethod
    def of_participants(cls, participants: Iterable[ParticipantClient]) -> ReplicaRoster:
        """A roster built from control clients alone (their URLs give the endpoints)."""
        clients = list(participants)
        urls: dict[str, dict[str, str]] = {}
        for client in clients:
            field = _URL_OF_KIND[client.address.kind]
            urls.setdefault(client.address.replica, {})[field] = client.address.url
        replicas = [
            ReplicaEndpoints(
                name=name,
                model_url=found.get("model_url", ""),
                agent_url=found.get("agent_url", ""),
                resources_url=found.get("resources_url", ""),
            )
            for name, found in urls.items()
        ]
        return cls(replicas, clients)

    # --- reading -----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Every replica, up or down, in deployment order."""
        return list(self._endpoints)

    @property
    def up(self) -> list[str]:
        return [name for name in self._endpoints if name not in self._down]

    @property
    def down(self) -> list[str]:
        return [name for name in self._endpoints if name in self._down]

    def __contains__(self, name: object) -> bool:
        return name in self._endpoints

    def is_up(self, name: str) -> bool:
        return name in self._endpoints and name not in self._down

    @property
    def any_up(self) -> bool:
        return len(self._down) < len(self._endpoints)

    async def wait_any_up(self) -> None:
        """Return at once while some replica is up; otherwise wait until one comes back."""
        await self._some_up.wait()

    def endpoints(self, name: str) -> ReplicaEndpoints:
        try:
            return self._endpoints[name]
        except KeyError:
            raise BadRequestError(f"replica roster: no replica {name}") from None

    def deployment(self) -> Deployment:
        """The deployment as it is now (the current URLs of every replica, up or down)."""
        return Deployment(replicas=list(self._endpoints.values()), policy_url=self._policy_url)

    def participants(self, replica: str | None = None) -> list[ParticipantClient]:
        """The control clients of every up replica, or of one (none while it is down)."""
        if replica is not None:
            return list(self._clients.get(replica, ())) if self.is_up(replica) else []
        return [c for name in self.up for c in self._clients[name]]

    def agent(self, replica: str) -> ParticipantClient | None:
        """The agent's control client of an up replica, if it has one."""
        for client in self.participants(replica):
            if client.address.kind == ParticipantKind.AGENT:
                return client
        return None

    # --- changes -----------------------------------------------------------------------

    def mark_down(self, name: str) -> bool:
        """The replica's processes are gone; True when it was up until now."""
        self.endpoints(name)
        if name in self._down:
            return False
        self._down.add(name)
        if not self.any_up:
            self._some_up.clear()
        return True

    def mark_up(self, endpoints: ReplicaEndpoints) -> None:
        """The replica serves again at ``endpoints``: its control clients point there now."""
        name = endpoints.name
        self.endpoints(name)
        self._endpoints[name] = endpoints
        self._clients[name] = [
            c.relocated(getattr(endpoints, _URL_OF_KIND[c.address.kind]))
            for c in self._clients[name]
        ]
        self._down.discard(name)
        self._some_up.set()
