"""The trainer's handle on the environment's control plane: participants and the store.

Built once per run from the deployment (which servers exist) and the snapshot config
(where snapshots go); the trainer loop hands it to the coordinator and the release batcher.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import JsonValue

from rollpoint.config import RunConfig
from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.participant_client import ParticipantAddress, ParticipantClient


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


def snapshot_root(config: RunConfig) -> str:
    return config.snapshot.store or str((config.workdir / "snapshots").resolve())


def config_fingerprint(config: RunConfig) -> dict[str, JsonValue]:
    """The config keys a snapshot's saved state depends on; a restore must match them."""
    return {
        "environment": config.environment,
        "group_size": config.group_size,
        "max_turns": config.max_turns,
        "replicas": config.replicas,
        "tasks": config.tasks if config.dataset is None else None,
        "dataset": str(config.dataset) if config.dataset is not None else None,
        "seed": config.seed,
    }
