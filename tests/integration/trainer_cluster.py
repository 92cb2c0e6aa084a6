"""A real environment deployment on loopback for the trainer's integration tests.

One scripted policy and, per replica, a real resources, model and agent server, each a
uvicorn server in its own thread with its own event loop. Tests act on a server's objects
(the agent's :class:`SessionBook`, the model server's gate) through :meth:`ThreadServer.call`,
which runs the action on that server's loop, as the server's own code would.

With ``snapshot_root`` every server is a checkpoint participant too (control routes on,
guarded by ``ROLLPOINT_CONTROL_TOKEN``, which the test sets before building the cluster), and
:meth:`Cluster.control_plane` gives the trainer its handle on them, as ``rollpoint run`` does.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from rollpoint.envs.registry import get_environment
from rollpoint.http.client import HttpClient
from rollpoint.participant.admission_gate import AdmissionGate
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.episode import EnvironmentName, TaskRow
from rollpoint.servers.agent.agent_server import AgentSettings, agent_server_of, create_agent_app
from rollpoint.servers.agent.session_book import SessionBook
from rollpoint.servers.model.model_server import (
    ModelServerSettings,
    create_model_app,
    model_server_of,
)
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.metrics import TrainerMetrics

T = TypeVar("T")


class ThreadServer:
    """A real uvicorn server on 127.0.0.1:<free port>, in a thread, with its loop exposed."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(1024)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.005)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    def call(self, action: Callable[[], T]) -> T:
        """Run ``action`` on the server's event loop and return its result."""
        assert self.loop is not None

        async def run() -> T:
            return action()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=5)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@dataclass
class Replica:
    name: str
    model: ThreadServer
    resources: ThreadServer
    agent: ThreadServer

    @property
    def endpoints(self) -> ReplicaEndpoints:
        return ReplicaEndpoints(
            name=self.name,
            model_url=self.model.url,
            agent_url=self.agent.url,
            resources_url=self.resources.url,
        )

    def on_book(self, action: Callable[[SessionBook], T]) -> T:
        """Act on the agent's real session book, on the agent's loop."""
        return self.agent.call(lambda: action(agent_server_of(self.agent.app).book))

    def on_gate(self, action: Callable[[AdmissionGate], T]) -> T:
        """Act on the model server's real admission gate, on its loop."""
        return self.model.call(lambda: action(model_server_of(self.model.app).gate))

    def policy_version(self) -> int:
        return self.model.call(lambda: model_server_of(self.model.app).policy_version)


class Cluster:
    """A scripted policy and ``replicas`` replicas of one environment."""

    def __init__(
        self,
        *,
        replicas: int = 2,
        environment: EnvironmentName = "workplace",
        latency_ms: float = 2.0,
        error_rate: float = 0.0,
        seed: int = 0,
        snapshot_root: str | None = None,
    ) -> None:
        self.environment = environment
        self.snapshot_root = snapshot_root
        self._servers: list[ThreadServer] = []
        self.policy = self._start(
            create_policy_app(
                PolicySettings(seed=seed, latency_ms=latency_ms, error_rate=error_rate)
            )
        )
        self.replicas = [self._replica(f"replica-{i}") for i in range(replicas)]

    def _start(self, app: FastAPI) -> ThreadServer:
        server = ThreadServer(app)
        self._servers.append(server)
        return server

    def _replica(self, name: str) -> Replica:
        root = self.snapshot_root
        resources = self._start(
            create_resources_app(self.environment, replica=name, snapshot_root=root)
        )
        model = self._start(
            create_model_app(
                ModelServerSettings(
                    upstream_url=f"{self.policy.url}/v1", replica=name, snapshot_root=root
                )
            )
        )
        agent = self._start(
            create_agent_app(
                AgentSettings(
                    model_url=model.url,
                    resources_url=resources.url,
                    environment=self.environment,
                    replica=name,
                    snapshot_root=root,
                )
            )
        )
        return Replica(name, model, resources, agent)

    def agent_settings(self, index: int) -> dict[str, Any]:
        """Settings of replica ``index``'s agent, to start another copy of it elsewhere."""
        replica = self.replicas[index]
        return AgentSettings(
            model_url=replica.model.url,
            resources_url=replica.resources.url,
            environment=self.environment,
            replica=replica.name,
            snapshot_root=self.snapshot_root,
        ).model_dump(mode="json")

    def deployment(self, **agent_urls: str) -> Deployment:
        """The deployment; ``agent_urls`` (by replica name) replaces agents started elsewhere."""
        endpoints = [
            r.endpoints.model_copy(update={"agent_url": agent_urls.get(r.name, r.agent.url)})
            for r in self.replicas
        ]
        return Deployment(replicas=endpoints, policy_url=f"{self.policy.url}/v1")

    def control_plane(
        self,
        http: HttpClient,
        workdir: Path,
        *,
        keep: int = 50,
        agent_urls: dict[str, str] | None = None,
    ) -> ControlPlane:
        """The trainer's control plane over every participant (needs ``snapshot_root``);
        ``http`` must carry the control token; ``agent_urls`` as for :meth:`deployment`."""
        assert self.snapshot_root is not None, "start the cluster with a snapshot_root"
        store = SnapshotStore(self.snapshot_root, keep=keep)
        metrics = TrainerMetrics(workdir / "metrics.jsonl")
        participants = participant_clients(self.deployment(**(agent_urls or {})), http)
        return ControlPlane(participants, store, metrics)

    def tasks(self, n: int, seed: int = 0) -> list[TaskRow]:
        return get_environment(self.environment).make_tasks(n, seed)

    def close(self) -> None:
        for server in reversed(self._servers):
            server.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
