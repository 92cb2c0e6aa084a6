"""What every runtime offers the job (the :class:`Runtime` protocol) and picking one.

Owns the shape a job relies on — start the servers, hand back a :class:`Deployment`,
restart one replica, watch replicas, stop everything — and :func:`runtime_for`, which
builds the runtime ``settings.runtime`` names. The Ray runtime is imported only when chosen,
so the embedded path never imports Ray. It owns no processes or actors itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import ConfigError
from rollpoint.runtime.replica_plan import SpecHook
from rollpoint.runtime.settings import RuntimeSettings

OnDown = Callable[[str], Awaitable[None]]
OnUp = Callable[[ReplicaEndpoints], Awaitable[None]]


class Runtime(Protocol):
    settings: RuntimeSettings
    deployment: Deployment | None

    async def start(self) -> Deployment:
        """Start the policy (unless external) and every replica; where they listen."""
        ...

    async def restart_replica(self, name: str) -> ReplicaEndpoints:
        """Replace replica ``name`` by an empty one (new URLs); the other replicas go on."""
        ...

    async def supervise(self, on_down: OnDown, on_up: OnUp) -> None:
        """Run until cancelled: a replica that dies is reported down, restarted and reported
        up; raises when the run cannot go on (the policy died)."""
        ...

    async def stop(self) -> None:
        """Stop everything started; safe to call twice."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def runtime_for(
    settings: RuntimeSettings,
    *,
    control_token: str | None = None,
    data_token: str | None = None,
    snapshot_root: str | None = None,
    log_dir: Path | None = None,
    spec_hook: SpecHook | None = None,
) -> Runtime:
    """The runtime ``settings.runtime`` names, with the same tokens and snapshot settings.
    ``spec_hook`` (chaos trials) needs the embedded runtime: it starts local processes."""
    if settings.runtime == "ray":
        if spec_hook is not None:
            raise ConfigError("a hook on the servers' specs needs runtime: embedded")
        from rollpoint.runtime.ray_runtime import RayRuntime

        return RayRuntime(
            settings,
            control_token=control_token,
            data_token=data_token,
            snapshot_root=snapshot_root,
            log_dir=log_dir,
        )
    from rollpoint.runtime.embedded import EmbeddedRuntime

    return EmbeddedRuntime(
        settings,
        control_token=control_token,
        data_token=data_token,
        snapshot_root=snapshot_root,
        log_dir=log_dir,
        spec_hook=spec_hook,
    )
