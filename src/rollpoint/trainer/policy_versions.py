"""The live policy version: who counts it, how the model servers learn it, and the weight
updates that change it.

Owns :class:`PolicyVersions`, which the trainer loop holds. Until the trainer says which
version is live, rollpoint counts one version per train step
(:meth:`~PolicyVersions.count_step`) and tells every up model server; once the trainer has
said one (:meth:`~PolicyVersions.weights_live`, or a weight update), train steps count none
of their own. A weight update pauses every up
replica's engine through its model server while the weights are pushed, with snapshots held
off, so a snapshot is before the update or after it. The policy lag is measured against the
live version (:class:`PolicyLag` is told when it moves).

Does not own the run's HTTP client (the trainer loop's, while it runs) nor which replicas are
up (the :class:`ReplicaRoster`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from rollpoint.http.client import HttpClient
from rollpoint.policy.engine_adapters import PauseMode
from rollpoint.protocol.deployment import ReplicaEndpoints
from rollpoint.protocol.errors import BadRequestError, InvalidPhaseError, RollpointError
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.policy_lag import PolicyLag
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator

log = logging.getLogger("rollpoint.trainer.trainer")
"""The trainer loop's logger: its parts' lines read (and filter) as they did in one module."""


class PolicyVersions:
    """The live version and the weight updates around it (module docstring)."""

    def __init__(
        self,
        roster: ReplicaRoster,
        lag: PolicyLag,
        coordinator: SnapshotCoordinator | None,
        *,
        require_http: Callable[[], Awaitable[HttpClient]],
        live: int = 0,
        trainer_versions: bool = False,
    ) -> None:
        """``require_http``: the run's client (a call made before the run got going waits
        for it). ``live`` and ``trainer_versions``: as a restored run left them."""
        self.roster = roster
        self.lag = lag
        self.coordinator = coordinator
        self._require_http = require_http
        self.live = live
        """The version live on the engines (the trainer's own once it reported one)."""
        self.trainer_versions = trainer_versions
        """True once the trainer said which version is live (:meth:`weights_live`): train
        steps no longer count versions of their own."""
        self._update: AsyncExitStack | None = None
        """Held from :meth:`pause_for_update` to :meth:`end_update` (keeps saves out)."""
        self._update_replicas: list[ReplicaEndpoints] = []

    async def count_step(self, client: HttpClient) -> None:
        """A train step is done: rollpoint's own count moves on, unless the trainer reports
        its versions itself."""
        if not self.trainer_versions:
            # rollpoint's own count: one version per train step, live once it is done.
            self.live += 1
            await self.publish(client, self.live)
            self.lag.changed()

    async def weights_live(self, version: int) -> None:
        """Version ``version`` is live on the engines from now on. Held out of snapshots."""
        async with self._holding_saves():
            await self._make_live(version)

    @asynccontextmanager
    async def weight_update(self, version: int, mode: PauseMode = "keep") -> AsyncIterator[None]:
        """The engines paused in ``mode`` while the block pushes the weights; on leaving
        it, ``version`` is live and they resume. A block that raises resumes the engines
        under the version they had."""
        self._check_version(version)
        await self.pause_for_update(mode)
        try:
            yield
        except BaseException:
            await self.end_update(None)
            raise
        await self.end_update(version)

    async def pause_for_update(self, mode: PauseMode) -> None:
        """Step one of :meth:`weight_update`: hold snapshots, pause every up replica's
        engine (through its model server) in ``mode``."""
        http = await self._require_http()
        if self._update is not None:
            raise InvalidPhaseError("trainer: a weight update is already in progress")
        stack = AsyncExitStack()
        await stack.enter_async_context(self._holding_saves())
        self._update = stack
        self._update_replicas = []
        try:
            for name in list(self.roster.up):
                r = self.roster.endpoints(name)
                await http.post_json(f"{r.model_url}/rollpoint/v1/weights/pause", {"mode": mode})
                self._update_replicas.append(r)
        except BaseException:
            await self.end_update(None)
            raise

    async def end_update(self, version: int | None) -> None:
        """Step two: ``version`` live (None: the one before, for an update given up), the
        engines resumed, snapshots let go."""
        stack, self._update = self._update, None
        if stack is None:
            raise InvalidPhaseError("trainer: no weight update is in progress")
        try:
            http = await self._require_http()
            if version is None or version < self.live:
                await self._post_live(http, self.live, self._update_replicas)
                if version is not None:
                    self._check_version(version)  # raises: the engines run on, unchanged
                return
            self.live = version
            self.trainer_versions = True
            replicas = [self.roster.endpoints(name) for name in self.roster.up]
            await self._post_live(http, version, replicas)
            self.lag.trainer_reported()
            log.info("weights of version %d are live", version)
        finally:
            await stack.aclose()

    def _holding_saves(self) -> Any:
        if self.coordinator is None:
            return AsyncExitStack()
        return self.coordinator.holding_saves()

    def _check_version(self, version: int) -> None:
        if version < self.live:
            raise BadRequestError(
                f"trainer: policy version {version} is older than the live one "
                f"({self.live}); versions only go up"
            )

    async def _make_live(self, version: int) -> None:
        self._check_version(version)
        http = await self._require_http()
        self.live = version
        self.trainer_versions = True
        replicas = [self.roster.endpoints(name) for name in self.roster.up]
        await self._post_live(http, version, replicas)
        self.lag.trainer_reported()

    async def _post_live(
        self, client: HttpClient, version: int, replicas: list[ReplicaEndpoints]
    ) -> None:
        """``version`` live on these replicas' model servers (resuming their engines)."""

        async def live(r: ReplicaEndpoints) -> None:
            await client.post_json(f"{r.model_url}/rollpoint/v1/weights/live", {"version": version})

        await asyncio.gather(*(live(r) for r in replicas))

    async def publish(
        self, client: HttpClient, version: int, replicas: list[ReplicaEndpoints] | None = None
    ) -> None:
        """Tell the model servers (of ``replicas``, default every up one) the policy version."""
        if replicas is None:
            replicas = [self.roster.endpoints(name) for name in self.roster.up]

        async def publish(name: str, model_url: str) -> None:
            try:
                await client.post_json(
                    f"{model_url}/rollpoint/v1/policy_version", {"version": version}
                )
            except RollpointError as exc:
                # The version only labels recorded calls; a replica that missed it must
                # not stop training (the dispatcher copes with a replica that is down).
                log.warning("could not set policy version %d on %s: %s", version, name, exc)

        await asyncio.gather(*(publish(r.name, r.model_url) for r in replicas))
