"""The snapshot coordinator: one consistent cut across the trainer and every replica.

Owns the save order (docs/design.md#the-save-order) and counts failed saves against the
failure budget. A save:

1. closes the dispatch barrier (the pause clock starts);
2. prepares every participant of every up replica in stages — model servers (admission
   closes, so agents waiting on a policy call reach a boundary), then agents (sessions
   park at boundaries), then resources (tool calls freeze) — against one shared deadline,
   while a background task renews every lease;
3. on any failure or a missed deadline resumes everyone exactly once (the abort) and
   counts one failed snapshot; three in a row stop the run, naming what blocked each;
4. captures the ledger, the finished queue and the trainer's counters in one instant, then commits every
   participant in parallel, each replica's scope being the ledger's in-flight episodes on
   it minus the restarts its participants reported;
5. does not drain: finished replies still on the wire are held by their agent and
   exported with its sessions (they are listed as ``finished`` in the manifest);
6. checks the cut: every in-flight episode is on a replica that committed;
7. resumes everyone (reverse stages) and reopens the barrier (the pause ends);
8. sorts each in-flight try into saved, finished or restart by its agent's ``exported``;
   writes the trainer's files while each participant writes what it captured (a commit to
   a participant listing ``detached-write`` replies once its state is captured, so encoding,
   hashing and writing run after the pause), confirms every participant's write (a confirm
   lost on the wire is sent once more: it is idempotent), and publishes the manifest last.
   A write that fails fails the save: nothing is published.

**Pause-free saves** (``snapshot.mode: journal``, docs/design.md "Pause-free snapshots";
periodic saves only, and only when every participant journals: otherwise the cut above):
no barrier, no prepare, no admission closed anywhere. Every participant checkpoints at once
from its journal, then the trainer captures
(:mod:`rollpoint.trainer.snapshot.journal_save`, which says why in that order), and the
trainer's files are written and the manifest published as after a cut.

**Finished replies nobody will seal** (strays, see :mod:`rollpoint.trainer.dispatch.stray_replies`)
are acked away on their agents once the pause is over, whatever became of the save.

**Replicas that are down** (see :class:`~rollpoint.trainer.control.replica_roster.ReplicaRoster`)
take no part: snapshots keep committing with the replicas that are up, and a manifest names
only the participants that committed. A replica that comes back is asked who it is at the
next save and takes part from then on.

It does not own when snapshots happen (the trainer loop decides) nor the files' layout
(:mod:`rollpoint.store`). Its parts: the stage order and the shared deadline of the calls
(:mod:`rollpoint.trainer.snapshot.control_calls`), who each participant is
(:mod:`rollpoint.trainer.snapshot.participant_statuses`), the prepare, the lease renewal and
the commit of a cut (:mod:`rollpoint.trainer.snapshot.cut_calls`), what a save captured and
the sorting of its tries (:mod:`rollpoint.trainer.snapshot.cut`), the pause-free save
(:mod:`rollpoint.trainer.snapshot.journal_save`), the writes after the pause and the
manifest (:mod:`rollpoint.trainer.snapshot.publication`), the resume
(:mod:`rollpoint.trainer.snapshot.resumer`), the strays
(:mod:`rollpoint.trainer.dispatch.stray_replies`) and when failed saves stop the run
(:mod:`rollpoint.trainer.snapshot.failure_budget`). Nor any performance trick: it tells the
checkpoint seam (:mod:`rollpoint.tuning.seam`) when a pause holds the trainer and when it
ends, and the listeners the entry point installed act on that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import JsonValue

from rollpoint.common.background import stop_task
from rollpoint.protocol.control import JOURNAL, StatusReply, Verb
from rollpoint.protocol.errors import RollpointError, SnapshotError, TransportError
from rollpoint.protocol.manifest import ParticipantEntry, SnapshotManifest
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.staging import Staging
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.stray_replies import REPLY_HOLDING_STATES, ack_strays
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.control_calls import PREPARE_STAGES, blocker
from rollpoint.trainer.snapshot.cut import (
    Blocker,
    Cut,
    Prepared,
    SaveBlocked,
    SavePhase,
    SaveReport,
)
from rollpoint.trainer.snapshot.cut_calls import CutCalls
from rollpoint.trainer.snapshot.failure_budget import (
    MAX_FAILED_IN_A_ROW,
    FailureBudget,
    stop_message,
    storage_fault,
)
from rollpoint.trainer.snapshot.journal_floors import JournalFloors
from rollpoint.trainer.snapshot.journal_save import JournalSave
from rollpoint.trainer.snapshot.participant_statuses import ParticipantStatuses
from rollpoint.trainer.snapshot.publication import (
    FINISHED_QUEUE_FILE,
    LEDGER_FILE,
    TRAINER_FILE,
    Publication,
)
from rollpoint.trainer.snapshot.resumer import Resumer
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.tuning import seam

__all__ = [
    "FINISHED_QUEUE_FILE",
    "HISTORY_KEEP",
    "LEDGER_FILE",
    "MAX_FAILED_IN_A_ROW",
    "PREPARE_STAGES",
    "REPLY_HOLDING_STATES",
    "TRAINER_FILE",
    "SaveReport",
    "SnapshotCoordinator",
    "stop_message",
    "storage_fault",
]

log = logging.getLogger(__name__)

HISTORY_KEEP = 64
"""Save reports :attr:`SnapshotCoordinator.history` keeps: the newest (each holds its
snapshot's manifest, tens of KB; kept all, one per train step and per period, they were the
trainer's growth with rows trained in the soak, issue 33)."""

_DISCOVER_RETRY_S = 0.2


class SnapshotCoordinator:
    def __init__(
        self,
        participants: Sequence[ParticipantClient] | ReplicaRoster,
        *,
        store: SnapshotStore,
        ledger: RecoveryLedger,
        finished_queue: FinishedQueue,
        barrier: DispatchBarrier,
        config: SaveSettings,
        metrics: TrainerMetrics,
        trainer_state: Callable[[], dict[str, Any]],
        config_fingerprint: dict[str, JsonValue],
    ) -> None:
        self.roster = (
            participants
            if isinstance(participants, ReplicaRoster)
            else ReplicaRoster.of_participants(participants)
        )
        self.store = store
        self.ledger = ledger
        self.finished_queue = finished_queue
        self.barrier = barrier
        self.config = config
        self.metrics = metrics
        self._statuses = ParticipantStatuses()
        self._budget = FailureBudget()
        self._lock = asyncio.Lock()
        self._sequence = 0
        self._resumer = Resumer()
        self.floors = JournalFloors()
        """The journal marks a journal-mode save names (``snapshot.mode: journal``)."""
        self._cut_calls = CutCalls(
            ledger=ledger,
            finished_queue=finished_queue,
            trainer_state=trainer_state,
            statuses=self._statuses,
        )
        self._journal = JournalSave(
            store=store,
            ledger=ledger,
            finished_queue=finished_queue,
            trainer_state=trainer_state,
            floors=self.floors,
        )
        self._publication = Publication(store, self._statuses, config_fingerprint)
        self._cut_instead: set[str] = set()
        """Participants that made a journal-mode save take the cut (warned once each)."""
        self._final_asked = False
        """A final save was asked: no other save starts after it (a stop is a stop)."""
        self._restored_from: str | None = None
        self.history: list[SaveReport] = []
        """The newest save reports, oldest first: at least :data:`HISTORY_KEEP` and at most
        twice that (older ones are dropped in blocks). :attr:`saves` counts every report."""
        self.saves = 0
        """Save reports made since this coordinator was built (published or not)."""
        self.published_total = 0
        """Snapshots published since this coordinator was built."""
        self.published_with_episodes = 0
        """Published snapshots that saved at least one episode (or, in journal mode,
        listed at least one try in flight as journaled)."""
        self._latest_published: SnapshotManifest | None = None
        self._publishing: asyncio.Future[SnapshotManifest] | None = None
        """The publication thread of the save under way, if it has reached that step."""
        self.before_save: Callable[[], Awaitable[None]] | None = None
        """Runs before the barrier closes (the trainer flushes retires and forgets: step 1 of
        docs/design.md#the-save-order)."""
        self.before_capture: Callable[[], Awaitable[None]] | None = None
        """Awaited right before the trainer's capture, once every participant checkpointed
        (journal mode) or prepared (the cut: admission is closed everywhere then). Nothing
        in rollpoint sets it: it is where a test watches what the servers do meanwhile."""

    def hold_until_published(self, snapshot_id: str) -> None:
        """Keep ``snapshot_id``, the snapshot this run restored, through retention (pinned,
        with the train checkpoint it composes with) until this coordinator publishes a
        snapshot of its own. Until then it is the only one this run's line composes with:
        the newer snapshots a restore skipped as damaged still count as the newest to
        retention, and a rerun whose saves all failed while it trained on had the
        checkpoint of the snapshot it restored deleted, and the next rerun was refused
        (chaos, a journal-mode campaign: ``pack_damage``, then a ``participant_restart``
        failing every save)."""
        self.store.pin(snapshot_id)
        self._restored_from = snapshot_id

    @property
    def saving(self) -> bool:
        """True while a save is in progress (barrier closed or files being published)."""
        return self._lock.locked()

    @property
    def final_asked(self) -> bool:
        """True once the run's final save was asked (a stop): no other save is taken."""
        return self._final_asked

    @property
    def latest_published(self) -> SnapshotManifest | None:
        """The newest snapshot this coordinator published, if any."""
        # Also a publication whose save was cancelled once its thread was writing (a stop
        # during a periodic save): the thread finished it, the save never recorded it.
        return self._publication.newest or self._latest_published

    async def publication_settled(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for a publication already writing to finish.

        A thread writes a publication and cannot be cancelled; the process waits for it at
        exit anyway. A stop that names the snapshot holding the run waits here first, so it
        names the one the thread publishes (a periodic save caught by the signal mid-write).
        """
        publishing = self._publishing
        if publishing is None or publishing.done():
            return
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(publishing), timeout_s)

    def reports_since(self, saves: int) -> list[SaveReport]:
        """The reports made after the first ``saves`` (a value :attr:`saves` had), oldest
        first; those dropped from the history since are left out."""
        newer = self.saves - saves
        return self.history[-newer:] if newer > 0 else []

    def remember(self, report: SaveReport) -> None:
        """Keep ``report`` as the newest save (every save calls it; a test may too)."""
        self.history.append(report)
        self.saves += 1
        if report.published:
            self._latest_published = report.manifest
            self.published_total += 1
            self.published_with_episodes += report.saved > 0 or report.journaled > 0
        if len(self.history) >= 2 * HISTORY_KEEP:
            del self.history[:-HISTORY_KEEP]

    @contextlib.asynccontextmanager
    async def holding_saves(self) -> AsyncIterator[None]:
        """No save runs inside (one in progress finishes first): a replica restore holds
        it, so no cut sees the replica's participants or its tries half restored."""
        async with self._lock:
            yield

    @property
    def participants(self) -> list[ParticipantClient]:
        """The participants of every replica that is up now."""
        return self.roster.participants()

    # --- setup -------------------------------------------------------------------------

    async def discover(self) -> list[StatusReply]:
        """Ask every participant who it is; refuse restart-only servers unless allowed."""
        # A participant cut off for a moment as the run starts must not end it: retry
        # until the snapshot deadline, as a save would wait for it. The live set is read
        # again on every try: a replica that dies meanwhile is dropped by the runtime (and
        # its successor discovered by the first save), not waited for at its old address.
        give_up_at = time.monotonic() + self.config.deadline_seconds
        while True:
            clients = self.participants
            try:
                await self._discover(clients)
                return [self._statuses[c] for c in clients]
            except SaveBlocked as exc:
                if time.monotonic() >= give_up_at:
                    raise SnapshotError(str(exc)) from None
                await asyncio.sleep(_DISCOVER_RETRY_S)

    async def _discover(self, clients: list[ParticipantClient]) -> None:
        await self._statuses.ask(clients, allow_restart_only=self.config.allow_restart_only)

    def participant_entries(
        self, clients: list[ParticipantClient] | None = None
    ) -> list[ParticipantEntry]:
        """Manifest entries of ``clients`` (default: every up participant), once discovered."""
        return self._statuses.entries(self.participants if clients is None else clients)

    def fingerprint(self, clients: list[ParticipantClient] | None = None) -> str:
        return self._statuses.fingerprint(self.participants if clients is None else clients)

    # --- save --------------------------------------------------------------------------

    async def save(self, *, final: bool = False, drain_s: float = 0.0) -> SaveReport:
        """Take one snapshot. A failed one is reported (and counted); the third failure in
        a row raises :class:`SnapshotError` naming what blocked each.

        ``final``: the run stops once this save is over (preemption). A good cut does not
        resume the participants: they stay held, their leases renewed, until the snapshot
        is published, so no policy call starts after the cut only to be lost with the
        servers. A cut that fails resumes them as usual.

        ``drain_s``: once the model servers' gates are closed, wait up to this long for the
        policy calls already running to finish before the agents are asked to park, so
        their replies are applied and saved instead of made again after a restore (the
        generation cut saves a session as before a call still running).

        Once a final save was asked, any other save returns at once, untried and not
        counted (``not_taken``): a periodic save that came after it would find the
        participants held by the final cut and print "resume ... refused" for nothing."""
        if final:
            self._final_asked = True
        elif self._final_asked:
            return SaveReport(snapshot_id="", published=False, not_taken=True)
        async with self._lock:
            if not final and self._final_asked:  # it waited behind the final save
                return SaveReport(snapshot_id="", published=False, not_taken=True)
            if self.before_save is not None:
                try:
                    await self.before_save()
                except RollpointError as exc:
                    log.warning("before a snapshot: %s", exc.message)
            self._sequence += 1
            snapshot_id = f"snap-{int(time.time() * 1000)}-{self._sequence:04d}"
            report = await self._save(snapshot_id, final=final, drain_s=drain_s)
            self.remember(report)
            self.metrics.record_snapshot(
                outcome="published" if report.published else "failed",
                pause_s=report.pause_s,
                prepare_s=report.prepare_s,
                commit_s=report.commit_s,
                write_s=report.write_s,
                parked=report.saved,
                restarts=report.restarts,
                snapshot_id=snapshot_id,
                detail=report.blocked_by,
            )
            if report.published:
                self._budget.published()
                if self._restored_from is not None:
                    self.store.unpin(self._restored_from)
                    self._restored_from = None
                return report
            in_a_row = self._budget.failed(f"{snapshot_id}: {report.blocked_by}")
            log.warning(
                "snapshot %s failed (%d in a row): %s",
                snapshot_id,
                in_a_row,
                report.blocked_by,
            )
            self._budget.check(self.config.retry_after_seconds, self.store.root)
            return report

    async def _save(
        self, snapshot_id: str, *, final: bool = False, drain_s: float = 0.0
    ) -> SaveReport:
        report = SaveReport(snapshot_id=snapshot_id, published=False)
        clients = self.participants
        try:
            # A replica that came back since the last save: ask its new servers who they are.
            await self._discover([c for c in clients if c not in self._statuses])
        except SaveBlocked as exc:
            report.blockers = exc.blockers
            return report
        report.phase = SavePhase.RESUME_LEFTOVERS
        await self._resumer.resume_leftovers(self.participants)
        if self._resumer.unresumed:
            # Still closed by an earlier checkpoint and out of reach: a prepare now would
            # hold every agent at its deadline behind that participant's frozen calls.
            report.blockers = [
                Blocker(
                    label,
                    Verb.RESUME,
                    TransportError.code,
                    True,
                    f"{label} still closed by an earlier checkpoint and unreachable",
                )
                for label in sorted(self._resumer.unresumed)
            ]
            return report
        if self.config.mode == "journal" and not final:
            cutting = [c for c in clients if JOURNAL not in self._statuses[c].features]
            if not cutting:
                return await self._save_journal(snapshot_id, clients, report)
            new = sorted({c.label for c in cutting} - self._cut_instead)
            if new:
                log.warning(
                    "snapshot.mode journal: %s do(es) not journal; snapshots take the cut",
                    ", ".join(new),
                )
                self._cut_instead.update(new)
        checkpoint_id = snapshot_id
        started_at = time.time()
        self.barrier.close()
        paused_at = time.monotonic()
        # The pause holds this process too (:mod:`rollpoint.tuning.seam`): the trainer's
        # heap holds every in-flight stream and ledger record, and a full collection over
        # it (triggered by the cut's own allocations) measured ~1 s at 10k sessions.
        seam.hold(self)
        staging: Staging | None = None
        prepared = Prepared()
        renewer: asyncio.Task[None] | None = None
        cut: Cut | None = None
        try:
            deadline = time.time() + self.config.deadline_seconds
            renewer = asyncio.create_task(
                self._cut_calls.renew_leases(
                    checkpoint_id, prepared.clients, self.config.deadline_seconds
                )
            )
            t0 = time.monotonic()
            report.phase = SavePhase.PREPARE
            await self._cut_calls.prepare_all(
                clients, checkpoint_id, deadline, prepared, drain_until=time.time() + drain_s
            )
            report.prepare_s = time.monotonic() - t0
            await self._before_capture()
            report.phase = SavePhase.COMMIT
            staging = await asyncio.to_thread(self.store.begin, snapshot_id)
            t1 = time.monotonic()
            cut = await self._cut_calls.commit_all(
                clients, staging, checkpoint_id, prepared, self.config.deadline_seconds
            )
            cut.created_at = started_at
            report.commit_s = time.monotonic() - t1
        except SaveBlocked as exc:
            report.blockers = exc.blockers
        except (RollpointError, OSError) as exc:  # the store's begin, say
            report.blockers = [blocker(None, report.phase, exc)]
        except Exception as exc:  # a bug must not leave every participant closed
            log.exception("snapshot %s failed unexpectedly", snapshot_id)
            report.blockers = [blocker(None, report.phase, exc)]
        finally:
            held = final and cut is not None
            if renewer is not None and not held:
                await stop_task(renewer)
            # Resume is the abort before a publish and the reopen after a good cut: one path.
            try:
                if not held:
                    await self._resumer.resume_all(checkpoint_id, prepared.clients)
            finally:
                self.barrier.open()
                report.pause_s = time.monotonic() - paused_at
                seam.release(self)
        report.acked_away = await ack_strays(prepared.strays)
        if cut is None:
            if staging is not None:
                await asyncio.to_thread(self.store.abort, staging)
            return report
        try:
            return await self._write_and_publish(cut, prepared, report)
        finally:
            if renewer is not None and not renewer.done():
                await stop_task(renewer)  # a final save's participants were held until now

    async def _save_journal(
        self, snapshot_id: str, clients: list[ParticipantClient], report: SaveReport
    ) -> SaveReport:
        """A pause-free save (:mod:`rollpoint.trainer.snapshot.journal_save`): ``checkpoint``
        on every participant, then the trainer's capture, then the write and the publication."""
        cut = await self._journal.capture(
            snapshot_id,
            clients,
            report,
            deadline_s=self.config.deadline_seconds,
            before_capture=self._before_capture,
        )
        if cut is None:
            return report
        return await self._write_and_publish(cut, Prepared(), report)

    async def _write_and_publish(
        self, cut: Cut, prepared: Prepared, report: SaveReport
    ) -> SaveReport:
        snapshot_id = report.snapshot_id
        t2 = time.monotonic()
        try:
            report.phase = SavePhase.WRITE
            files = await self._publication.write(cut, self.config.deadline_seconds)
            report.write_s = time.monotonic() - t2
            # After the reopen, and after the confirms (a detached agent reports what it
            # exported there): sorting the cut's tries into saved, finished and restarts
            # builds a manifest entry per try (~30 ms of the pause at 10k when inside).
            cut.classify(prepared)
            report.phase = SavePhase.PUBLISH
            publishing = asyncio.ensure_future(
                asyncio.to_thread(self._publication.publish, cut, files, report.pause_s)
            )
            self._publishing = publishing
            report.manifest = await asyncio.shield(publishing)
        except (SaveBlocked, RollpointError) as exc:
            if isinstance(exc, SaveBlocked):
                report.blockers = exc.blockers
            else:
                report.blockers = [blocker(None, report.phase, exc)]
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self.store.abort, cut.staging)
            return report
        report.phase = SavePhase.PUBLISHED
        report.published = True
        report.saved, report.restarts, report.finished = (
            len(cut.episodes),
            len(cut.restarts),
            len(cut.finished),
        )
        report.journaled = len(cut.journaled)
        report.mid_call = min(prepared.awaiting_model, report.saved)
        if cut.restarts:
            log.info(
                "snapshot %s: %d in-flight episodes would start over",
                snapshot_id,
                len(cut.restarts),
            )
        return report

    async def _before_capture(self) -> None:
        if self.before_capture is not None:
            await self.before_capture()

    @property
    def damaged_records_files(self) -> int:
        """Trainer records files found damaged before a snapshot named them again."""
        return self._publication.damaged_records_files
