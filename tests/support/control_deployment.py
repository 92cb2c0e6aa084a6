"""A checkpointable environment deployment for tests: every server in a thread, control on.

What the embedded runtime starts (a scripted policy, then per replica a resources, a model
and an agent server, each a real uvicorn server on loopback, each a checkpoint participant
guarded by a control token) but as threads of the test process: it starts in a fraction
of a second, and it takes settings the runtime does not expose, such as the lease grace.

Each server answers one request before the next one starts. It was added because FastAPI
(0.165) builds an *included* router's routes on its first request, silencing a pydantic
warning with ``warnings.catch_warnings()``, and several apps doing that at once in threads
of one process raced (pytest turned the warning into a 500). The control routes are now
registered on each app and built when mounted (:mod:`rollpoint.participant.control_routes`), which
removes the race for every test; the warm-up stays as a readiness check.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from fastapi import FastAPI

from rollpoint.envs import get_environment
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.episode import EnvironmentName
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.resources_server import create_resources_app
from tests.support.live_server import serve_app


@contextmanager
def control_deployment(
    *,
    token: str,
    snapshot_root: str,
    environment: EnvironmentName = "workplace",
    replicas: int = 2,
    lease_grace_s: float = 2.0,
    latency_ms: float = 20.0,
    seed: int = 0,
) -> Iterator[Deployment]:
    """Serve the deployment; yield where it is; stop every server on exit."""
    with ExitStack() as stack:
        settings = PolicySettings(seed=seed, latency_ms=latency_ms, error_rate=0.0)
        policy = _serve(stack, create_policy_app(settings), "/v1/models")
        previous = os.environ.get(CONTROL_TOKEN_ENV)
        # Each server reads the token once, as its app is created.
        os.environ[CONTROL_TOKEN_ENV] = token
        try:
            endpoints = [
                _replica(stack, f"replica-{i}", environment, policy, snapshot_root, lease_grace_s)
                for i in range(replicas)
            ]
        finally:
            if previous is None:
                os.environ.pop(CONTROL_TOKEN_ENV, None)
            else:
                os.environ[CONTROL_TOKEN_ENV] = previous
        for url in _participant_urls(endpoints):
            _warm_up(url + CONTROL_PREFIX + "/status", token)
        yield Deployment(replicas=endpoints, policy_url=f"{policy}/v1")


def _replica(
    stack: ExitStack,
    name: str,
    environment: EnvironmentName,
    policy_url: str,
    snapshot_root: str,
    lease_grace_s: float,
) -> ReplicaEndpoints:
    control = {"snapshot_root": snapshot_root, "lease_grace_s": lease_grace_s}
    resources_app = create_resources_app(
        environment, replica=name, snapshot_root=snapshot_root, lease_grace_s=lease_grace_s
    )
    resources = _serve(stack, resources_app, "/tools")
    model_settings = ModelServerSettings.model_validate(
        {"upstream_url": f"{policy_url}/v1", "replica": name, **control}
    )
    model = _serve(stack, create_model_app(model_settings), "/rollpoint/v1/stats")
    agent_settings = AgentSettings.model_validate(
        {
            "model_url": model,
            "resources_url": resources,
            "environment": environment,
            "replica": name,
            "checkpoint_mode": get_environment(environment).checkpoint_mode,
            **control,
        }
    )
    agent = _serve(stack, create_agent_app(agent_settings), "/rollpoint/v1/sessions")
    return ReplicaEndpoints(name=name, model_url=model, agent_url=agent, resources_url=resources)


def _serve(stack: ExitStack, app: FastAPI, warm_up_path: str) -> str:
    url = stack.enter_context(serve_app(app))
    _warm_up(url + warm_up_path)
    return url


def _participant_urls(endpoints: list[ReplicaEndpoints]) -> Iterator[str]:
    for replica in endpoints:
        yield from (replica.resources_url, replica.model_url, replica.agent_url)


def _warm_up(url: str, token: str | None = None) -> None:
    """One request, answered before anything else runs (see the module docstring)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10):
        pass
