"""The embedded runtime: every environment server as a local process on loopback.

Starts the scripted policy (unless ``policy.base_url`` is set), then ``replicas`` copies of
the resources, model and agent servers, and hands the trainer a :class:`Deployment`.
Used as an async context manager so every exit path stops every process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import TracebackType

from rollpoint.config import RunConfig
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.http.client import HttpClient
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import LaunchError, RollpointError
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec

log = logging.getLogger(__name__)


def replica_name(index: int) -> str:
    return f"replica-{index}"


def _checkpoint_mode(environment: str) -> str:
    from rollpoint.envs import get_environment

    return str(get_environment(environment).checkpoint_mode)


class EmbeddedRuntime:
    def __init__(
        self,
        config: RunConfig,
        *,
        control_token: str | None = None,
        snapshot_root: str | None = None,
        log_dir: Path | None = None,
    ) -> None:
        """With ``control_token`` and ``snapshot_root`` every server is a checkpoint
        participant (control routes on); without, they serve the data plane only."""
        self.config = config
        env = {CONTROL_TOKEN_ENV: control_token} if control_token else {}
        self.group = ProcessGroup(log_dir or config.workdir / "logs", env=env)
        self._control = {"snapshot_root": snapshot_root} if control_token and snapshot_root else {}
        self.deployment: Deployment | None = None

    def _port(self, offset: int) -> int:
        base = self.config.base_port
        return 0 if base is None else base + offset

    async def start(self) -> Deployment:
        cfg = self.config
        try:
            policy_url = await self._start_policy()
            specs: list[ServerSpec] = []
            mode = _checkpoint_mode(cfg.environment)
            for i in range(cfg.replicas):
                replica = replica_name(i)
                specs.append(
                    ServerSpec(
                        kind="resources",
                        name=f"resources-{replica}",
                        host=cfg.host,
                        port=self._port(1 + 3 * i),
                        settings={
                            "environment": cfg.environment,
                            "name": "resources",
                            "replica": replica,
                            **self._control,
                        },
                    )
                )
                specs.append(
                    ServerSpec(
                        kind="model",
                        name=f"model-{replica}",
                        host=cfg.host,
                        port=self._port(2 + 3 * i),
                        settings={
                            "upstream_url": policy_url,
                            "api_key": cfg.policy.api_key,
                            "name": "model",
                            "replica": replica,
                            **self._control,
                        },
                    )
                )
            started = await self.group.start(specs)
            urls = {c.spec.name: c.url for c in started}
            agent_specs = [
                ServerSpec(
                    kind="agent",
                    name=f"agent-{replica_name(i)}",
                    host=cfg.host,
                    port=self._port(3 + 3 * i),
                    settings={
                        "model_url": urls[f"model-{replica_name(i)}"],
                        "resources_url": urls[f"resources-{replica_name(i)}"],
                        "environment": cfg.environment,
                        "name": "agent",
                        "replica": replica_name(i),
                        "checkpoint_mode": mode,
                        "model_name": cfg.policy.model,
                        **self._control,
                    },
                )
                for i in range(cfg.replicas)
            ]
            agents = {c.spec.name: c.url for c in await self.group.start(agent_specs)}
        except BaseException:
            await self.group.stop()
            raise
        self.deployment = Deployment(
            policy_url=policy_url,
            replicas=[
                ReplicaEndpoints(
                    name=replica_name(i),
                    model_url=urls[f"model-{replica_name(i)}"],
                    agent_url=agents[f"agent-{replica_name(i)}"],
                    resources_url=urls[f"resources-{replica_name(i)}"],
                )
                for i in range(cfg.replicas)
            ],
        )
        return self.deployment

    async def _start_policy(self) -> str:
        cfg = self.config
        if cfg.policy.base_url is not None:
            url = cfg.policy.base_url.rstrip("/")
            await check_policy_reachable(url, cfg.policy.api_key)
            return url
        spec = ServerSpec(
            kind="policy",
            name="policy",
            host=cfg.host,
            port=self._port(0),
            settings={
                "seed": cfg.seed,
                "latency_ms": cfg.policy.latency_ms,
                "error_rate": cfg.policy.error_rate,
                "tokens_per_call": cfg.policy.tokens_per_call,
                "model": cfg.policy.model,
            },
        )
        (child,) = await self.group.start([spec])
        return f"{child.url}/v1"

    async def stop(self) -> None:
        await self.group.stop()

    async def __aenter__(self) -> EmbeddedRuntime:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def check_policy_reachable(base_url: str, api_key: str | None) -> None:
    """Fail fast, with the URL in the message, when the policy engine cannot be reached."""
    async with HttpClient(token=api_key, timeout_s=10, connect_timeout_s=5) as client:
        try:
            await client.get_json(f"{base_url}/models")
        except RollpointError as exc:
            raise LaunchError(
                f"policy.base_url {base_url} is not reachable: {exc.message}"
            ) from None
