"""The embedded runtime: every environment server as a local process on loopback.

Starts the scripted policy (unless ``settings.policy.base_url`` is set), then ``replicas`` copies of
the resources, model and agent servers, and hands the trainer a :class:`Deployment`.
Used as an async context manager so every exit path stops every process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

from rollpoint.http.auth import CONTROL_TOKEN_ENV, DATA_TOKEN_ENV, POLICY_API_KEY_ENV
from rollpoint.http.client import HttpClient
from rollpoint.policy.engine_check import check_engine
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import LaunchError, RollpointError
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.replica_plan import (
    ReplicaPlan,
    SpecHook,
    replica_index,
    replica_name,
    replica_of,
    start_replica,
)
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.runtime.settings import RuntimeSettings

# replica_name and replica_of moved to replica_plan; importers of this module keep working.
__all__ = ["EmbeddedRuntime", "check_policy_reachable", "replica_name", "replica_of"]

log = logging.getLogger(__name__)


class EmbeddedRuntime:
    def __init__(
        self,
        settings: RuntimeSettings,
        *,
        control_token: str | None = None,
        data_token: str | None = None,
        snapshot_root: str | None = None,
        log_dir: Path | None = None,
        spec_hook: SpecHook | None = None,
    ) -> None:
        """With ``control_token`` and ``snapshot_root`` every server is a checkpoint
        participant (control routes on); without, they serve the data plane only. With
        ``data_token`` the replicas' data routes need it (the policy keeps its api_key).
        ``spec_hook`` sees every replica server's spec before it starts (a replica restarted
        later too)."""
        self.settings = settings
        self._spec_hook = spec_hook
        self._data_token = data_token
        env = {CONTROL_TOKEN_ENV: control_token} if control_token else {}
        if data_token:
            env[DATA_TOKEN_ENV] = data_token
        if settings.policy.api_key:
            env[POLICY_API_KEY_ENV] = settings.policy.api_key
        self.group = ProcessGroup(log_dir or settings.workdir / "logs", env=env)
        self._snapshot_root = snapshot_root if control_token and snapshot_root else None
        self.deployment: Deployment | None = None
        self._plan: ReplicaPlan | None = None
        self._restarts: set[str] = set()
        self._generation_cut: bool | None = None
        """The start check's decision on the generation cut (None: not checked)."""

    def _port(self, offset: int) -> int:
        base = self.settings.base_port
        return 0 if base is None else base + offset

    async def start(self) -> Deployment:
        try:
            self._plan = self.replica_plan(await self.start_policy())
            # Replicas start side by side; within one, the agent needs its peers' URLs.
            replicas = await asyncio.gather(
                *(self._start_replica(i) for i in range(self.settings.replicas))
            )
        except BaseException:
            await self.group.stop()
            raise
        self.deployment = Deployment(policy_url=self._plan.policy_url, replicas=list(replicas))
        return self.deployment

    def replica_plan(self, policy_url: str) -> ReplicaPlan:
        """The replicas' specs for this runtime's token and snapshot settings."""
        return ReplicaPlan.of(
            self.settings,
            policy_url=policy_url,
            snapshot_root=self._snapshot_root,
            generation_cut=self._generation_cut,
        )

    async def _start_replica(self, index: int) -> ReplicaEndpoints:
        assert self._plan is not None
        restarted = replica_name(index) in self._restarts
        return await start_replica(
            self.group, self._plan, index, restarted=restarted, spec_hook=self._spec_hook
        )

    async def restart_replica(self, name: str) -> ReplicaEndpoints:
        """Stop what is left of one replica and start it again, empty, on new ports."""
        index = replica_index(name)
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
        restarting: dict[str, asyncio.Task[None]] = {}

        async def restart(replica: str) -> None:
            await on_up(await self.restart_replica(replica))

        try:
            while True:
                await asyncio.sleep(poll_s)
                for name, task in list(restarting.items()):
                    if task.done():
                        del restarting[name]
                        task.result()  # a failed restart ends the watch, as before
                for child in self.group.dead():
                    replica = replica_of(child.spec.name)
                    if replica is None:
                        raise LaunchError(
                            f"{child.spec.name} exited unexpectedly (code {child.process.returncode}); see {child.log_path}"
                        )
                    if replica in restarting:
                        continue  # its restart stops what is left of it
                    log.warning(
                        "%s exited (code %s); restarting %s",
                        child.spec.name,
                        child.process.returncode,
                        replica,
                    )
                    # Reported down at once and restarted alongside the others: a restart
                    # takes seconds, and the tries of a replica reported late would be
                    # given up meanwhile (sent fresh) instead of held for its restart.
                    await on_down(replica)
                    restarting[replica] = asyncio.create_task(restart(replica))
        finally:
            for task in restarting.values():
                task.cancel()
            await asyncio.gather(*restarting.values(), return_exceptions=True)

    async def start_policy(self) -> str:
        """Start the scripted policy (or check ``policy.base_url``); its ``/v1`` URL. With
        ``policy.capture_tokens``, check once what the engine gives: token ids, and whether
        the generation cut can be exact (:mod:`rollpoint.policy.engine_check`)."""
        url = await self._start_policy()
        cfg = self.settings.policy
        if cfg.capture_tokens:
            found = await check_engine(
                url,
                engine=cfg.engine,
                model=cfg.model,
                # The built-in policy guards its routes with the run's data token.
                api_key=cfg.api_key if cfg.base_url is not None else self._data_token,
                capture=cfg.capture_tokens,
                cut=cfg.generation_cut,
            )
            self._generation_cut = found.cut
        return url

    async def _start_policy(self) -> str:
        policy = self.settings.policy
        if policy.base_url is not None:
            url = policy.base_url.rstrip("/")
            await check_policy_reachable(url, policy.api_key)
            return url
        spec = ServerSpec(
            kind="policy",
            name="policy",
            host=self.settings.host,
            port=self._port(0),
            settings={
                "seed": self.settings.seed,
                "latency_ms": policy.latency_ms,
                "error_rate": policy.error_rate,
                "tokens_per_call": policy.tokens_per_call,
                "tool_turns": policy.tool_turns,
                "model": policy.model,
                "call_log": None if policy.call_log is None else str(policy.call_log),
                "shape": policy.engine,
                "token_latency_ms": policy.token_latency_ms,
                "reasoning_tokens": policy.reasoning_tokens,
                "weights_log": (None if policy.weights_log is None else str(policy.weights_log)),
                "faults": [dict(f) for f in policy.faults],
                "fault_log": None if policy.fault_log is None else str(policy.fault_log),
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
