"""The trainer loop: one run of async GRPO over the environment deployment.

Owns the run's parts and how they meet: the ledger, the dispatch barrier, the finished queue and the
dispatcher are built here (and exposed, so a snapshot coordinator can drive them); one
task keeps the dispatcher fed with prompt groups (none while ``max_ready_batches`` batches
wait for training: what the trainer holds stays bounded), one trains on whole groups as the finished queue fills,
and a stall watchdog fails the run when no row result arrives for too long (time paused
by a snapshot not counted). Every train step calls the :class:`TrainHooks`, bumps the
policy version on every model server, writes the consumed rollouts to the trainer's
:class:`StepRecord` (by default :class:`WorkdirRecord`: ``<workdir>/train_data.jsonl``,
fsync'd per step) and, once the step is durable there, commits the finished queue.

The parts it holds, each in its own module: the feed (:class:`GroupFeed`: the groups to
send, added while running or sent again when stale, the failed ones and the batches handed
over), the train loop (:class:`TrainLoop`: each step, and when it is durable), the live
policy version and the trainer's weight updates (:class:`PolicyVersions`), the stops from
inside (:class:`RunStops`: too many failed groups, a stuck peer); the stall watchdog, the
in-flight sampler and the run's own snapshots are functions it runs alongside. The names
that moved out with them stay importable from here.

Given a :class:`ControlPlane`, it also takes snapshots (every ``snapshot.every_seconds``
and at every train checkpoint) through a :class:`SnapshotCoordinator`, and releases what it
no longer needs on the environment side (acks, retires, forgets) through a
:class:`ReleaseBatcher`, which also lets the dispatcher retire a try before it gives up on it.

The runtime reports replicas that die and come back (:meth:`Trainer.replica_down`,
:meth:`Trainer.replica_up`); the trainer keeps the one :class:`ReplicaRoster` the dispatcher,
the coordinator and the release batcher read; a :class:`ReplicaRecovery` restores the lost
replica's snapshot tries onto it when it is back, and the dispatcher sends the rest
elsewhere. It does not watch processes (that is the runtime's job).

For its run, it tells the checkpoint seam (:mod:`rollpoint.tuning.seam`) that checkpoints
are in use on its coordinator (after discovery) and that the coordinator closed (when the
run ends); the coordinator itself emits each pause's hold and release.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

from rollpoint.http.client import HttpClient
from rollpoint.policy.engine_adapters import PauseMode
from rollpoint.protocol.deployment import Deployment, ReplicaEndpoints
from rollpoint.protocol.episode import RunReply, TaskRow
from rollpoint.protocol.errors import ConfigError, InvalidPhaseError
from rollpoint.trainer.control.control_plane import ControlPlane
from rollpoint.trainer.control.in_flight_sampler import sample_in_flight
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher
from rollpoint.trainer.dispatch.failed_groups import retry_failed
from rollpoint.trainer.dispatch.release_batcher import ReleaseBatcher
from rollpoint.trainer.dispatch.stall_watch import STALL_REPORT_ROWS as STALL_REPORT_ROWS
from rollpoint.trainer.dispatch.stall_watch import watch_stall
from rollpoint.trainer.group_feed import GroupFeed, check_task_ids
from rollpoint.trainer.group_feed import group_id_for as group_id_for
from rollpoint.trainer.metrics import RunCounts
from rollpoint.trainer.policy_lag import PolicyLag
from rollpoint.trainer.policy_versions import PolicyVersions
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.replica_recovery import ReplicaRecovery
from rollpoint.trainer.restore.restorer import RestoredRun
from rollpoint.trainer.run_events import ReplicaDown, ReplicaUp, RunEvents
from rollpoint.trainer.run_stops import STOP_SNAPSHOT_SLACK_S as STOP_SNAPSHOT_SLACK_S
from rollpoint.trainer.run_stops import RunStops
from rollpoint.trainer.run_summary import RunSummary as RunSummary
from rollpoint.trainer.run_summary import TrainerStats as TrainerStats
from rollpoint.trainer.settings import TrainerSettings
from rollpoint.trainer.snapshot.coordinator import SnapshotCoordinator
from rollpoint.trainer.snapshot.run_snapshots import SNAPSHOT_RETRY_S as SNAPSHOT_RETRY_S
from rollpoint.trainer.snapshot.run_snapshots import first_snapshot, last_snapshot, snapshot_loop
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import TrainHooks
from rollpoint.trainer.train_loop import TrainLoop
from rollpoint.tuning import seam

log = logging.getLogger(__name__)

REPLICA_DOWN_GRACE_S = 1.0
"""A row whose replica stopped answering waits this long for the runtime to report that
replica down before it is re-sent fresh: a dying replica's saved tries are then held for
its restart (restored from the snapshot) instead of starting over. The runtimes notice a
death within 0.25 s (embedded: process poll) or milliseconds (Ray: actor death)."""


class Trainer:
    def __init__(
        self,
        config: TrainerSettings,
        deployment: Deployment,
        tasks: list[TaskRow],
        *,
        hooks: TrainHooks,
        client: HttpClient | None = None,
        stall_timeout_s: float = 600.0,
        control: ControlPlane | None = None,
        restored: RestoredRun | None = None,
        step_record: StepRecord | None = None,
        replica_restart_wait_s: float | None = None,
        more_groups: bool = False,
    ) -> None:
        """``hooks`` update the policy on each batch (the façade's hand batches to your
        loop; ``rollpoint run``'s are :class:`rollpoint.loop.SimulatedTrainer`).
        ``restored`` continues a run from a snapshot (see :mod:`rollpoint.trainer.restore.restorer`);
        its ledger and the finished queue replace the fresh ones built from ``tasks``.
        ``step_record``: where each step's rows are written and its checkpoints kept (the one
        the restore checked and cut back; default: :class:`WorkdirRecord` in ``workdir``).
        ``replica_restart_wait_s``: how long a lost replica's snapshot tries wait for it to
        come back before they start over elsewhere (default: the snapshot deadline).
        ``more_groups``: the run takes groups added while it runs (:meth:`add_groups`) and
        ends only after :meth:`end_groups`; ``tasks`` may then be empty."""
        _check_inputs(config, tasks, stall_timeout_s, more_groups=more_groups)
        self.config = config
        self.deployment = deployment
        self.hooks = hooks
        self.ledger = restored.ledger if restored is not None else RecoveryLedger()
        self.finished_queue = restored.finished_queue if restored is not None else FinishedQueue()
        self.barrier = DispatchBarrier()
        self.roster = ReplicaRoster.of_deployment(
            deployment, control.participants if control else ()
        )
        """Which replicas are up and how to reach them; shared by every part below."""
        self.dispatcher: Dispatcher | None = None
        """Built by :meth:`run` (it needs the running loop's HTTP client)."""
        self.step_record: StepRecord = step_record or WorkdirRecord(config.workdir)
        """Writes each step's rows and keeps its checkpoints (what a restore resumes at)."""
        if restored is None:
            for task in tasks:
                gid = group_id_for(task.task_id)
                self.ledger.add_group(task, gid, config.group_size)
                self.finished_queue.expect_group(gid, config.group_size)
        self.retried: dict[str, str] = {}
        """Failed groups of the restored run sent again (``retry_failed``): old id → new."""
        if config.retry_failed:
            self.retried = retry_failed(self.ledger, self.finished_queue, config.group_size)
        self._client = client
        self._http: HttpClient | None = None
        """The data-plane client while :meth:`run` runs."""
        self._restored = restored is not None
        self.restored = restored
        """The snapshot this run continues (None: it started fresh)."""
        self._lost_before_run: set[str] = set()
        self._stall_timeout_s = stall_timeout_s
        self._started = False
        self._episodes = 0
        self._turns = 0
        self._reward_sum = 0.0
        self._running = asyncio.Event()
        """Set while :meth:`run` runs (weight updates wait for it)."""
        self._ended = False
        live, trainer_versions = 0, False
        if restored is not None:
            doc = restored.trainer_doc
            live = restored.checkpoint.policy_version
            trainer_versions = bool(doc.get("trainer_versions", False))
            self._episodes = self.ledger.counts()[RolloutState.SEALED]
            self._turns = int(doc.get("turns", 0))
            self._reward_sum = float(doc.get("reward_sum", 0.0))
        self.lag = PolicyLag(
            config.max_policy_lag,
            live=lambda: self.versions.live,  # built below, once the coordinator is
            busy=self._lag_busy,
            # The versions were the trainer's: none is stamped until it says one again.
            awaiting_trainer=trainer_versions,
        )
        """Each untrained row's oldest policy version; holds dispatch (``max_policy_lag``)."""
        if restored is not None:
            self.lag.load(restored.trainer_doc.get("policy_lag"))
        self.feed = GroupFeed(
            config,
            self.ledger,
            self.finished_queue,
            self.lag,
            more_groups=more_groups,
            training=lambda: self.train_loop.step_in_hand is not None,  # built below
        )
        """The groups to send, the task that sends them, and the batches it hands over."""
        self.events = control.metrics.run_events if control is not None else RunEvents(None)
        """The run's event log (``run_events.jsonl``; records nothing without a control plane)."""
        self._metrics = control.metrics if control is not None else None
        if self._metrics is not None:
            self._metrics.watch(self.run_counts)
            if restored is not None:
                self._metrics.record_restore(
                    "start",
                    continued=len(restored.continued),
                    restarted=restored.restarted,
                    adopted=restored.adopted,
                    requeued=restored.tq_requeued,
                )
        self.coordinator: SnapshotCoordinator | None = None
        self.releases: ReleaseBatcher | None = None
        self.recovery: ReplicaRecovery | None = None
        """Restores a replica lost mid-run from the latest snapshot (with a control plane)."""
        if control is not None:
            self.coordinator = SnapshotCoordinator(
                self.roster,
                store=control.store,
                ledger=self.ledger,
                finished_queue=self.finished_queue,
                barrier=self.barrier,
                config=config.save,
                metrics=control.metrics,
                trainer_state=self.state,
                config_fingerprint=config.fingerprint,
            )
            # Snapshot retention never prunes the last snapshot a kept checkpoint needs.
            control.store.checkpoint_steps = self.step_record.steps
            if restored is not None:
                self.coordinator.hold_until_published(restored.snapshot_id)
            self.releases = ReleaseBatcher(self.roster, self.ledger, barrier=self.barrier)
            self.coordinator.before_save = self.releases.flush
            deadline_s = config.save.deadline_seconds
            self.recovery = ReplicaRecovery(
                self.ledger,
                self.roster,
                self.coordinator,
                wait_s=deadline_s if replica_restart_wait_s is None else replica_restart_wait_s,
                restore_deadline_s=deadline_s,
                journaled=config.journaled,
            )
        self.versions = PolicyVersions(
            self.roster,
            self.lag,
            self.coordinator,
            require_http=self._require_http,
            live=live,
            trainer_versions=trainer_versions,
        )
        """The live policy version: rollpoint's count per step, or the trainer's own."""
        self.train_loop = TrainLoop(
            config,
            hooks,
            self.step_record,
            self.finished_queue,
            feed=self.feed,
            versions=self.versions,
            lag=self.lag,
            events=lambda: self.events,
            coordinator=self.coordinator,
            restored=restored.checkpoint if restored is not None else None,
        )
        """Trains the batches the feed hands over; makes each step durable."""

    def state(self) -> dict[str, Any]:
        """The trainer's own state at a cut (saved with every snapshot)."""
        return {
            "train_step": self.train_loop.train_steps,
            "policy_version": self.versions.live,
            "trainer_versions": self.versions.trainer_versions,
            "policy_lag": self.lag.to_doc(),
            "episodes": self._episodes,
            "turns": self._turns,
            "reward_sum": self._reward_sum,
            "groups_trained": self.train_loop.groups_trained,
        }

    @property
    def stats(self) -> TrainerStats:
        return TrainerStats(
            episodes_finished=self._episodes,
            turns=self._turns,
            reward_sum=self._reward_sum,
            train_steps=self.train_loop.train_steps,
            in_flight=self.ledger.in_flight_count(),
            failed_groups=len(self.feed.failed),
            groups_total=len(self.ledger.group_ids()),
            groups_trained=self.train_loop.groups_trained,
            policy_version=self.versions.live,
        )

    @property
    def last_metrics(self) -> dict[str, float]:
        """The metrics the train hooks returned for the last step."""
        return self.train_loop.last_metrics

    @property
    def stale_marked(self) -> int:
        """Samples handed over marked ``stale``."""
        return self.train_loop.stale_marked

    @property
    def stale_resent(self) -> int:
        """Groups sent again because a sample was beyond ``max_policy_lag``."""
        return self.feed.stale_resent

    def _lag_busy(self) -> bool:
        """Whether the run makes progress without new episodes: rows in flight, or a batch
        ready to train (so a dispatch held for the lag bound is not a deadlock)."""
        return (
            self.ledger.in_flight_count() > 0
            or self.finished_queue.ready_rollouts >= self.config.batch_size
        )

    def run_counts(self) -> RunCounts:
        """The counts ``/metrics`` shows (read at each scrape)."""
        d = self.dispatcher
        return RunCounts(
            episodes_finished=self._episodes,
            episodes_trained=self.train_loop.episodes_trained,
            train_steps=self.train_loop.train_steps,
            in_flight=self.ledger.in_flight_count(),
            waiting=0 if d is None else d.waiting_rows,
            failed_groups=len(self.feed.failed),
            replicas_up=len(self.roster.up),
            resent={} if d is None else {"given_up": d.resent_fresh, "refused": d.resent_refused},
            adopted_replies=0 if d is None else d.adopted,
            failed_rows={} if d is None else dict(d.failed_rows),
            damaged_records_files=0
            if self.coordinator is None
            else self.coordinator.damaged_records_files,
        )

    async def run(self) -> RunSummary:
        """Play and train every group; return when each is trained or failed."""
        if self._started:
            raise InvalidPhaseError("trainer: run() was already called on this trainer")
        self._started = True
        started = time.monotonic()
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        client = self._client or HttpClient()
        self._http = client
        self._running.set()
        try:
            self.dispatcher = Dispatcher(
                self.ledger,
                self.deployment,
                client,
                concurrency=self.config.concurrency,
                max_turns=self.config.max_turns,
                row_timeout_s=self.config.row_timeout_seconds,
                max_reply_bytes=self.config.max_reply_bytes,
                barrier=self.barrier,
                on_reply=self._on_reply,
                roster=self.roster,
                releases=self.releases,
                down_grace_s=REPLICA_DOWN_GRACE_S if self.recovery is not None else 0.0,
                down_first=self.recovery is not None and self.config.journaled,
                hold=self.lag,
            )
            for name in sorted(self._lost_before_run):
                self.dispatcher.replica_lost(name)
            if self.coordinator is not None:
                await self.coordinator.discover()
                # Checkpoints are in use for this run: with the collector's listener
                # installed, the trainer's full collections follow its pauses, not into the
                # next one (a 0.35-0.78 s trainer collection preceded 10k pause outliers).
                seam.in_use(self.coordinator)
            if self.versions.live:
                await self.versions.publish(client, self.versions.live)
            if self.coordinator is not None and not self._restored and self._snapshots_on:
                # A snapshot before the first row is sent: whatever this run trains is then
                # resumable (it composes with step 0), so a rerun never finds train data
                # with no snapshot to go with it (it refuses that rather than delete it).
                await first_snapshot(self.coordinator)
            stops = RunStops(
                self.config,
                self.coordinator,
                self.barrier,
                self.roster,
                self.ledger,
                policy_url=lambda: self.deployment.policy_url,
                previous=None if self.restored is None else self.restored.snapshot_id,
            )
            side: list[Any] = [
                watch_stall(
                    self.dispatcher, self.barrier, self.ledger, self.roster, self._stall_timeout_s
                ),
                stops.on_failures(self.feed),
                stops.when_stuck(),
            ]
            if self.events.path is not None:
                side.append(sample_in_flight(self.roster, self.ledger, lambda: self.events))
            if self.coordinator is not None and self.releases is not None:
                every = self.config.snapshot_every_seconds
                side += [snapshot_loop(self.coordinator, every), self.releases.run()]
            async with self.dispatcher:
                await _supervise(
                    main=[self.feed.run(self.dispatcher), self.train_loop.run(client)], side=side
                )
            if self.releases is not None:
                await self.releases.flush()
            if self.coordinator is not None and self._snapshots_on:
                await last_snapshot(self.coordinator)
            if self.train_loop.not_durable:
                log.warning(
                    "the run ended with train steps %s never made durable (mark_durable): "
                    "a rerun resumes before them and trains their rows again",
                    ", ".join(map(str, sorted(self.train_loop.not_durable))),
                )
        finally:
            if self.coordinator is not None:
                await seam.closed(self.coordinator)
            self._http = None
            self._running.clear()
            self._ended = True
            if self._client is None:
                await client.aclose()
        return RunSummary(
            episodes=self._episodes,
            turns=self._turns,
            train_steps=self.train_loop.train_steps,
            failed_groups=dict(self.feed.failed),
            mean_reward=self.stats.reward_mean,
            elapsed_s=time.monotonic() - started,
        )

    # --- replicas --------------------------------------------------------------------

    async def replica_down(self, name: str) -> None:
        """The runtime saw ``name``'s processes die: stop using it. The tries the latest
        snapshot saved there wait for its restart (see :mod:`.restore.replica_recovery`); the rest
        of what it held (its in-flight and pinned tries) goes fresh to the replicas still
        up. Snapshots go on without it. Idempotent."""
        if not self.roster.mark_down(name):
            return
        log.warning("replica %s is down; %s carry on", name, ", ".join(self.roster.up) or "none")
        if self.dispatcher is not None and self.recovery is not None:
            self.recovery.hold(name, self.dispatcher)
            held = self.recovery.held.get(name)
            self.events.append(
                ReplicaDown(
                    ts=time.time(), replica=name, held=0 if held is None else len(held.attempts)
                )
            )
        elif self.dispatcher is not None:
            self.dispatcher.replica_lost(name)
        else:
            # Tries a restore pinned to it must not go to its empty successor either.
            self._lost_before_run.add(name)

    async def replica_up(self, endpoints: ReplicaEndpoints) -> None:
        """The runtime restarted a replica, empty, at ``endpoints``: restore the tries held
        for it from the snapshot that saved them, and use it again (its participants take
        part from the next snapshot). A replica reported up at new URLs while it was still
        up is taken as restarted: what the old servers held is gone."""
        name = endpoints.name
        if self.roster.is_up(name):
            if self.roster.endpoints(name) == endpoints:
                return
            await self.replica_down(name)
        self.roster.mark_up(endpoints)
        self.deployment = self.roster.deployment()
        if self.dispatcher is not None:
            self.dispatcher.replica_back(name)
        log.info("replica %s is up again at %s", name, endpoints.agent_url)
        if self.versions.live and self._http is not None:
            await self.versions.publish(self._http, self.versions.live, [endpoints])
        if self.dispatcher is not None and self.recovery is not None:
            restored = await self.recovery.restore(name, self.dispatcher)
            self.events.append(ReplicaUp(ts=time.time(), replica=name, restored=restored))
            if restored and self._metrics is not None:
                self._metrics.record_restore("replica", continued=restored)

    # --- rollouts --------------------------------------------------------------------

    async def _on_reply(self, reply: RunReply) -> None:
        record = self.ledger.seal(reply.episode.rollout_id)
        if self.releases is not None and record.replica is not None:
            self.releases.sealed(reply.episode, record.replica)
        self.finished_queue.put(reply)
        self.lag.finished(reply)
        self._episodes += 1
        self._turns += reply.turns
        self._reward_sum += reply.reward
        self.feed.rollout_finished()

    # --- groups added while running -------------------------------------------------

    def add_groups(self, tasks: Iterable[TaskRow]) -> list[str]:
        """Add one prompt group per task to a run opened with ``more_groups``; they are
        sent after the groups before them, like the first ones. A task whose group the run
        already has (added before, or restored from a snapshot) is skipped, so a trainer
        resumed from a snapshot may add its stream again from a cursor of its own. Returns
        the ids of the groups added. Bad input is refused whole, in one line."""
        return self.feed.add_groups(tasks)

    def end_groups(self) -> None:
        """No more groups will be added: the run ends once those it has are trained."""
        self.feed.end_groups()

    @property
    def policy_version(self) -> int:
        """The version live on the engines (the trainer's own once it reported one)."""
        return self.versions.live

    async def weights_live(self, version: int) -> None:
        """Version ``version`` is live on the engines from now on (see :meth:`weight_update`
        for an update rollpoint pauses the engines around). Held out of snapshots."""
        await self.versions.weights_live(version)

    def weight_update(
        self, version: int, mode: PauseMode = "keep"
    ) -> AbstractAsyncContextManager[None]:
        """The engines paused in ``mode`` while the block pushes the weights; on leaving
        it, ``version`` is live and they resume. No snapshot runs inside (one in progress
        finishes first), so a snapshot is before the update or after it. A block that
        raises resumes the engines under the version they had."""
        return self.versions.weight_update(version, mode)

    async def pause_for_update(self, mode: PauseMode) -> None:
        """Step one of :meth:`weight_update`: hold snapshots, pause every up replica's
        engine (through its model server) in ``mode``."""
        await self.versions.pause_for_update(mode)

    async def end_update(self, version: int | None) -> None:
        """Step two: ``version`` live (None: the one before, for an update given up), the
        engines resumed, snapshots let go."""
        await self.versions.end_update(version)

    async def _require_http(self) -> HttpClient:
        """The run's client; a call made before :meth:`run` got going waits for it."""
        if self._http is None and not self._ended:
            await self._running.wait()
        if self._http is None:
            raise InvalidPhaseError("trainer: the run is not running (no weights to update)")
        return self._http

    async def mark_durable(self, step: int) -> None:
        """The trainer's own checkpoint of ``step`` (a step it trained without saying it
        was durable) is durable now: rollpoint writes its train checkpoint of that step as
        it stood then, the finished queue lets go of what it consumed, and a snapshot follows. Steps before
        it that were never marked are passed over; a step already durable is a no-op."""
        await self.train_loop.mark_durable(step)

    @property
    def _snapshots_on(self) -> bool:
        """Whether this run takes snapshots by itself (a caller may also call save)."""
        return (
            self.config.checkpoint_every_steps is not None
            or self.config.snapshot_every_seconds is not None
        )


def _check_inputs(
    config: TrainerSettings, tasks: list[TaskRow], stall_timeout_s: float, *, more_groups: bool
) -> None:
    if not tasks and not more_groups:
        raise ConfigError("trainer: no tasks to run")
    check_task_ids(tasks)
    if config.group_size > config.concurrency:
        raise ConfigError(
            f"trainer: group_size {config.group_size} is larger than concurrency "
            f"{config.concurrency}: a group could never be sent"
        )
    if stall_timeout_s <= 0:
        raise ConfigError(f"trainer: stall_timeout_s must be > 0, got {stall_timeout_s}")


async def _supervise(main: list[Any], side: list[Any]) -> None:
    """Run ``main`` to completion with ``side`` alongside; the first error stops all. A side
    task that ends without an error (a watch with nothing to watch) is done with: waiting on
    it again would return at once, every time, and spin the loop for the whole run."""
    main_tasks = {asyncio.create_task(c) for c in main}
    side_tasks = {asyncio.create_task(c) for c in side}
    try:
        waiting = set(main_tasks)
        watching = set(side_tasks)
        while waiting:
            done, _ = await asyncio.wait(waiting | watching, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
                waiting.discard(task)
                watching.discard(task)
    finally:
        everything = main_tasks | side_tasks
        for task in everything:
            task.cancel()
        await asyncio.gather(*everything, return_exceptions=True)
