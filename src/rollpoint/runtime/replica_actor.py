"""One replica as a Ray actor: its three server processes, started on the actor's node.

Owns the body of the actor :class:`rollpoint.runtime.ray_runtime.RayRuntime` starts per
replica: it runs :func:`start_replica` in its own :class:`ProcessGroup`, reports URLs the
driver can reach, answers :meth:`ReplicaActor.watch` only when one of its servers exits,
and stops them on request. When the actor itself dies (``ray.kill``, its node lost) its
servers see their standard input close and exit on their own. It does not decide what
happens to a replica that is down (the runtime's ``supervise``). This module does not
import Ray at import time: the class becomes an actor with ``ray.remote`` in the runtime.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rollpoint.protocol.deployment import ReplicaEndpoints
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.replica_plan import ReplicaPlan, start_replica

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


def advertised(url: str, node_ip: str) -> str:
    """``url`` as another node reaches it: a wildcard bind address becomes the node's IP."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.hostname not in _WILDCARD_HOSTS:
        return url
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{host}{port}"))


def node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class ReplicaActor:
    """Actor body; every method is a coroutine so ``watch`` and ``stop`` can overlap."""

    def __init__(
        self, plan_json: str, index: int, restarted: bool, env: dict[str, str], log_dir: str
    ) -> None:
        self._plan = ReplicaPlan.model_validate_json(plan_json)
        self._index = index
        self._restarted = restarted
        self._group = ProcessGroup(Path(log_dir), env=env)

    async def start(self) -> str:
        """Start the servers; the :class:`ReplicaEndpoints` as JSON once all listen."""
        try:
            endpoints = await start_replica(
                self._group, self._plan, self._index, restarted=self._restarted
            )
        except BaseException:
            await self._group.stop()
            raise
        ip = node_ip()
        reachable = endpoints.model_copy(
            update={
                "model_url": advertised(endpoints.model_url, ip),
                "agent_url": advertised(endpoints.agent_url, ip),
                "resources_url": advertised(endpoints.resources_url, ip),
            }
        )
        return reachable.model_dump_json()

    async def watch(self, poll_s: float = 0.1) -> str:
        """Return (why) only once one of the servers has exited; runs as long as they live."""
        while True:
            dead = self._group.dead()
            if dead:
                child = dead[0]
                return f"{child.spec.name} exited (code {child.process.returncode}; log {child.log_path})"
            await asyncio.sleep(poll_s)

    async def node_id(self) -> str:
        """The Ray node this replica's servers run on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def pids(self) -> dict[str, int]:
        """Server name → process id, for tests and operators."""
        return {c.spec.name: c.process.pid for c in self._group.children}

    async def stop(self) -> None:
        await self._group.stop()


def endpoints_of(raw: str) -> ReplicaEndpoints:
    return ReplicaEndpoints.model_validate_json(raw)
