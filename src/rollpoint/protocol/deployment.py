"""Where the environment servers of a run live: what a runtime hands to the trainer."""

from __future__ import annotations

from pydantic import Field

from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.model_base import StrictModel


class ReplicaEndpoints(StrictModel):
    """One replica of the environment deployment: its three servers' base URLs."""

    name: Identifier
    """``replica-<i>``: stable across restarts of the same run."""
    model_url: str
    """Base URL of the model server (OpenAI routes under ``/v1``)."""
    agent_url: str
    resources_url: str


class Deployment(StrictModel):
    replicas: list[ReplicaEndpoints] = Field(min_length=1)
    policy_url: str
    """Base URL (ending in ``/v1``) of the inference engine behind the model servers."""


class ServedDeployment(Deployment):
    """What ``rollpoint serve --json`` prints, parsed unchanged: the deployment, the files
    holding its tokens, and the snapshot root its servers write to (a trainer's snapshot
    store must be that root: the servers write their part of every snapshot there)."""

    control_token_file: str
    data_token_file: str | None
    """None when the servers were started with ``--open-data-routes``."""
    snapshot_store: str | None = None
    """Absent from the output of servers older than this field."""

    def deployment(self) -> Deployment:
        """The deployment alone (the URLs the trainer dispatches to)."""
        return Deployment(replicas=self.replicas, policy_url=self.policy_url)
