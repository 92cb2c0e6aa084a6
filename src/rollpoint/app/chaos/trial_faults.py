"""The in-process faults of one chaos trial run.

Owns :class:`TrialFaults`: the plan's faults of this run that strike inside the trial's
process (:meth:`~rollpoint.app.chaos.plan.TrialPlan.in_process`), the fault proxies they
need (one in front of each participant a fault targets, rewritten into the deployment's
route; one between an agent and the peer a ``peer_partition`` cuts it from, set in the
agent's spec), the skewed control clocks set in a server's spec, and their application at
their moments beside the job's drive, one strike per kind (:class:`Strike`). Each fault
that took effect, was over or missed is said as a
:class:`~rollpoint.app.chaos.plan.TrialEvent` (:func:`~rollpoint.app.chaos.trial_output.emit`).

It does not run the job (:func:`~rollpoint.app.chaos.trial.run_trial` does, handing it
these hooks) nor apply the faults between runs (the runner does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollpoint.app.chaos.engine_checks import fault_log_lines
from rollpoint.app.chaos.plan import (
    OWN_SERVERS,
    PEER_PATHS,
    PROXIED,
    SPEC_FAULTS,
    ChaosFault,
    PlannedFault,
    TrialEvent,
    TrialPlan,
    engine_fault_log,
    trial_store_folder,
)
from rollpoint.app.chaos.trial_output import emit
from rollpoint.app.config import RunConfig
from rollpoint.job.run import drive_quietly
from rollpoint.protocol.control import CONTROL_PREFIX, Verb
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.errors import ConfigError, RollpointError
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.embedded import EmbeddedRuntime, replica_name, replica_of
from rollpoint.runtime.process_group import ChildServer
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.testing.fault import Fault
from rollpoint.testing.fault_proxy import FaultProxy
from rollpoint.testing.faulty_store import fail_writes, heal
from rollpoint.testing.snapshot_damage import NothingToDamage, damage_shared_pack
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer

__all__ = ["ChaosMissError", "Strike", "TrialFaults"]

log = logging.getLogger("__main__")
"""The trial module's logger as its lines have always read: the trial process runs
``python -m rollpoint.app.chaos.trial``, whose ``__name__`` is ``__main__``."""

_FOREVER_S = 24 * 3600.0
_NOTICED_POLL_S = 0.02


@dataclass(frozen=True)
class Strike:
    """A fault that took effect: when, and what ends it (None: over at once)."""

    ts: float
    recover: Callable[[], Awaitable[None]] | None = None


_StrikeFn = Callable[[PlannedFault, Trainer, Runtime], Awaitable[Strike | None]]
"""Applies one fault; returns when it took effect, None when it found nothing to hit."""


class TrialFaults:
    """The plan's faults of one run: the proxies they need and their application."""

    def __init__(self, plan: TrialPlan, config: RunConfig) -> None:
        self.faults = plan.in_process()
        self._config = config
        self._engine_log = engine_fault_log(plan)
        self._proxies: dict[tuple[str, ParticipantKind], FaultProxy] = {}
        """(replica, participant) → the proxy in front of it; its faults share it."""
        self._peer_proxies: dict[tuple[str, ParticipantKind], FaultProxy] = {}
        """(replica, peer) → the proxy between that replica's agent and the peer."""
        self._skewed: set[str] = set()
        """Servers started with a skewed control clock, by name."""
        self._stack = contextlib.AsyncExitStack()
        self._early: list[asyncio.Task[None]] = []
        """Faults struck from the route on: a rerun's restore is sent before ``drive``."""
        self._up_at = time.monotonic()
        self._struck: set[str] = set()
        """The faults that took effect, by description."""
        self._strikes: dict[ChaosFault, _StrikeFn] = {
            ChaosFault.REPLICA_KILL: self._kill_replica,
            ChaosFault.CHECKPOINT_KILL: self._kill_at_capture,
            ChaosFault.REPLICA_STOP: self._stop_replica,
            ChaosFault.PARTICIPANT_RESTART: self._restart_in_place,
            ChaosFault.LOST_RUN_REPLY: self._lose_reply,
            ChaosFault.LOST_CONTROL_REPLY: self._lose_reply,
            ChaosFault.PARTITION: self._partition,
            ChaosFault.SLOW_PREPARE: self._slow_prepare,
            ChaosFault.STORE_FULL: self._fill_store,
            ChaosFault.PEER_PARTITION: self._partition_peer,
            ChaosFault.CLOCK_SKEW: self._skew_clock,
            ChaosFault.PACK_DAMAGE_LIVE: self._damage_pack,
            ChaosFault.OVERSIZED_REPLY: self._engine_data,
            ChaosFault.BAD_TOKEN_DATA: self._engine_data,
            ChaosFault.TOOL_CALL_WITHOUT_ID: self._engine_data,
        }
        self._store = trial_store_folder(plan)

    async def aclose(self) -> None:
        await self._give_up(self._early)
        await self._stack.aclose()

    async def _give_up(self, tasks: list[asyncio.Task[None]]) -> None:
        """Cancel the faults still waiting to strike as the run ends, saying each missed
        (a task is named by its fault); one that struck and waits to be over is not."""
        for task in tasks:
            task.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        for task, outcome in zip(tasks, ended, strict=True):
            if isinstance(outcome, asyncio.CancelledError) and task.get_name() not in self._struck:
                _missed(task.get_name(), "the run ended before it took effect")

    @property
    def hooks_specs(self) -> bool:
        return any(f.kind in SPEC_FAULTS for f in self.faults)

    async def spec_hook(self, spec: ServerSpec) -> ServerSpec:
        """A replica server's spec as the faults want it started: an agent given a proxy
        for a peer a ``peer_partition`` cuts it from, a participant whose control clock a
        ``clock_skew`` moves. A replica started again gets neither (the fault then finds
        nothing, or the skew is over)."""
        replica = replica_of(spec.name)
        settings = dict(spec.settings)
        for fault in self.faults:
            if replica != replica_name(fault.replica):
                continue
            if fault.kind is ChaosFault.PEER_PARTITION and spec.kind == "agent":
                key = (replica, fault.participant)
                url_key = f"{fault.participant}_url"
                if key in self._peer_proxies:
                    del self._peer_proxies[key]  # started again: its new peers directly
                    continue
                proxy = await self._stack.enter_async_context(FaultProxy(str(settings[url_key])))
                self._peer_proxies[key] = proxy
                settings[url_key] = proxy.url
            elif fault.kind is ChaosFault.CLOCK_SKEW and spec.kind == fault.participant:
                if spec.name in self._skewed:
                    self._skewed.discard(spec.name)  # started again: a clock of its own
                    continue
                self._skewed.add(spec.name)
                settings["clock_skew_s"] = fault.seconds
        return spec.model_copy(update={"settings": settings})

    async def route(self, deployment: Deployment) -> Deployment:
        """Put a proxy in front of each participant a fault targets; the moments start now."""
        replicas = {r.name: r for r in deployment.replicas}
        for fault in self.faults:
            key = (replica_name(fault.replica), fault.participant)
            if fault.kind not in PROXIED or key[0] not in replicas or key in self._proxies:
                continue
            field = f"{fault.participant}_url"
            upstream = getattr(replicas[key[0]], field)
            self._proxies[key] = await self._stack.enter_async_context(FaultProxy(upstream))
            replicas[key[0]] = replicas[key[0]].model_copy(update={field: self._proxies[key].url})
        self._up_at = time.monotonic()
        emit(TrialEvent(event="up", ts=time.time()))
        # Armed as the servers come up: the restore is a rerun's first control call.
        self._early = [
            asyncio.create_task(self._strike(f, self._lost(f)), name=f.describe())
            for f in self.faults
            if _at_restore(f)
        ]
        return deployment.model_copy(update={"replicas": list(replicas.values())})

    async def drive(
        self, trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics
    ) -> RunSummary:
        """Run the job as ``rollpoint run`` does, the faults landing beside it."""
        if any(f.kind in OWN_SERVERS for f in self.faults) and not isinstance(
            runtime, EmbeddedRuntime
        ):
            raise ConfigError(
                "rollpoint chaos signals local server processes: use runtime: embedded"
            )
        applying = [
            asyncio.create_task(self._apply(f, trainer, runtime), name=f.describe())
            for f in self.faults
            if not _at_restore(f)
        ]
        try:
            return await drive_quietly(trainer, runtime, metrics)
        finally:
            await self._give_up(applying)

    async def _apply(self, fault: PlannedFault, trainer: Trainer, runtime: Runtime) -> None:
        start = self._up_at
        if fault.after_snapshots:
            # Polled: the coordinator keeps a list of its saves, and no event for them.
            while True:
                if _published(trainer) >= fault.after_snapshots:
                    break
                await asyncio.sleep(_NOTICED_POLL_S)
            start = time.monotonic()
        await asyncio.sleep(max(0.0, start + fault.at_s - time.monotonic()))
        await self._strike(fault, self._strikes[fault.kind](fault, trainer, runtime))

    async def _strike(self, fault: PlannedFault, striking: Awaitable[Strike | None]) -> None:
        """Wait for the fault to take effect, then for it to be over, saying both."""
        try:
            strike = await striking
        except (RollpointError, ChaosMissError) as exc:
            log.warning("chaos: %s could not be applied: %s", fault.describe(), exc.message)
            _missed(fault.describe(), f"could not be applied: {exc.message}")
            return
        if strike is None:
            log.info("chaos: %s found nothing to hit", fault.describe())
            _missed(fault.describe(), "found nothing to hit: its replica was down or gone")
            return
        log.info("chaos: %s took effect", fault.describe())
        self._struck.add(fault.describe())
        emit(TrialEvent(event="fault", ts=strike.ts, kind=fault.kind, detail=fault.describe()))
        if strike.recover is not None:
            await strike.recover()
        emit(TrialEvent(event="over", ts=time.time(), kind=fault.kind, detail=fault.describe()))

    # --- one strike per kind -----------------------------------------------------------

    async def _kill_replica(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        name = replica_name(fault.replica)
        victims = _servers_of(fault, trainer, runtime)
        if not victims:
            return None
        before = trainer.roster.endpoints(name)
        for child in victims:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGKILL)

        async def noticed() -> None:
            # Over once the trainer stopped using the dead servers (marked the replica
            # down, or already has its successor): snapshots go on without it from then.
            # The trainer has no event for that, so poll.
            while True:
                if not trainer.roster.is_up(name) or trainer.roster.endpoints(name) != before:
                    return
                await asyncio.sleep(_NOTICED_POLL_S)

        return Strike(time.time(), noticed)

    async def _kill_at_capture(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        """:meth:`_kill_replica` at the next save's capture point: in journal mode after
        every participant's checkpoint is written, before the snapshot is published."""
        coordinator = trainer.coordinator
        if coordinator is None:
            return None
        struck: asyncio.Future[Strike | None] = asyncio.get_running_loop().create_future()

        async def kill() -> None:
            coordinator.before_capture = None  # once
            if not struck.done():
                struck.set_result(await self._kill_replica(fault, trainer, runtime))

        coordinator.before_capture = kill
        try:
            return await struck
        finally:
            if coordinator.before_capture is kill:
                coordinator.before_capture = None

    async def _stop_replica(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        victims = _servers_of(fault, trainer, runtime)
        if not victims:
            return None
        for child in victims:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGSTOP)

        async def cont() -> None:
            # Continued however the wait ends: a trial cancelled while they are stopped
            # must not leave processes that ignore the runtime's SIGTERM at shutdown.
            try:
                await asyncio.sleep(fault.seconds)
            finally:
                for child in victims:
                    with contextlib.suppress(ProcessLookupError):
                        child.process.send_signal(signal.SIGCONT)

        return Strike(time.time(), cont)

    async def _restart_in_place(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        victims = _servers_of(fault, trainer, runtime)
        if not victims:
            return None
        assert isinstance(runtime, EmbeddedRuntime)  # drive checked it
        group = runtime.group
        again = await group.kill_unlisted(victims[0])

        async def back() -> None:
            await asyncio.sleep(fault.seconds)  # the container's own restart time
            await group.start([again])

        return Strike(time.time(), back)

    async def _lose_reply(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        return await self._lost(fault)

    async def _lost(self, fault: PlannedFault) -> Strike:
        """The reply of the next request the fault names is lost: once one was."""
        path = "/run"
        if fault.kind is not ChaosFault.LOST_RUN_REPLY:
            path = f"{CONTROL_PREFIX}/{fault.verb or Verb.COMMIT}"
        rule = self._proxy_of(fault).add(Fault.drop_reply(method="POST", path=path))
        await rule.wait(timeout_s=_FOREVER_S)
        return Strike(time.time())

    async def _partition(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        # Cut on the next control request, so the partition meets a snapshot.
        return await _cut(self._proxy_of(fault), CONTROL_PREFIX, fault)

    async def _slow_prepare(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        proxy = self._proxy_of(fault)
        rule = proxy.add(
            Fault.delay(fault.seconds, method="POST", path=f"{CONTROL_PREFIX}/prepare")
        )
        await rule.wait(timeout_s=_FOREVER_S)
        return Strike(time.time(), lambda: asyncio.sleep(fault.seconds))

    async def _partition_peer(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        proxy = self._peer_proxies.get((replica_name(fault.replica), fault.participant))
        if proxy is None:
            return None  # its replica was started again: the agent talks to its peer directly
        # Cut on the agent's next call of that kind, so the partition meets an episode.
        return await _cut(proxy, PEER_PATHS[fault.participant], fault)

    async def _skew_clock(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        """In effect from the server's start (its spec carried the skew): said at its
        moment, over at once; none when the server runs with its own clock again."""
        name = f"{fault.participant}-{replica_name(fault.replica)}"
        return Strike(time.time()) if name in self._skewed else None

    async def _fill_store(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        fail_writes(self._store, fault.error or "ENOSPC")

        async def free() -> None:
            try:
                await asyncio.sleep(fault.seconds)
            finally:  # a run cut short must not leave the disk full (the runner heals too)
                heal(self._store)

        return Strike(time.time(), free)

    async def _damage_pack(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        """Flip a byte of the records file most published snapshots name, under the live
        run: the next snapshots must not name it damaged (the runner checks the newest)."""
        try:
            done = await asyncio.to_thread(damage_shared_pack, self._store, "flip")
        except NothingToDamage as exc:
            raise ChaosMissError(str(exc)) from None
        log.warning("chaos: %s: %s", fault.describe(), done)
        return Strike(time.time())

    async def _engine_data(
        self, fault: PlannedFault, trainer: Trainer, runtime: Runtime
    ) -> Strike | None:
        """Set up as the run's scripted policy started (``policy.faults``, from
        :func:`~rollpoint.app.chaos.trial.trial_config`): it took effect once the policy
        logged the corruption."""
        if self._config.policy.base_url is not None:
            raise ChaosMissError("the policy is not the scripted one (policy.base_url)")
        if not isinstance(runtime, EmbeddedRuntime):
            raise ChaosMissError("the scripted policy runs apart (rollpoint serve)")
        corrupt = _CORRUPTION[fault.kind]
        while True:  # polled: the policy is another process; its log is the only word
            for line in fault_log_lines(self._engine_log):
                if line.get("corrupt") == corrupt:
                    return Strike(float(line["ts"]))
            await asyncio.sleep(_ENGINE_LOG_POLL_S)

    def _proxy_of(self, fault: PlannedFault) -> FaultProxy:
        proxy = self._proxies.get((replica_name(fault.replica), fault.participant))
        if proxy is None:
            raise ConfigError(f"chaos: no proxy for {fault.describe()}")
        return proxy


_CORRUPTION = {
    ChaosFault.OVERSIZED_REPLY: "oversized_reply",
    ChaosFault.BAD_TOKEN_DATA: "token_data",
    ChaosFault.TOOL_CALL_WITHOUT_ID: "tool_call_id",
}
"""Each engine-data kind's ``EngineFault.corrupt``."""
_ENGINE_LOG_POLL_S = 0.05


def _published(trainer: Trainer) -> int:
    """The snapshots with saved episodes this run has published."""
    coordinator = trainer.coordinator
    if coordinator is None:
        return 0
    return coordinator.published_with_episodes


async def _cut(proxy: FaultProxy, path: str, fault: PlannedFault) -> Strike:
    """Partition ``proxy`` on its next request under ``path`` (forwarded first when the
    fault says so); it heals ``fault.seconds`` later."""
    rule = proxy.add(Fault.refuse(path=path, forward=fault.forward))
    await rule.wait(timeout_s=_FOREVER_S)

    async def heal() -> None:
        await asyncio.sleep(fault.seconds)
        await proxy.heal()

    return Strike(time.time(), heal)


class ChaosMissError(Exception):
    """A fault found nothing of its kind to act on (said as missed, with why). The trial's
    own signal, caught in :meth:`_strike`: not a :class:`RollpointError` (the one error
    tree is what crosses the wire and the console, each with a code of its own)."""

    @property
    def message(self) -> str:
        return str(self)


def _missed(fault: str, reason: str) -> None:
    emit(TrialEvent(event="missed", ts=time.time(), detail=fault, reason=reason))


def _at_restore(fault: PlannedFault) -> bool:
    return fault.kind is ChaosFault.LOST_CONTROL_REPLY and fault.verb is Verb.RESTORE


def _servers_of(fault: PlannedFault, trainer: Trainer, runtime: Runtime) -> list[ChildServer]:
    """The live server processes of the fault's replica it names; none while the
    trainer counts the replica down (a kill or stop then finds nothing to hit)."""
    assert isinstance(runtime, EmbeddedRuntime)  # drive checked it
    name = replica_name(fault.replica)
    if not trainer.roster.is_up(name):
        return []
    return [
        c
        for c in runtime.group.children
        if c.alive and replica_of(c.spec.name) == name and c.spec.kind in fault.servers
    ]
