"""The embedded runtime: every environment server as a local process on loopback.

Starts the scripted policy (unless ``policy.base_url`` is set), then ``replicas`` copies of
the resources, model and agent servers, and hands the trainer a :class:`Deployment`.
Used as an async context manager so every exit path stops every process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
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


def replica_of(server_name: str) -> str | None:
    """``agent-replica-1`` → ``replica-1``; None for servers outside any replica (the policy)."""
    _, sep, replica = server_name.partition("-replica-")
    return f"replica-{replica}" if sep else None


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
        self._policy_url = ""
        self._restarts: set[str] = set()

    def _port(self, offset: int) -> int:
        base = self.config.base_port
        return 0 if base is None else base + offset

    async def start(self) -> Deployment:
        cfg = self.config
        try:
            self._policy_url = await self._start_policy()
            # Replicas start side by side; within one, the agent needs its peers' URLs.
            replicas = await asyncio.gather(*(self._start_replica(i) for i in range(cfg.replicas)))
        except BaseException:
            await self.group.stop()
            raise
        self.deployment = Deployment(policy_url=self._policy_url, replicas=list(replicas))
        return self.deployment

    def _peer_specs(self, index: int) -> list[ServerSpec]:
        cfg, replica = self.config, replica_name(index)
        # Fixed ports are for the first start only; a restarted replica takes free ones.
        restarted = replica in self._restarts
        return [
            ServerSpec(
                kind="resources",
                name=f"resources-{replica}",
                host=cfg.host,
                port=0 if restarted else self._port(1 + 3 * index),
                settings={
                    "environment": cfg.environment,
                    "name": "resources",
                    "replica": replica,
                    **self._control,
                },
            ),
            ServerSpec(
                kind="model",
                name=f"model-{replica}",
                host=cfg.host,
                port=0 if restarted else self._port(2 + 3 * index),
                settings={
                    "upstream_url": self._policy_url,
                    "api_key": cfg.policy.api_key,
                    "name": "model",
                    "replica": replica,
                    **self._control,
                },
            ),
        ]

    async def _start_replica(self, index: int) -> ReplicaEndpoints:
        cfg, replica = self.config, replica_name(index)
        resources, model = await self.group.start(self._peer_specs(index))
        agent_spec = ServerSpec(
            kind="agent",
            name=f"agent-{replica}",
            host=cfg.host,
            port=0 if replica in self._restarts else self._port(3 + 3 * index),
            settings={
                "model_url": model.url,
                "resources_url": resources.url,
                "environment": cfg.environment,
                "name": "agent",
                "replica": replica,
                "checkpoint_mode": _checkpoint_mode(cfg.environment),
                "model_name": cfg.policy.model,
                **self._control,
            },
        )
        (agent,) = await self.group.start([agent_spec])
        return ReplicaEndpoints(
            name=replica, model_url=model.url, agent_url=agent.url, resources_url=resources.url
        )

    async def restart_replica(self, name: str) -> ReplicaEndpoints:
        """Stop what is left of one replica and start it again, empty, on new ports."""
        index = int(name.removeprefix("replica-"))
        await self.group.stop_children(
            [c for c in self.group.children if replica_of(c.spec.name) == name]
        )
        self._restarts.add(name)
        endpoints = await self._start_replica(index)
        assert self.deployment is not None
        self.deployment = self.deployment.model_copy(
            update={
                "replicas": [endpoints if r.name == name else r for r in self.deployment.replicas]
            }
        )
        return endpoints

    async def supervise(
        self,
        on_down: Callable[[str], Awaitable[None]],
        on_up: Callable[[ReplicaEndpoints], Awaitable[None]],
        *,
        poll_s: float = 0.25,
    ) -> None:
        """Watch the server processes: a replica whose process died is reported down,
        restarted empty, and reported up; the policy dying ends the run."""
        while True:
            await asyncio.sleep(poll_s)
            for child in self.group.dead():
                replica = replica_of(child.spec.name)
                if replica is None:
                    raise LaunchError(
                        f"{child.spec.name} exited unexpectedly (code {child.process.returncode}); see {child.log_path}"
                    )
                log.warning(
                    "%s exited (code %s); restarting %s",
                    child.spec.name,
                    child.process.returncode,
                    replica,
                )
                await on_down(replica)
                endpoints = await self.restart_replica(replica)
                await on_up(endpoints)
                break  # the children list changed: look again on the next tick

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
