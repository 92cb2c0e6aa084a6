"""The trainer's handle on the environment's control plane: participants and the store.

Built once per run from the deployment (which servers exist) and the snapshot store (where
snapshots go); the trainer loop hands it to the coordinator and the release batcher.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control.participant_client import ParticipantAddress, ParticipantClient
from rollpoint.trainer.metrics import TrainerMetrics


@dataclass
class ControlPlane:
    participants: list[ParticipantClient]
    store: SnapshotStore
    metrics: TrainerMetrics


def participant_clients(deployment: Deployment, http: HttpClient) -> list[ParticipantClient]:
    """One client per participant, in (replica, model/agent/resources) order."""
    clients = []
    for replica in deployment.replicas:
        for kind, url in (
            (ParticipantKind.MODEL, replica.model_url),
            (ParticipantKind.AGENT, replica.agent_url),
            (ParticipantKind.RESOURCES, replica.resources_url),
        ):
            clients.append(
                ParticipantClient(
                    ParticipantAddress(kind=kind, replica=replica.name, url=url), http
                )
            )
    return clients
