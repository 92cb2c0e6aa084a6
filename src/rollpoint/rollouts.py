"""The trainer's façade: rollouts to train on, pulled by a loop of your own.

Owns :class:`Rollouts`, the few calls a trainer author needs — open a run (on servers
``rollpoint serve`` started, or on ones it starts), learn where it resumed, add prompt
groups while it runs, pull batches of finished prompt groups, say when a batch's update is
done, take a snapshot, report a replica's servers gone and back, say which policy version
is live on the engines (pausing them around a weight update) — and
:class:`TrainBatch`, one batch handed out. Everything else (the recovery ledger, the
dispatcher, the finished-rollout queue, snapshots, ``train_data.jsonl`` and its
checkpoints, the restore) runs underneath as it does for ``rollpoint run``: the façade
drives the job (:func:`rollpoint.job.run.run_job`) with train hooks that hand each batch to the caller
and wait for it to come back. So an RL loop keeps its own structure, and a run killed
anywhere resumes at its last snapshot with nothing trained twice.

What the trainer must persist itself: its weights (and optimizer) after each batch, before
:meth:`TrainBatch.done` (rollpoint's checkpoint of step N then says rows up to N are
trained), handing over where they are as ``done(state=...)``; after a restore
:attr:`Rollouts.resumed_step` is the step whose weights to load and
:attr:`Rollouts.resumed_state` the state given with it. See docs/trainers.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pydantic import JsonValue, ValidationError

from rollpoint.job.run import Drive, drive_quietly, run_job
from rollpoint.job.settings import JobConfig, JobSettings, settings_of
from rollpoint.job.tasks import check_environment
from rollpoint.policy.engine_adapters import PauseMode
from rollpoint.preemption import StopRequest
from rollpoint.protocol.deployment import ReplicaEndpoints, ServedDeployment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import BadRequestError, ConfigError, InvalidPhaseError
from rollpoint.runtime.contract import Runtime
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.snapshot.cut import SaveReport
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import StepResult, TrainSample
from rollpoint.trainer.trainer import RunSummary, Trainer

log = logging.getLogger(__name__)

__all__ = [
    "ReplicaEndpoints",
    "Rollouts",
    "RunProgress",
    "ServedDeployment",
    "TrainBatch",
    "load_served",
]


@dataclass
class TrainBatch:
    """One train step's rollouts: whole prompt groups, each sample with its GRPO advantage
    and, with token capture on, its per-turn token ids and logprobs (``trajectory``)."""

    step: int
    """The train step this batch is (1 for the first a fresh run trains)."""
    samples: list[TrainSample]
    _reply: asyncio.Future[dict[str, float] | StepResult] = field(repr=False)

    def done(
        self,
        metrics: dict[str, float] | None = None,
        *,
        state: JsonValue = None,
        durable: bool | None = None,
    ) -> None:
        """The update on this batch is over: rollpoint writes the batch to
        ``train_data.jsonl`` and moves on. ``metrics`` go to the run's metrics log.

        ``state``: your trainer's own state after this step, as JSON (where its weights
        are, a data cursor; at most 1 MiB encoded, else a one-line ``BadRequestError``
        here): the step's checkpoint keeps it and a run restored at the step hands it
        back as :attr:`Rollouts.resumed_state`. Given once, it is kept until another is.

        ``durable``: whether your weights of this step are saved for good. None (the
        default): as ``train.checkpoint_every_steps`` says (every step: save them before
        ``done``). False: not yet (your save runs in the background); call
        :meth:`Rollouts.mark_durable` with the step when it is, and until then its rows
        are held (a restore trains them again). A durable step is checkpointed and a
        snapshot follows. Calling ``done`` twice is a no-op; any thread may call it."""
        result: dict[str, float] | StepResult = dict(metrics or {})
        if state is not None or durable is not None:
            result = StepResult(metrics=dict(metrics or {}), state=state, durable=durable)
        loop = self._reply.get_loop()
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            self._settle(result)
        else:
            loop.call_soon_threadsafe(self._settle, result)

    def _settle(self, result: dict[str, float] | StepResult) -> None:
        if not self._reply.done():
            self._reply.set_result(result)


@dataclass(frozen=True, slots=True)
class RunProgress:
    """Where a run stands, for a progress display (:meth:`Rollouts.progress`)."""

    episodes_total: int
    """Rows the run has (restored, from the config's tasks, or added): each one episode."""
    episodes_finished: int
    in_flight: int
    turns: int
    reward_mean: float
    """Over the finished episodes (0.0 before any)."""
    train_steps: int
    last_pause_s: float | None
    """How long the latest snapshot paused the run (None: none taken yet)."""
    policy_version: int = 0
    """The version live on the engines."""
    lag_holds: int = 0
    """Times new episodes waited for ``train.max_policy_lag``."""
    stale_resent: int = 0
    """Groups sent again for a sample beyond ``train.max_policy_lag``."""
    stale_marked: int = 0
    """Samples handed over marked ``stale``."""


END_OF_RUN = object()
"""What the batch queue holds once the run ended (or its stop was asked): no more batches."""


def attached_settings(settings: JobSettings, served: ServedDeployment) -> JobSettings:
    """``settings`` for a run on ``served``: its snapshot store is where those servers write
    their part of every snapshot, unless the settings name one (then they must agree)."""
    return settings if not served.snapshot_store else settings.on_store(served.snapshot_store)


def load_served(path: Path) -> ServedDeployment:
    """The deployment line ``rollpoint serve --json`` printed, read from ``path``; a file
    that is missing or is not that line is one :class:`ConfigError` naming it."""
    try:
        return ServedDeployment.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the line"
        raise ConfigError(
            f"{path}: not the line rollpoint serve --json prints ({where}: {first['msg']})"
        ) from None


class Rollouts:
    """A run whose batches your loop pulls: ``async with Rollouts(config) as run``.

    ``config``: the run's :class:`~rollpoint.RunConfig` (``rollpoint.load_config(path)``), or
    its :class:`~rollpoint.JobSettings` (``config.job_settings()``, changed or built in
    code); the façade reads the settings, taken once here.
    ``deployment``: the servers to run on, as ``rollpoint serve --json`` printed them (read
    the line with :func:`load_served`); they are left running when the
    run ends. Without it, the servers ``config.runtime`` names are started and stopped here.
    ``fresh``: start over instead of resuming (a workdir with progress is refused).
    ``more_groups``: besides the config's tasks (which may then be ``tasks: 0``), the run
    takes the groups :meth:`add_groups` hands it while it runs, and ends after
    :meth:`end_groups` once every group is trained.
    ``stop``: a :class:`~rollpoint.preemption.StopRequest` the signals call
    (:meth:`StopRequest.on_signals() <rollpoint.preemption.StopRequest.on_signals>` from
    your main task: SIGTERM and SIGINT): the first signal seals the
    run, takes one final snapshot within ``preemption.grace_seconds`` and ends it with a
    :class:`~rollpoint.protocol.errors.RunPreemptedError` naming the snapshot that holds it
    (raised by :meth:`summary`); ``rollpoint run`` passes the one it handles SIGTERM with.
    ``step_record``: where each batch's rows are written and which steps are durable, when
    your trainer keeps that record itself (a :class:`~rollpoint.trainer.StepRecord`; the
    default is rollpoint's, ``train_data.jsonl`` and ``checkpoints/`` in the workdir). A
    rerun resumes from the newest snapshot that composes with one of its durable steps.
    ``retry_failed``: the groups that failed in the run this one resumes are sent again,
    each under a new group id (``<task_id>-g1``, …), after the rest; what was trained stays
    trained, and a failed group sent again is no longer counted in the summary's
    ``failed_groups``. ``rollpoint inspect`` lists a run's failed groups with their reasons.
    """

    def __init__(
        self,
        config: JobSettings | JobConfig,
        *,
        deployment: ServedDeployment | None = None,
        fresh: bool = False,
        more_groups: bool = False,
        stop: StopRequest | None = None,
        step_record: StepRecord | None = None,
        say: Callable[[str], None] = log.info,
        retry_failed: bool = False,
    ) -> None:
        settings = settings_of(config, "Rollouts")
        if deployment is not None:
            settings = attached_settings(settings, deployment)
        self.settings = settings
        """What this run was told (its snapshot store the attached servers' when they have one)."""
        self._deployment = deployment
        self._fresh = fresh
        self._more_groups = more_groups
        self._stop = stop
        self._step_record = step_record
        self._say = say
        self._retry_failed = retry_failed
        self._metrics: TrainerMetrics | None = None
        self._batches: asyncio.Queue[TrainBatch | object] = asyncio.Queue()
        self._trainer: asyncio.Future[Trainer] | None = None
        self._job: asyncio.Task[RunSummary] | None = None
        self._pending: TrainBatch | None = None

    # --- the run ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Lock the workdir, resume (or start), bring the servers up: back once batches
        can be pulled. A run that cannot start raises here (one-line errors)."""
        loop = asyncio.get_running_loop()
        self._trainer = loop.create_future()
        self._job = asyncio.create_task(self._run(self._drive_with(drive_quietly)))
        started = asyncio.ensure_future(asyncio.shield(self._trainer))
        either: set[asyncio.Future[Any]] = {started, self._job}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not self._trainer.done():
            started.cancel()
            self._job.result()  # raises why the run did not start
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leaving before the run ended stops it (the latest snapshot is where a rerun
        resumes); the servers this run started are stopped."""
        job = self._job
        if job is None:
            return
        if not job.done():
            job.cancel()
        # asyncio.wait, not ``await job`` under suppress(CancelledError): a cancel of the
        # caller while the run stops must reach the caller (rollpoint.common.background says why).
        await asyncio.wait({job})
        error = None if job.cancelled() else job.exception()
        if exc is None and error is not None:
            raise error

    @property
    def resumed_from(self) -> str | None:
        """The snapshot this run continues (None: a fresh start)."""
        restored = self._started().restored
        return None if restored is None else restored.snapshot_id

    @property
    def resumed_step(self) -> int:
        """The train step the run resumed at: the weights to load are that step's (0: none)."""
        restored = self._started().restored
        return 0 if restored is None else restored.checkpoint.step

    @property
    def resumed_state(self) -> JsonValue:
        """The state your trainer handed over with :attr:`resumed_step`'s batch
        (``batch.done(state=...)``, or the last one given before it); None on a fresh
        start or when none was given."""
        restored = self._started().restored
        return None if restored is None else restored.checkpoint.trainer_state

    @property
    def continued(self) -> int:
        """How many episodes the restore continued at their last completed turn."""
        restored = self._started().restored
        return 0 if restored is None else len(restored.continued)

    def progress(self) -> RunProgress:
        """Where the run stands now (cheap enough to poll a few times a second)."""
        trainer = self._started()
        stats = trainer.stats
        ledger = trainer.ledger
        return RunProgress(
            episodes_total=sum(len(ledger.group_records(g)) for g in ledger.group_ids()),
            episodes_finished=stats.episodes_finished,
            in_flight=stats.in_flight,
            turns=stats.turns,
            reward_mean=stats.reward_mean,
            train_steps=stats.train_steps,
            last_pause_s=None if self._metrics is None else self._metrics.last_pause_s,
            policy_version=trainer.policy_version,
            lag_holds=trainer.lag.holds,
            stale_resent=trainer.stale_resent,
            stale_marked=trainer.stale_marked,
        )

    async def batches(self) -> AsyncIterator[TrainBatch]:
        """Each train step's batch, until every prompt group is trained (or failed). A
        batch not yet :meth:`~TrainBatch.done` when the next is asked for is done then.
        Once the run's ``stop`` is asked (a signal), no batch is handed out: the loop ends
        and :meth:`summary` raises how the run stopped (a batch the final snapshot did not
        see trained would be trained again by the rerun, so it is not trained now)."""
        while True:
            if self._pending is not None:
                self._pending.done()
                self._pending = None
            item = await self._next_or_stop()
            if item is END_OF_RUN:
                return
            assert isinstance(item, TrainBatch)
            self._pending = item
            yield item

    async def _next_or_stop(self) -> TrainBatch | object:
        """The next batch, or :data:`END_OF_RUN` once the run ended or its stop was asked."""
        if self._stop is None:
            return await self._batches.get()
        if self._stop.asked.is_set():
            return END_OF_RUN
        get = asyncio.ensure_future(self._batches.get())
        asked = asyncio.ensure_future(self._stop.asked.wait())
        try:
            await asyncio.wait({get, asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (get, asked):
                waiter.cancel()
        if self._stop.asked.is_set():
            return END_OF_RUN  # a batch taken meanwhile stays in TQ, uncommitted: the rerun's
        return get.result()

    async def add_groups(self, tasks: Iterable[TaskRow]) -> list[str]:
        """Add one prompt group (``group_size`` rows) per task, sent after those before it;
        returns the ids of the groups added. Needs ``more_groups=True``. A task whose group
        the run already has (added before, or restored from the snapshot) is skipped: a
        trainer resumed from a snapshot adds its stream again from its own cursor (keep it
        in ``batch.done(state=...)``), and only what the snapshot lacks is added. Tasks for
        another environment, repeated task ids, or a known task id with other contents
        are refused whole, in one line (``BadRequestError``)."""
        rows = list(tasks)
        check_environment(self.settings.environment, rows, "rollouts.add_groups", BadRequestError)
        return self._started().add_groups(rows)

    async def end_groups(self) -> None:
        """No more groups will be added: :meth:`batches` ends once those the run has are
        trained. Idempotent."""
        self._started().end_groups()

    async def mark_durable(self, step: int) -> None:
        """Your weights of ``step`` (done with ``durable=False``) are saved for good now:
        rollpoint writes that step's checkpoint as it stood, releases the rows it covered
        and takes a snapshot. Earlier steps never marked are passed over (this one covers
        them); a step already durable is a no-op; a step not trained, or not waiting, is a
        one-line ``BadRequestError``."""
        await self._started().mark_durable(step)

    async def weights_live(self, version: int) -> None:
        """Policy version ``version`` is live on the engines from now on: every policy call
        that starts after this is stamped with it, and a call still decoding carries a
        segment of each version. Your first call ends rollpoint's own count (one version
        per train step). Versions only go up (an older one is a ``BadRequestError``). Use
        it when your weight push pauses the engines itself; :meth:`weight_update` pauses
        them for you. See docs/trainers.md, "Policy versions"."""
        await self._started().weights_live(version)

    @asynccontextmanager
    async def weight_update(self, version: int, mode: PauseMode = "keep") -> AsyncIterator[None]:
        """``async with run.weight_update(v, mode="keep"):`` push your weights inside.

        On entry every engine is paused through its own route (vLLM's ``/pause``, SGLang's
        ``/pause_generation``) in ``mode``: ``keep`` (calls in flight freeze and go on under
        the new weights, two segments), ``wait`` (they finish first) or ``abort`` (they
        end, and are sent again after the update); an engine without a pause route is
        drained. On leaving, ``version`` is live (as :meth:`weights_live`) and the engines
        resume. No snapshot runs inside: each one is before the update or after it. A block
        that raises resumes the engines under the version they had."""
        async with self._started().weight_update(version, mode):
            yield

    async def snapshot(self) -> SaveReport:
        """Take one snapshot now (besides those ``snapshot.every_seconds`` takes)."""
        coordinator = self._started().coordinator
        if coordinator is None:
            raise InvalidPhaseError("rollouts: this run has no control plane to snapshot")
        return await coordinator.save()

    async def replica_down(self, name: str) -> None:
        """Replica ``name``'s servers are gone (your scheduler saw them die, or took their
        node): stop sending to it. The tries the latest snapshot saved there wait for
        :meth:`replica_up`; the rest of what it held goes fresh to the replicas still up,
        and snapshots go on without it. Servers this run started are watched for you; on
        ``rollpoint serve`` servers only you can tell. Idempotent."""
        trainer = self._started()
        _known(trainer, name, "replica_down")
        await trainer.replica_down(name)

    async def replica_up(self, endpoints: ReplicaEndpoints) -> None:
        """Replica ``endpoints.name``'s servers run again, started empty, at these URLs:
        the tries held for it are restored there from the snapshot that saved them, and it
        takes rows and part in snapshots again."""
        trainer = self._started()
        _known(trainer, endpoints.name, "replica_up")
        await trainer.replica_up(endpoints)

    async def summary(self) -> RunSummary:
        """The run's end: wait for it (every batch pulled and done) and return its figures."""
        if self._job is None:
            raise InvalidPhaseError("rollouts: the run was never opened (use async with)")
        return await self._job

    # --- underneath -------------------------------------------------------------------

    def _started(self) -> Trainer:
        if self._trainer is None or not self._trainer.done():
            raise InvalidPhaseError("rollouts: the run is not open (use async with)")
        return self._trainer.result()

    async def _run(self, drive: Drive) -> RunSummary:
        try:
            return await run_job(
                self.settings,
                fresh=self._fresh,
                say=self._say,
                drive=drive,
                hooks=self,
                attach=self._deployment,
                more_groups=self._more_groups,
                stop=self._stop,
                step_record=self._step_record,
                retry_failed=self._retry_failed,
            )
        finally:
            self._batches.put_nowait(END_OF_RUN)

    def _drive_with(self, drive: Drive) -> Drive:
        async def noted(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
            assert self._trainer is not None
            self._metrics = metrics
            self._trainer.set_result(trainer)
            return await drive(trainer, runtime, metrics)

        return noted

    async def train_step(
        self, step: int, batch: list[TrainSample]
    ) -> dict[str, float] | StepResult:
        """The trainer loop's hook: hand the batch out, wait for it to be done."""
        reply: asyncio.Future[dict[str, float] | StepResult]
        reply = asyncio.get_running_loop().create_future()
        await self._batches.put(TrainBatch(step, batch, reply))
        return await reply


def _known(trainer: Trainer, name: str, call: str) -> None:
    if name not in trainer.roster:
        known = ", ".join(trainer.roster.names)
        raise ConfigError(f"rollouts.{call}: no replica {name!r} in this run (it has {known})")
