"""A local cluster: rollpoint's real servers on loopback, in threads of this process.

Owns :class:`LocalCluster`, what the embedded runtime starts (a scripted policy, then per
replica a resources, a model and an agent server, each a real uvicorn server on its own
event loop) but in threads of the caller's process: it starts in a fraction of a second,
it takes settings the runtime does not expose (the lease grace, a policy's latency), and a
test can act on a server's own objects (the agent's session book, the model server's
admission gate) on that server's loop, as the server's code would (:class:`LocalReplica`).
With ``snapshot_root`` every server is a checkpoint participant (control routes on,
guarded by ``control_token``) and :meth:`LocalCluster.control_plane` is the trainer's
handle on them, as ``rollpoint run`` builds it.

rollpoint's own trainer tests run on it, and so can an environment or trainer author's:
nothing is mocked, every call crosses a real socket. It does not start processes (the
runtimes do) nor inject faults (put a :class:`~rollpoint.testing.FaultProxy` in front of a
server's URL).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import uvicorn
from fastapi import FastAPI

from rollpoint.envs.registry import get_environment
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.participant.admission_gate import AdmissionGate
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.episode import EnvironmentName, TaskRow
from rollpoint.protocol.errors import LaunchError
from rollpoint.protocol.participant import ParticipantKind, session_mode
from rollpoint.servers.agent.agent_server import AgentSettings, agent_server_of, create_agent_app
from rollpoint.servers.agent.session_book import SessionBook
from rollpoint.servers.model.model_server import (
    ModelServerSettings,
    create_model_app,
    model_server_of,
)
from rollpoint.servers.resources.resources_server import create_resources_app
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.tuning import install as install_tuning

T = TypeVar("T")

_START_S = 10.0


class ThreadServer:
    """A real uvicorn server on 127.0.0.1:<free port>, in a thread, with its loop exposed."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        # IPPROTO_TCP on purpose: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP, and without it every keep-alive request waits ~40 ms for a delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(1024)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        # uvicorn installs signal handlers only in the main thread; this one is not.
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._sock.close()
                raise LaunchError(f"local cluster: a server at {self.url} did not start")
            time.sleep(0.005)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    @property
    def running(self) -> bool:
        return self.loop is not None and not self.loop.is_closed() and self._thread.is_alive()

    def call(self, action: Callable[[], T]) -> T:
        """Run ``action`` on the server's event loop and return its result."""
        if self.loop is None or not self.running:
            raise LaunchError(f"local cluster: the server at {self.url} is not running")

        async def run() -> T:
            return action()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=5)

    def request_stop(self) -> None:
        """Ask the server to exit; :meth:`stop` waits for it."""
        self._server.should_exit = True

    def stop(self) -> None:
        self.request_stop()
        self._thread.join(timeout=10)
        self._sock.close()


@dataclass
class LocalReplica:
    """One replica's three servers."""

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

    def url(self, kind: ParticipantKind) -> str:
        """The URL of this replica's server of ``kind``."""
        return {
            ParticipantKind.MODEL: self.model.url,
            ParticipantKind.AGENT: self.agent.url,
            ParticipantKind.RESOURCES: self.resources.url,
        }[kind]

    def policy_version(self) -> int:
        return self.model.call(lambda: model_server_of(self.model.app).policy_version)


