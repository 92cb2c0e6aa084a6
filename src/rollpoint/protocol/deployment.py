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
