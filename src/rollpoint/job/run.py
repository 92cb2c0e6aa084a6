"""One job, start to finish: what ``rollpoint run`` does, on the runtime its settings name.

Owns the order of a run: lock the workdir (one writer), pick the snapshot to resume from
(starting over only on a workdir that holds no progress: train data or checkpoints with no
usable snapshot are refused with one line, never deleted), check the snapshot's config keys
and the train data against this run's, start the servers, restore, run the trainer with the
replica supervisor beside it, and stop everything on every exit path. It reads no run
config: it is told what it needs (:class:`~rollpoint.job.settings.JobSettings`). It owns no
display: callers pass ``say`` for messages and ``drive`` to watch the trainer (the CLI
draws progress; chaos trials do not), and may reroute the deployment and change each
server's spec before it starts (chaos trials put fault proxies in those paths and skew
clocks).

It is the trainer process's entry point (``rollpoint run``, the
:class:`~rollpoint.rollouts.Rollouts` façade, chaos trials): it installs the performance
tricks on the checkpoint seam (:func:`rollpoint.tuning.install`) once, so the coordinator's
pauses are heard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollpoint.http.client import HttpClient
from rollpoint.job.deployment_check import check_deployment
from rollpoint.job.finished_run import finished_summary
from rollpoint.job.journal_status import journal_pending, journal_read_back, pin_to_journals
from rollpoint.job.settings import JobSettings
from rollpoint.job.start_checks import check_store_writable, check_workdir_writable, unreadable
from rollpoint.job.tasks import load_tasks_for
from rollpoint.preemption import StopRequest, drive_until_stopped
from rollpoint.protocol.deployment import Deployment, ServedDeployment
from rollpoint.protocol.errors import (
    BadRequestError,
    ConfigError,
    RestoreError,
)
from rollpoint.runtime.attached import AttachedRuntime
from rollpoint.runtime.contract import Runtime, runtime_for
from rollpoint.runtime.replica_plan import SpecHook
from rollpoint.store.job_identity import (
    FINGERPRINT_KEY,
    JOB_FILE,
    check_store_snapshots,
    claim_job,
    stamp_store,
)
from rollpoint.store.lock_watch import while_locked
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.workdir_lock import LOCK_NAME, check_lock, lock_workdir
from rollpoint.trainer.control.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.restore_checks import check_config
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import Skipped, find_resume_point
from rollpoint.trainer.run_events import (
    EVENTS_FILE,
    Restore,
    RunEnd,
    RunStart,
    without_secrets,
)
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import TrainHooks
from rollpoint.trainer.trainer import RunSummary, Trainer
from rollpoint.tuning import install as install_tuning

log = logging.getLogger(__name__)

Drive = Callable[[Trainer, Runtime, TrainerMetrics], Awaitable[RunSummary]]
Route = Callable[[Deployment], Awaitable[Deployment]]


def prepare_workdir(workdir: Path, *, fresh: bool, force: bool) -> None:
    """Lock the workdir for this process (one writer: a second run is refused before it
    touches anything), then --fresh starts over: on an empty workdir, or with --force on
    a used one (everything but the lock goes)."""
    # A folder some run of rollpoint made holds its lock file (made at a run's start) or
    # its job identity: looked for before this run makes its own lock file.
    ours = (workdir / LOCK_NAME).exists() or (workdir / JOB_FILE).exists()
    lock = lock_workdir(workdir)
    # The lock and the job's identity stay: the same job starts over (job_identity).
    contents = [p for p in workdir.iterdir() if p.name not in (lock.path.name, JOB_FILE)]
    if fresh and contents:
        if not force:
            raise ConfigError(f"workdir {workdir} is not empty; --fresh needs --force to delete it")
        if not ours:
            raise ConfigError(
                f"workdir {workdir} is not a rollpoint workdir (no {LOCK_NAME}) and is not "
                "empty: --fresh --force deletes only a rollpoint workdir's files; point "
                "workdir at an empty or new folder"
            )
        for path in contents:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    check_workdir_writable(workdir)


def refuse_unresumable_run(
    workdir: Path, record: StepRecord, root: str, skipped: list[Skipped]
) -> None:
    """No usable snapshot: a fresh start is the default only for a run whose record holds
    no progress; anything else is refused with what was found and the two ways out."""
    found = record.progress()
    if not found:
        return
    if skipped:
        shown = "; ".join(f"{s.snapshot_id}: {_clip(s.reason)}" for s in skipped[:_SHOWN])
        more = f" (and {len(skipped) - _SHOWN} more)" if len(skipped) > _SHOWN else ""
        why = f"every snapshot in {root} is unusable: {shown}{more}"
    else:
        why = f"no snapshot in {root}"
    raise RestoreError(
        f"{workdir} holds progress ({'; '.join(found)}) but {why}; nothing was deleted: "
        "fix the snapshot store (put the snapshot folders back, or point snapshot.store at "
        "them), or start over with --fresh --force (deletes this progress)"
    )


_SHOWN = 3
_CLIP = 200


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _CLIP else line[: _CLIP - 1] + "…"


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


async def drive_quietly(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
    """Run the trainer with the replica supervisor beside it; the first error stops both."""
    job = asyncio.create_task(trainer.run())
    # A replica whose process dies is restarted; the trainer restores the episodes the latest
    # snapshot saved there onto it and re-sends the rest of its rows elsewhere.
    watch = asyncio.create_task(runtime.supervise(trainer.replica_down, trainer.replica_up))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not job.done():
            watch.result()  # the policy died: raise why
        return await job
    finally:
        for task in (job, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(job, watch, return_exceptions=True)


async def run_job(
    settings: JobSettings,
    *,
    fresh: bool,
    hooks: TrainHooks,
    say: Callable[[str], None] = log.info,
    drive: Drive = drive_quietly,
    route: Route | None = None,
    spec_hook: SpecHook | None = None,
    data_token: str | None = None,
    stop: StopRequest | None = None,
    attach: ServedDeployment | None = None,
    more_groups: bool = False,
    step_record: StepRecord | None = None,
    retry_failed: bool = False,
) -> RunSummary:
    """``data_token`` guards the servers' data routes (one is made when None); a caller that
    talks to the servers itself (a benchmark reading their stats) passes its own. With
    ``stop`` a signal ends the run after one final snapshot (see :mod:`rollpoint.preemption`).
    ``hooks`` update the policy (the caller's: the façade's, or the built-in loop's
    simulated update a chaos trial or a benchmark passes; the job has no default). With ``attach`` the job
    starts no servers: it runs on those ``rollpoint serve`` printed, with their tokens, and
    leaves them running when it ends. ``more_groups``: the trainer takes groups added while
    it runs (:meth:`Trainer.add_groups`), and the settings' tasks may be none. ``step_record``:
    the trainer's record of its steps, where a resume looks for durable steps (default:
    rollpoint's, ``train_data.jsonl`` and ``checkpoints/`` in the workdir). ``retry_failed``:
    the resumed run's failed groups are sent again under new group ids (nothing trained is
    trained again)."""
    if retry_failed and fresh:
        raise ConfigError("--retry-failed resumes a run's failed groups; it cannot go with --fresh")
    lock_workdir(settings.workdir)  # held already when the CLI prepared the workdir
    check_lock(settings.workdir)  # and its lock file is still the file it locked
    # From here to the end the lock is checked as the job goes: a lock file deleted by hand
    # is taken again, or the job stops (rollpoint.store.lock_watch).
    return await while_locked(
        settings.workdir,
        _locked_job(
            settings,
            fresh=fresh,
            say=say,
            drive=drive,
            route=route,
            spec_hook=spec_hook,
            data_token=data_token,
            stop=stop,
            hooks=hooks,
            attach=attach,
            more_groups=more_groups,
            step_record=step_record,
            retry_failed=retry_failed,
        ),
    )


async def _locked_job(
    settings: JobSettings,
    *,
    fresh: bool,
    say: Callable[[str], None],
    drive: Drive,
    route: Route | None,
    spec_hook: SpecHook | None,
    data_token: str | None,
    stop: StopRequest | None,
    hooks: TrainHooks,
    attach: ServedDeployment | None,
    more_groups: bool,
    step_record: StepRecord | None,
    retry_failed: bool,
) -> RunSummary:
    install_tuning()  # the trainer's entry point (idempotent: a second job adds nothing)
    tasks = load_tasks_for(settings)
    if not tasks and not more_groups:
        raise ConfigError(
            "tasks: 0 gives the run nothing to train (a run that is handed its groups "
            "while it runs opens them with Rollouts(..., more_groups=True))"
        )
    root = settings.snapshot_root()
    if attach is None:
        token: str | None = secrets.token_urlsafe(32)
        # The data plane has a token of its own: whoever can call /run cannot snapshot or restore.
        data_token = data_token or secrets.token_urlsafe(32)
    else:
        if attach.snapshot_store is not None and attach.snapshot_store != root:
            raise ConfigError(
                f"snapshot.store: the servers write snapshots to {attach.snapshot_store}, "
                f"this run to {root}; set snapshot.store to {attach.snapshot_store}"
            )
        token = _read_token(attach.control_token_file)
        data_token = None if attach.data_token_file is None else _read_token(attach.data_token_file)
    await asyncio.to_thread(check_store_writable, root)  # before any server starts
    record = step_record or WorkdirRecord(settings.workdir)
    try:
        # Before the store is opened (that cleans a crash's leftovers): one job per store.
        job = await asyncio.to_thread(claim_job, settings.workdir, root)
        store = await asyncio.to_thread(
            SnapshotStore, root, settings.snapshot_keep, clean_leftovers=False
        )
        store.job_id = job.job_id
        others = await asyncio.to_thread(store.other_jobs)
        check_store_snapshots(root, others, job)
        await asyncio.to_thread(store.clean_leftovers)
        point, skipped = (
            (None, []) if fresh else await asyncio.to_thread(find_resume_point, store, record)
        )
    except OSError as exc:
        raise unreadable(exc, "the snapshot store") from None
    except BadRequestError as exc:
        # The contained filesystem's refusal: a symlink inside the store is never followed.
        raise ConfigError(f"cannot read the snapshot store {root}: {exc.message}") from None
    fingerprint = {**settings.fingerprint(), FINGERPRINT_KEY: job.job_id}
    for item in skipped:
        # A warning reaches the console as well as rollpoint.log (the CLI's warning handler):
        # a skipped snapshot is progress given up.
        log.warning("%s", item.line())
    if point is None and fresh:
        if record.progress():
            raise ConfigError(
                f"workdir {settings.workdir} holds progress; starting over needs --fresh --force"
            )
    elif point is None:
        refuse_unresumable_run(settings.workdir, record, root, skipped)
    else:
        check_config(point.manifest, fingerprint)
        # Before any server starts: a record that does not hold what its checkpoint
        # covers (train data edited or cut short) is refused here, naming the file, and
        # left as it is. The restorer checks it again: the same record, read once.
        await asyncio.to_thread(record.check, point.checkpoint)
        if not retry_failed and not more_groups:
            events_path = settings.workdir / EVENTS_FILE
            ended = await asyncio.to_thread(finished_summary, events_path, point)
            if ended is not None:
                failed = len(ended.failed_groups)
                say(
                    f"the run in {settings.workdir} has finished already, at train step "
                    f"{ended.train_steps}"
                    + (
                        f" with {failed} failed groups (--retry-failed sends them again)"
                        if failed
                        else ""
                    )
                    + "; no server was started (--fresh --force starts it over)"
                )
                return ended
    await asyncio.to_thread(stamp_store, root, job)  # the snapshots found are this job's
    metrics = TrainerMetrics(settings.workdir / "metrics.jsonl", settings.workdir / EVENTS_FILE)
    events = metrics.run_events
    if attach is not None and spec_hook is not None:
        raise ConfigError("an attached run starts no servers: it has no specs to hook")
    runtime: Runtime = (
        runtime_for(
            settings.runtime,
            control_token=token,
            data_token=data_token,
            snapshot_root=root,
            spec_hook=spec_hook,
        )
        if attach is None
        else AttachedRuntime(settings.runtime, attach.deployment())
    )
    control_http = HttpClient(token=token, timeout_s=60)
    data_http = HttpClient(token=data_token)
    try:
        deployment = await runtime.start()
        if route is not None:
            deployment = await route(deployment)
        await check_deployment(settings.runtime, deployment, data_http, attached=attach is not None)
        port = metrics.serve(settings.metrics_host, settings.metrics_port)
        say(
            f"servers up: {settings.runtime.replicas} replica(s) on the {settings.runtime.runtime} "
            "runtime, "
            f"policy at {deployment.policy_url}; "
            f"metrics at http://{settings.metrics_host}:{port}/metrics"
        )
        control = ControlPlane(participant_clients(deployment, control_http), store, metrics)
        events.append(
            RunStart(
                ts=time.time(),
                pid=os.getpid(),
                runtime=settings.runtime.runtime,
                replicas=[r.name for r in deployment.replicas],
                resume_from=None if point is None else point.manifest.snapshot_id,
                config=without_secrets(settings.recorded()),
            )
        )
        restored = None
        if point is not None:
            say(f"restoring snapshot {point.manifest.snapshot_id}")
            try:
                restored = await Restorer(control.participants).restore(
                    point,
                    step_record=record,
                    continue_episodes=settings.continue_episodes,
                )
            except OSError as exc:
                raise unreadable(exc, f"restoring snapshot {point.manifest.snapshot_id}") from None
            continued = {(e.rollout_id, e.attempt) for e in restored.continued}
            turns_kept = sum(
                e.turns_completed
                for e in point.manifest.episodes
                if (e.rollout_id, e.attempt + 1) in continued
            )
            pending = await journal_pending(control.participants)
            read_back = await journal_read_back(control.participants)
            journaled = (
                None if pending is None else (sum(pending[0].values()), sum(pending[1].values()))
            )
            if settings.trainer.journaled:
                pinned = await pin_to_journals(restored.ledger, deployment, data_http)
                if pinned:
                    log.info("%d queued rows go back to the replica holding their journal", pinned)
            say(
                f"resumed from snapshot {restored.snapshot_id} at train step {restored.checkpoint.step}: "
                f"{len(restored.continued)} episodes continued, {restored.restarted} restarted, "
                f"{restored.adopted} finished replies adopted, {restored.tq_requeued} finished-queue items requeued"
                + (
                    f", {restored.resent} sent again to continue from their journals"
                    if restored.resent
                    else ""
                )
                + "; "
                f"turns: {turns_kept} continued from the snapshot"
                + (
                    ""
                    if journaled is None
                    else f", {journaled[0]} replayed from the journal "
                    f"(and {journaled[1]} journaled finished replies to adopt)"
                )
            )
            events.append(
                Restore(
                    ts=time.time(),
                    snapshot_id=restored.snapshot_id,
                    train_step=restored.checkpoint.step,
                    continued=len(restored.continued),
                    restarted=restored.restarted,
                    adopted=restored.adopted,
                    requeued=restored.tq_requeued,
                    turns_kept=turns_kept,
                    snapshot_pause_ended_at=point.manifest.created_at
                    + point.manifest.pause_seconds,
                    snapshot_pause_s=point.manifest.pause_seconds,
                    journal_turns=None if pending is None else pending[0],
                    journal_replies=None if pending is None else pending[1],
                    journal_read_ms=read_back,
                )
            )
        told = dataclasses.replace(settings.trainer, fingerprint=fingerprint)
        if retry_failed:
            told = dataclasses.replace(told, retry_failed=True)
        trainer = Trainer(
            told,
            deployment,
            tasks,
            hooks=hooks,
            client=data_http,
            control=control,
            restored=restored,
            step_record=record,
            more_groups=more_groups,
        )
        if trainer.retried:
            say(
                f"retrying {len(trainer.retried)} failed groups under new ids: "
                + ", ".join(f"{old} as {new}" for old, new in list(trainer.retried.items())[:5])
                + (" …" if len(trainer.retried) > 5 else "")
            )
        elif retry_failed:
            say("--retry-failed: the resumed run has no failed groups to retry")
        if stop is None:
            summary = await drive(trainer, runtime, metrics)
        else:
            summary = await drive_until_stopped(
                drive(trainer, runtime, metrics),
                trainer,
                stop,
                grace_s=settings.grace_seconds,
                previous=None if point is None else point.manifest.snapshot_id,
            )
        events.append(
            RunEnd(
                ts=time.time(),
                episodes=summary.episodes,
                train_steps=summary.train_steps,
                failed_groups=len(summary.failed_groups),
                elapsed_s=summary.elapsed_s,
            )
        )
        return summary
    finally:
        await control_http.aclose()
        await data_http.aclose()
        metrics.close()
        await runtime.stop()
