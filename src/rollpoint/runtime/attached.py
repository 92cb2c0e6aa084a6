"""The attached runtime: servers someone else started (``rollpoint serve``, or your own).

Owns the :class:`~rollpoint.runtime.contract.Runtime` shape over a deployment the trainer
did not start: :meth:`AttachedRuntime.start` hands back the deployment it was given,
:meth:`~AttachedRuntime.stop` leaves the servers running (they belong to whoever started
them, and outlive the trainer: a trainer killed and rerun finds them where they were), and
:meth:`~AttachedRuntime.supervise` watches nothing (it cannot restart a process it does
not own: a replica lost there is the job of whatever started it). It owns no processes.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self

from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import ConfigError, LaunchError
from rollpoint.runtime.contract import OnDown, OnUp
from rollpoint.runtime.settings import RuntimeSettings


class AttachedRuntime:
    def __init__(self, settings: RuntimeSettings, deployment: Deployment) -> None:
        if len(deployment.replicas) != settings.replicas:
            raise ConfigError(
                f"replicas: the config says {settings.replicas}, the deployment has "
                f"{len(deployment.replicas)} ({', '.join(r.name for r in deployment.replicas)})"
            )
        self.settings = settings
        self._given = deployment
        self.deployment: Deployment | None = None

    async def start(self) -> Deployment:
        self.deployment = self._given
        return self._given

    async def restart_replica(self, name: str) -> ReplicaEndpoints:
        raise LaunchError(
            f"{name} is not this trainer's to restart: the servers were started elsewhere"
        )

    async def supervise(self, on_down: OnDown, on_up: OnUp) -> None:
        del on_down, on_up
        await asyncio.Event().wait()  # until cancelled: nothing here to watch

    async def stop(self) -> None:
        self.deployment = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