class LocalCluster:
    """A scripted policy and ``replicas`` replicas of one environment; a context manager.

    ``snapshot_root`` makes every server a checkpoint participant writing under it;
    ``control_token`` guards their control routes (None: the token already in
    ``ROLLPOINT_CONTROL_TOKEN``, as a server process reads it). ``lease_grace_s``: how long
    a participant held by a vanished coordinator waits before it reopens (None: the
    servers' default). ``agent_resources_url``, given a replica's name and its resources
    server's URL, returns the URL that replica's agent calls instead (a
    :class:`~rollpoint.testing.FaultProxy` in front of it, say)."""

    def __init__(
        self,
        *,
        replicas: int = 2,
        environment: EnvironmentName = "workplace",
        latency_ms: float = 2.0,
        error_rate: float = 0.0,
        seed: int = 0,
        snapshot_root: str | None = None,
        control_token: str | None = None,
        lease_grace_s: float | None = None,
        agent_resources_url: Callable[[str, str], str] | None = None,
    ) -> None:
        self.environment = environment
        self.snapshot_root = snapshot_root
        self._lease_grace_s = lease_grace_s
        self._agent_resources_url = agent_resources_url
        self._tool_urls: dict[str, str] = {}
        self._servers: list[ThreadServer] = []
        # The servers run in this process, whose entry point is the caller's: install the
        # performance tricks here as a server process does (once per process; idempotent).
        install_tuning()
        try:
            self.policy = self._start(
                create_policy_app(
                    PolicySettings(seed=seed, latency_ms=latency_ms, error_rate=error_rate)
                )
            )
            # Each server reads the token once, as its app is created.
            with _token_in_environment(control_token):
                self.replicas = [self._replica(f"replica-{i}") for i in range(replicas)]
        except BaseException:
            self.close()
            raise

    def _start(self, app: FastAPI) -> ThreadServer:
        server = ThreadServer(app)
        self._servers.append(server)
        return server

    def _control(self) -> dict[str, Any]:
        control: dict[str, Any] = {"snapshot_root": self.snapshot_root}
        if self._lease_grace_s is not None:
            control["lease_grace_s"] = self._lease_grace_s
        return control

    def _replica(self, name: str) -> LocalReplica:
        control = self._control()
        resources = self._start(create_resources_app(self.environment, replica=name, **control))
        wire = self._agent_resources_url
        self._tool_urls[name] = resources.url if wire is None else wire(name, resources.url)
        model = self._start(
            create_model_app(
                ModelServerSettings.model_validate(
                    {"upstream_url": f"{self.policy.url}/v1", "replica": name, **control}
                )
            )
        )
        agent = self._start(
            create_agent_app(AgentSettings.model_validate(self._agent_doc(name, model)))
        )
        return LocalReplica(name, model, resources, agent)

    def _agent_doc(self, name: str, model: ThreadServer) -> dict[str, Any]:
        return {
            "model_url": model.url,
            "resources_url": self._tool_urls[name],
            "environment": self.environment,
            "replica": name,
            "checkpoint_mode": session_mode(get_environment(self.environment).checkpoint_mode),
            **self._control(),
        }

    def agent_settings(self, index: int) -> dict[str, Any]:
        """Settings of replica ``index``'s agent, to start another copy of it elsewhere."""
        replica = self.replicas[index]
        doc = self._agent_doc(replica.name, replica.model)
        return AgentSettings.model_validate(doc).model_dump(mode="json")

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
        if self.snapshot_root is None:
            raise LaunchError("local cluster: start it with a snapshot_root to take snapshots")
        store = SnapshotStore(self.snapshot_root, keep=keep)
        metrics = TrainerMetrics(workdir / "metrics.jsonl")
        participants = participant_clients(self.deployment(**(agent_urls or {})), http)
        return ControlPlane(participants, store, metrics)

    def tasks(self, n: int, seed: int = 0) -> list[TaskRow]:
        """``n`` tasks of the cluster's environment."""
        return get_environment(self.environment).make_tasks(n, seed)

    def close(self) -> None:
        """Stop every server. A call a test left held at a closed gate or turn boundary
        would hold its server's shutdown: those are reopened first."""
        replicas: list[LocalReplica] = getattr(self, "replicas", [])
        for replica in replicas:
            if replica.model.running:  # not one the test stopped itself
                replica.on_gate(lambda gate: gate.open())
            if replica.agent.running:
                replica.on_book(lambda book: book.open_boundaries())
        # All asked first: each then waits for uvicorn's shutdown tick at the same time.
        for server in self._servers:
            server.request_stop()
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@contextmanager
def _token_in_environment(token: str | None) -> Iterator[None]:
    if token is None:
        yield
        return
    previous = os.environ.get(CONTROL_TOKEN_ENV)
    os.environ[CONTROL_TOKEN_ENV] = token
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(CONTROL_TOKEN_ENV, None)
        else:
            os.environ[CONTROL_TOKEN_ENV] = previous
