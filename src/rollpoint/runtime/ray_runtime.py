"""The Ray runtime: each replica of the environment deployment is a Ray actor.

Owns connecting to Ray (``ray.address``: none starts a local instance, so the same command
runs on a laptop), placing one :class:`ReplicaActor` per replica with
``ray.num_cpus_per_replica`` CPUs, watching them, and replacing a dead one. The policy (when
scripted), the trainer, ledger, coordinator and the finished queue stay in the driver. A replica is down
when Ray reports its actor dead — the long-running ``watch`` call on it raises
``RayActorError`` — or when ``watch`` returns because one of its servers exited; either
way the other replicas keep running. Snapshots need a store every node can reach: each
replica's participants write their own folder under it, as on the embedded runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Any

from rollpoint.common.extras import need
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.errors import LaunchError, RollpointError
from rollpoint.runtime.contract import OnDown, OnUp
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.runtime.replica_actor import ReplicaActor, advertised, endpoints_of, node_ip
from rollpoint.runtime.replica_plan import ReplicaPlan, replica_index, replica_name
from rollpoint.runtime.settings import RuntimeSettings

# A ray.actor.ActorHandle: Ray's annotations do not type ``handle.method.remote``.
ActorHandle = Any

log = logging.getLogger(__name__)

# A replica that Ray cannot place (too few free CPUs) must fail the start, not hang it.
PLACEMENT_TIMEOUT_S = 120.0
_STOP_GRACE_S = 5.0


def forwarded_env(
    patterns: Sequence[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that ``ray.forward_env`` names."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if any(fnmatchcase(k, p) for p in patterns)}


class RayRuntime:
    def __init__(
        self,
        settings: RuntimeSettings,
        *,
        control_token: str | None = None,
        data_token: str | None = None,
        snapshot_root: str | None = None,
        log_dir: Path | None = None,
    ) -> None:
        """Same arguments as :class:`EmbeddedRuntime`, whose driver-side part (the policy,
        the servers' environment and specs) this runtime reuses."""
        need("ray", "the Ray runtime (runtime: ray)")
        self.settings = settings
        self._driver = EmbeddedRuntime(
            settings,
            control_token=control_token,
            data_token=data_token,
            snapshot_root=snapshot_root,
            log_dir=log_dir,
        )
        self._log_dir = str((log_dir or settings.workdir / "logs").resolve())
        self.deployment: Deployment | None = None
        self._plan: ReplicaPlan | None = None
        self._actors: dict[str, ActorHandle] = {}
        self._watches: dict[str, Any] = {}
        """Replica → the ObjectRef of its actor's ``watch`` call."""
        self._restarts: set[str] = set()
        self._owns_ray = False

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> Deployment:
        self._connect()
        try:
            self._check_room()
            policy_url = advertised(await self._driver.start_policy(), node_ip())
            self._plan = self._driver.replica_plan(policy_url)
            names = [replica_name(i) for i in range(self.settings.replicas)]
            replicas = await asyncio.gather(*(self._start_actor(n) for n in names))
        except BaseException:
            await self.stop()
            raise
        self.deployment = Deployment(policy_url=policy_url, replicas=list(replicas))
        return self.deployment

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's Ray session: use it, leave it up
        address = self.settings.ray.address
        local: dict[str, Any] = {}
        if address is None:
            # A Ray instance of our own: no dashboard, no usage reporting.
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            local = {"include_dashboard": False}
        handlers = _signal_handlers()
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, **local)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = "a local Ray instance" if address is None else f"Ray at {address}"
            raise LaunchError(f"cannot start or reach {where}: {exc}") from None
        finally:
            _restore(handlers)
        self._owns_ray = True

    def _check_room(self) -> None:
        """A local instance of our own cannot grow: say at once when the replicas do not fit
        (on a cluster Ray may add nodes, so there the placement timeout decides)."""
        import ray

        if not self._owns_ray or self.settings.ray.address or os.environ.get("RAY_ADDRESS"):
            return
        cfg = self.settings
        need = cfg.replicas * cfg.ray.num_cpus_per_replica
        have = float(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]
        if need > have:
            raise LaunchError(
                f"{cfg.replicas} replicas x ray.num_cpus_per_replica {cfg.ray.num_cpus_per_replica:g} "
                f"need {need:g} CPUs but the local Ray instance has {have:g}: lower either, "
                f"or set ray.address to a cluster"
            )

    async def stop(self) -> None:
        """Stop every replica's servers, the policy, and the Ray session this runtime began."""
        actors, self._actors = list(self._actors.values()), {}
        self._watches.clear()
        await asyncio.gather(*(self._stop_actor(a) for a in actors))
        await self._driver.stop()
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    async def __aenter__(self) -> RayRuntime:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- replicas ----------------------------------------------------------------------

    async def _start_actor(self, name: str) -> ReplicaEndpoints:
        import ray

        assert self._plan is not None
        actor: ActorHandle = (
            ray.remote(ReplicaActor)
            .options(num_cpus=self.settings.ray.num_cpus_per_replica, max_restarts=0)
            .remote(
                self._plan.model_dump_json(),
                replica_index(name),
                name in self._restarts,
                {**forwarded_env(self.settings.ray.forward_env), **self._driver.group.env},
                self._log_dir,
            )
        )
        # The servers' tokens travel as actor arguments: whoever can reach the Ray cluster
        # can run code on it anyway, so Ray's own access control (token auth) guards them.
        self._actors[name] = actor
        try:
            raw = await asyncio.wait_for(actor.start.remote(), PLACEMENT_TIMEOUT_S)
        except TimeoutError:
            raise LaunchError(
                f"{name}: Ray did not start its actor within {PLACEMENT_TIMEOUT_S:.0f}s; "
                f"does the cluster have {self.settings.ray.num_cpus_per_replica:g} CPU(s) free "
                f"(ray.num_cpus_per_replica)?"
            ) from None
        except ray.exceptions.RayError as exc:
            raise LaunchError(f"{name} failed to start on Ray: {_reason(exc)}") from None
        self._watches[name] = actor.watch.remote()
        return endpoints_of(raw)

    async def _stop_actor(self, actor: ActorHandle) -> None:
        """Stop its servers politely if it still answers, then end the actor."""
        import ray

        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(actor.stop.remote(), _STOP_GRACE_S)
        ray.kill(actor, no_restart=True)

    def actor(self, name: str) -> ActorHandle:
        """The actor of replica ``name`` (for operators and fault-injection tests)."""
        return self._actors[name]

    async def restart_replica(self, name: str) -> ReplicaEndpoints:
        """End replica ``name``'s actor (if any is left) and start a new, empty one."""
        old = self._actors.pop(name, None)
        self._watches.pop(name, None)
        if old is not None:
            await self._stop_actor(old)
        self._restarts.add(name)
        endpoints = await self._start_actor(name)
        assert self.deployment is not None
        replicas = [endpoints if r.name == name else r for r in self.deployment.replicas]
        self.deployment = self.deployment.model_copy(update={"replicas": replicas})
        return endpoints

    async def supervise(self, on_down: OnDown, on_up: OnUp, *, poll_s: float = 0.25) -> None:
        """Until cancelled: a replica whose actor died (or whose server exited) is reported
        down, given a new actor, and reported up; the policy dying ends the run."""
        while True:
            name, why = await self._next_down(poll_s)
            log.warning("%s is down (%s); starting a new actor for it", name, why)
            await on_down(name)
            endpoints = await self.restart_replica(name)
            await on_up(endpoints)

    async def _next_down(self, poll_s: float) -> tuple[str, str]:
        while True:
            watched = dict(self._watches)
            waits = {asyncio.ensure_future(_outcome(ref)): name for name, ref in watched.items()}
            policy = asyncio.ensure_future(self._watch_policy(poll_s))
            try:
                done, _ = await asyncio.wait({*waits, policy}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for future in (*waits, policy):
                    future.cancel()
                await asyncio.gather(*waits, policy, return_exceptions=True)
            if policy in done:
                policy.result()
            for future, name in waits.items():
                # An actor replaced meanwhile (restart_replica called directly) is not news.
                if future in done and self._watches.get(name) is watched[name]:
                    return name, future.result()

    async def _watch_policy(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            for child in self._driver.group.dead():
                raise LaunchError(
                    f"{child.spec.name} exited unexpectedly (code {child.process.returncode}); see {child.log_path}"
                )


_RUN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _signal_handlers() -> dict[int, Any]:
    return {signum: signal.getsignal(signum) for signum in _RUN_SIGNALS}


def _restore(handlers: dict[int, Any]) -> None:
    """Put back the handlers ``ray.init`` replaced: its core worker installs one for SIGTERM
    that logs and dies, and the driver's own (a final snapshot, ``rollpoint.preemption``)
    must stay the one that answers."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (and then the caller owns signals)
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


async def _outcome(watch: Any) -> str:
    """Why a replica is down, once its ``watch`` call ends (it ends only when it is)."""
    import ray

    try:
        return f"its server {await watch}"
    except ray.exceptions.RayActorError as exc:
        return f"its actor died: {_reason(exc)}"
    except ray.exceptions.RayError as exc:
        return f"its watch failed: {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    """One line: our own error's message when the actor raised one, else Ray's first line."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RollpointError):
        return cause.message
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
