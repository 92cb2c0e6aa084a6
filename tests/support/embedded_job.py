"""A job on the embedded runtime for integration tests: real server processes, the real trainer.

Owns starting the embedded runtime with control on (a fresh control token, snapshots under
the job's snapshot root), the HTTP client carrying that token, and a trainer wired to it as
``rollpoint run`` wires one: a control plane over every participant, the snapshot store and
``metrics.jsonl`` in the job's workdir. It also reads back what a job left (published
manifests, train rows). It does not run the job, inject faults or judge the results: tests
do. For servers as threads of the test process, see :class:`rollpoint.testing.LocalCluster`
and ``tests/integration/trainer_cluster.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson

from rollpoint.app.config import RunConfig
from rollpoint.envs import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.workdir_record import TRAIN_DATA_FILE
from rollpoint.trainer.train_hooks import TrainHooks
from rollpoint.trainer.trainer import Trainer


@dataclass
class EmbeddedServers:
    """The runtime's servers, and a client that carries their control token."""

    runtime: EmbeddedRuntime
    http: HttpClient

    @property
    def deployment(self) -> Deployment:
        """The deployment as it is now (a restarted replica is at new URLs)."""
        assert self.runtime.deployment is not None
        return self.runtime.deployment

    def participants(self) -> list[ParticipantClient]:
        return participant_clients(self.deployment, self.http)


@dataclass
class EmbeddedJob(EmbeddedServers):
    """The servers plus a trainer over them (not yet running) and where it saves."""

    config: RunConfig
    trainer: Trainer
    store: SnapshotStore
    metrics: TrainerMetrics

    def published(self, since: float | None = None) -> list[SnapshotManifest]:
        """The manifests in the store, only those created after ``since`` (Unix time) if given."""
        manifests = [self.store.load(s.snapshot_id) for s in self.store.list_snapshots()]
        return [m for m in manifests if since is None or m.created_at > since]

    def train_rows(self) -> list[dict[str, Any]]:
        """Every row the trainer wrote to its train data file, in order."""
        path = self.config.workdir / TRAIN_DATA_FILE
        return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@asynccontextmanager
async def embedded_servers(config: RunConfig) -> AsyncIterator[EmbeddedServers]:
    """Start ``config``'s servers (every one a checkpoint participant); stop them on exit."""
    token = secrets.token_urlsafe(16)
    async with (
        EmbeddedRuntime(
            config.runtime_settings(), control_token=token, snapshot_root=config.snapshot_root()
        ) as runtime,
        HttpClient(token=token) as http,
    ):
        assert runtime.deployment is not None
        yield EmbeddedServers(runtime, http)


@asynccontextmanager
async def embedded_job(
    config: RunConfig,
    *,
    hooks: TrainHooks | None = None,
    replica_restart_wait_s: float | None = None,
) -> AsyncIterator[EmbeddedJob]:
    """Start ``config``'s servers and build its trainer over them, with ``config.tasks``
    tasks of its environment; the test runs it. Stops the servers on exit.

    ``replica_restart_wait_s``: how long the trainer holds a lost replica's saved tries
    for it to come back (default: the snapshot deadline)."""
    store = SnapshotStore(config.snapshot_root(), keep=config.snapshot.keep)
    metrics = TrainerMetrics(config.workdir / "metrics.jsonl")
    async with embedded_servers(config) as servers:
        control = ControlPlane(servers.participants(), store, metrics)
        tasks = get_environment(config.environment).make_tasks(config.tasks or 1, config.seed)
        trainer = Trainer(
            config.trainer_settings(),
            servers.deployment,
            tasks,
            hooks=hooks or SimulatedTrainer(config.train.step_seconds),
            control=control,
            replica_restart_wait_s=replica_restart_wait_s,
        )
        try:
            yield EmbeddedJob(servers.runtime, servers.http, config, trainer, store, metrics)
        finally:
            metrics.close()
