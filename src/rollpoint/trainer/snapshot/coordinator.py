"""The snapshot coordinator: one consistent cut across the trainer and every replica.

Owns the save order (docs/design.md#the-save-order) and the failure budget. A save:

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
no barrier, no prepare, no admission closed anywhere. Each participant is sent
``checkpoint`` at once; in one step on its loop it takes its journal position and writes a
state holding no episode, whose manifest's mark is the *floor* the coordinator chose
(:mod:`rollpoint.trainer.snapshot.journal_floors`: a position from before the first record
of every try in flight, so retention keeps all a restore may read). Once every participant
replied, the trainer captures the ledger, the finished queue and its counters in one
instant (its own position, after every participant's), every try then in flight is listed
as ``journaled``, and the trainer's files are written and the manifest published as after
a cut. Why the trainer goes last: a try sealed before its capture is in the saved ledger
and finished queue (trained once, from there; its servers' journals are never read for
it); a try in flight at its capture (even one whose reply was on the wire, or sealed a
moment after) is sent again under its own id and attempt, and its agent's journal holds
every turn and the finished reply, so it is continued or only verified again, never
sampled again; a try dispatched after a participant's position but before the capture is
in flight and all its records are after the floor. No order of a seal and a participant's
checkpoint can lose a row or train it twice, because no participant's saved state says
anything about any try: only the ledger does (I1, I2); calls made again are answered by
key from the journals, effects from their records (I3, I4 as for a crash with the journal).

**Finished replies nobody will seal** (strays, see :mod:`rollpoint.trainer.dispatch.stray_replies`)
are acked away on their agents once the pause is over, whatever became of the save.

**Replicas that are down** (see :class:`~rollpoint.trainer.control.replica_roster.ReplicaRoster`)
take no part: snapshots keep committing with the replicas that are up, and a manifest names
only the participants that committed. A replica that comes back is asked who it is at the
next save and takes part from then on.

It does not own when snapshots happen (the trainer loop decides) nor the files' layout
(:mod:`rollpoint.store`). Its parts: the stage order and the shared deadline of the calls
(:mod:`rollpoint.trainer.snapshot.control_calls`), what a save captured and the sorting of its tries
(:mod:`rollpoint.trainer.snapshot.cut`), the resume (:mod:`rollpoint.trainer.snapshot.resumer`) and the strays
(:mod:`rollpoint.trainer.dispatch.stray_replies`). Nor any performance trick: it tells the
checkpoint seam (:mod:`rollpoint.tuning.seam`) when a pause holds the trainer and when it
ends, and the listeners the entry point installed act on that.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.common.background import stop_task
from rollpoint.protocol.control import (
    DETACHED_WRITE,
    JOURNAL,
    SCOPE_KEYS,
    CommitReply,
    Phase,
    StatusReply,
    Verb,
)
from rollpoint.protocol.errors import (
    ConfigError,
    DeadlineExceededError,
    RollpointError,
    SnapshotError,
    TransportError,
)
from rollpoint.protocol.manifest import (
    FileEntry,
    JournalMark,
    ParticipantEntry,
    SnapshotManifest,
    topology_fingerprint,
)
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.store.record_packs import PackIndex
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.staging import Staging
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.control.replica_roster import ReplicaRoster
from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.stray_replies import REPLY_HOLDING_STATES, ack_strays, is_wanted
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.settings import SaveSettings
from rollpoint.trainer.snapshot.control_calls import PREPARE_STAGES, blocker, by_deadline
from rollpoint.trainer.snapshot.cut import (
    Blocker,
    Cut,
    Prepared,
    SaveBlocked,
    SavePhase,
    SaveReport,
)
from rollpoint.trainer.snapshot.journal_floors import JournalFloors
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
]

log = logging.getLogger(__name__)

MAX_FAILED_IN_A_ROW = 3
HISTORY_KEEP = 64
"""Save reports :attr:`SnapshotCoordinator.history` keeps: the newest (each holds its
snapshot's manifest, tens of KB; kept all, one per train step and per period, they were the
trainer's growth with rows trained in the soak, issue 33)."""
LEDGER_FILE = "ledger.json"
FINISHED_QUEUE_FILE = "tq.json"
TRAINER_FILE = "trainer.json"


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
        self._trainer_state = trainer_state
        self._config_fingerprint = config_fingerprint
        self._indexes = {LEDGER_FILE: PackIndex(), FINISHED_QUEUE_FILE: PackIndex()}
        """Where each trainer file's last write put its records (snapshot_growth)."""
        # Keyed by client: a replica that comes back gets new clients, asked afresh.
        self._statuses: dict[ParticipantClient, StatusReply] = {}
        self._failures: list[str] = []
        self._lock = asyncio.Lock()
        self._sequence = 0
        self._resumer = Resumer()
        self.floors = JournalFloors()
        """The journal marks a journal-mode save names (``snapshot.mode: journal``)."""
        self._cut_instead: set[str] = set()
        """Participants that made a journal-mode save take the cut (warned once each)."""
        self._failing_since = 0.0
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
        self._newest_in_store: SnapshotManifest | None = None
        """The newest manifest this coordinator's publications wrote (set by the thread)."""
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
        return self._newest_in_store or self._latest_published

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
        replies = await asyncio.gather(*(p.status() for p in clients), return_exceptions=True)
        for client, reply in zip(clients, replies, strict=True):
            if isinstance(reply, BaseException):
                found = blocker(client.label, Verb.STATUS, reply)
                detail = reply.message if isinstance(reply, RollpointError) else repr(reply)
                said = f"participant {client.label} did not answer status: {detail}"
                raise SaveBlocked([replace(found, message=said)])
            if reply.kind != client.address.kind:
                raise ConfigError(
                    f"{client.label} says it is a {reply.kind} server, not a {client.address.kind}"
                )
            self._statuses[client] = reply
        restart_only = [
            c.label for c in clients if self._statuses[c].mode == CheckpointMode.RESTART_ONLY
        ]
        if restart_only and not self.config.allow_restart_only:
            raise ConfigError(
                f"restart-only server(s) {', '.join(restart_only)}: their in-flight episodes would start over "
                "after a crash; set snapshot.allow_restart_only: true to accept that"
            )
        if restart_only:
            log.warning(
                "restart-only servers accepted: %s (their episodes restart after a crash)",
                restart_only,
            )

    def participant_entries(
        self, clients: list[ParticipantClient] | None = None
    ) -> list[ParticipantEntry]:
        """Manifest entries of ``clients`` (default: every up participant), once discovered."""
        entries = []
        for client in self.participants if clients is None else clients:
            status = self._statuses[client]
            instance = f"{status.name}-{status.replica}"
            entries.append(
                ParticipantEntry(
                    kind=status.kind,
                    name=status.name,
                    replica=status.replica,
                    mode=status.mode,
                    instance=instance,
                    manifest_path=f"participants/{status.kind.value}/{instance}/manifest.json",
                )
            )
        return entries

    def fingerprint(self, clients: list[ParticipantClient] | None = None) -> str:
        return topology_fingerprint(
            [
                # The digests are the store's, stamped at publication: not the topology.
                e.model_dump(mode="json", exclude={"sha256", "bytes"}) | {"features": []}
                for e in self.participant_entries(clients)
            ]
        )

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
                self._failures.clear()
                if self._restored_from is not None:
                    self.store.unpin(self._restored_from)
                    self._restored_from = None
                return report
            if not self._failures:
                self._failing_since = time.monotonic()
            self._failures.append(f"{snapshot_id}: {report.blocked_by}")
            log.warning(
                "snapshot %s failed (%d in a row): %s",
                snapshot_id,
                len(self._failures),
                report.blocked_by,
            )
            # Back-to-back saves (train checkpoints) fail within milliseconds of one
            # another while a replica dies or a link is down: the budget is spent only
            # by failures that also span retry_after_seconds. Every save is still tried,
            # so the first one after the fault commits.
            failing_for = time.monotonic() - self._failing_since
            if (
                len(self._failures) >= MAX_FAILED_IN_A_ROW
                and failing_for >= self.config.retry_after_seconds
            ):
                raise SnapshotError(stop_message(self._failures, failing_for, self.store.root))
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
            renewer = asyncio.create_task(self._renew_leases(checkpoint_id, prepared.clients))
            t0 = time.monotonic()
            report.phase = SavePhase.PREPARE
            await self._prepare_all(
                clients, checkpoint_id, deadline, prepared, drain_until=time.time() + drain_s
            )
            report.prepare_s = time.monotonic() - t0
            if self.before_capture is not None:
                await self.before_capture()
            report.phase = SavePhase.COMMIT
            staging = await asyncio.to_thread(self.store.begin, snapshot_id)
            t1 = time.monotonic()
            cut = await self._commit_all(clients, staging, checkpoint_id, prepared)
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
        """A pause-free save (see the module docstring): ``checkpoint`` on every
        participant, then the trainer's capture, then the write and the publication."""
        started_at = time.time()
        floors = self.floors.floors(self.ledger.live_records())
        report.phase = SavePhase.COMMIT
        try:
            staging = await asyncio.to_thread(self.store.begin, snapshot_id)
        except (RollpointError, OSError) as exc:
            report.blockers = [blocker(None, report.phase, exc)]
            return report
        t1 = time.monotonic()
        deadline = time.time() + self.config.deadline_seconds
        replies = await by_deadline(
            [
                c.checkpoint(
                    snapshot_id, deadline, staging.participants_relative_dir, floors.get(c.label)
                )
                for c in clients
            ],
            deadline,
        )
        failed = [
            blocker(c.label, Verb.CHECKPOINT, r)
            for c, r in zip(clients, replies, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            report.blockers = failed
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self.store.abort, staging)
            return report
        positions: dict[str, JournalMark] = {}
        for c, r in zip(clients, replies, strict=True):
            assert not isinstance(r, BaseException)
            positions[c.label] = r.position
        self.floors.reported(positions)
        if self.before_capture is not None:
            await self.before_capture()
        cut = Cut(
            staging=staging,
            checkpoint_id=snapshot_id,
            created_at=started_at,
            participants=clients,
            journal_mode=True,
        )
        # The trainer's position, after every participant's: see the module docstring.
        replicas = {c.address.replica for c in clients}
        elsewhere = [r.describe() for r in self.ledger.in_flight() if r.replica not in replicas]
        if elsewhere:
            message = (
                "episodes in flight on replicas taking no part in the snapshot: "
                f"{', '.join(elsewhere[:10])}"
            )
            report.blockers = [Blocker(None, Verb.CHECKPOINT, SnapshotError.code, True, message)]
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self.store.abort, staging)
            return report
        cut.in_flight = {replica: self.ledger.in_flight(replica) for replica in sorted(replicas)}
        self.floors.observe(self.ledger.live_records())
        cut.ledger = self.ledger.capture()
        cut.finished_queue = self.finished_queue.capture()
        cut.trainer_doc = self._trainer_state()
        report.commit_s = time.monotonic() - t1
        return await self._write_and_publish(cut, Prepared(), report)

    async def _write_and_publish(
        self, cut: Cut, prepared: Prepared, report: SaveReport
    ) -> SaveReport:
        snapshot_id = report.snapshot_id
        t2 = time.monotonic()
        try:
            report.phase = SavePhase.WRITE
            files = await self._write_all(cut)
            report.write_s = time.monotonic() - t2
            # After the reopen, and after the confirms (a detached agent reports what it
            # exported there): sorting the cut's tries into saved, finished and restarts
            # builds a manifest entry per try (~30 ms of the pause at 10k when inside).
            cut.classify(prepared)
            report.phase = SavePhase.PUBLISH
            publishing = asyncio.ensure_future(
                asyncio.to_thread(self._publish, cut, files, report.pause_s)
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

    async def _prepare_all(
        self,
        clients: list[ParticipantClient],
        checkpoint_id: str,
        deadline: float,
        prepared: Prepared,
        *,
        drain_until: float = 0.0,
    ) -> None:
        for stage in PREPARE_STAGES:
            stage_clients = [p for p in clients if p.address.kind == stage]
            # Record the clients before awaiting: one whose reply is lost may still have closed.
            prepared.clients.extend(stage_clients)
            replies = await by_deadline(
                [p.prepare(checkpoint_id, deadline) for p in stage_clients], deadline
            )
            blocked: list[Blocker] = []
            for client, reply in zip(stage_clients, replies, strict=True):
                if isinstance(reply, BaseException):
                    blocked.append(blocker(client.label, Verb.PREPARE, reply))
                    continue
                # Whatever else happens to this save, a stray reply is released after it.
                strays = [e for e in reply.report.finished_unacked if not is_wanted(self.ledger, e)]
                if strays:
                    prepared.strays[client] = strays
                if reply.phase != Phase.PREPARED:
                    r = reply.report
                    blocked.append(
                        Blocker(
                            client.label,
                            Verb.PREPARE,
                            DeadlineExceededError.code,
                            True,
                            f"{client.label} not ready by the deadline: {r.blocker_count} "
                            f"blocker(s) {', '.join(r.blockers[:5])}"
                            f"{'…' if r.blocker_count > 5 else ''}",
                        )
                    )
                else:
                    prepared.restarts.update(e.key for e in reply.report.restarts)
                    if stage == ParticipantKind.AGENT:
                        prepared.awaiting_model += reply.report.counts.get("awaiting_model", 0)
                    prepared.finished_unacked.update(e.key for e in reply.report.finished_unacked)
            if blocked:
                raise SaveBlocked(blocked)
            if stage == ParticipantKind.MODEL and drain_until > time.time():
                await _drain(stage_clients, min(drain_until, deadline))

    async def _commit_all(
        self,
        clients: list[ParticipantClient],
        staging: Staging,
        checkpoint_id: str,
        prepared: Prepared,
    ) -> Cut:
        cut = Cut(
            staging=staging,
            checkpoint_id=checkpoint_id,
            created_at=time.time(),
            participants=clients,
        )
        replicas = list(dict.fromkeys(c.address.replica for c in clients))
        # The cut is this instant: the in-flight set, ledger, the finished queue and counters together. A
        # reply that reaches the trainer during the commit is sealed after the cut; its
        # agent still holds it (acks wait for the barrier), so it is exported as finished.
        in_flight = {replica: self.ledger.in_flight(replica) for replica in replicas}
        elsewhere = [r.describe() for r in self.ledger.in_flight() if r.replica not in in_flight]
        if elsewhere:
            message = (
                "episodes in flight on replicas taking no part in the cut: "
                f"{', '.join(elsewhere[:10])}"
            )
            raise SaveBlocked([Blocker(None, Verb.COMMIT, SnapshotError.code, True, message)])
        cut.ledger = self.ledger.capture()
        cut.finished_queue = self.finished_queue.capture()
        cut.trainer_doc = self._trainer_state()
        scopes = {
            replica: [r.episode for r in records if r.key not in prepared.restarts]
            for replica, records in in_flight.items()
        }
        cut.detached = [c for c in clients if DETACHED_WRITE in self._statuses[c].features]
        deadline = time.time() + self.config.deadline_seconds
        replies = await by_deadline(
            [
                p.commit(
                    checkpoint_id,
                    deadline,
                    staging.participants_relative_dir,
                    scopes[p.address.replica],
                    wait_for_write=p not in cut.detached,
                    scope_as_keys=SCOPE_KEYS in self._statuses[p].features,
                )
                for p in clients
            ],
            deadline,
        )
        failed = [
            blocker(client.label, Verb.COMMIT, reply)
            for client, reply in zip(clients, replies, strict=True)
            if isinstance(reply, BaseException)
        ]
        if failed:
            raise SaveBlocked(failed)
        cut.in_flight = in_flight
        for client, reply in zip(clients, replies, strict=True):
            # A commit that did not wait for the write reports it with its confirm.
            is_agent = client.address.kind == ParticipantKind.AGENT
            if is_agent and isinstance(reply, CommitReply) and reply.exported is not None:
                cut.agent_exported[client.address.replica] = reply.exported
        return cut

    async def _write_all(self, cut: Cut) -> dict[str, FileEntry]:
        """The trainer's files, written while the participants finish writing what their
        commits captured; :class:`SaveBlocked` names every write that failed."""
        written = asyncio.ensure_future(asyncio.to_thread(self._write_trainer_files, cut))
        failed = await self._confirm_all(cut)
        try:
            files = await written
        except (RollpointError, OSError) as exc:
            failed.insert(0, blocker(None, SavePhase.WRITE, exc))
        if failed:
            raise SaveBlocked(failed)
        return files

    async def _confirm_all(self, cut: Cut) -> list[Blocker]:
        """Wait for every detached write; one line per participant whose write failed.

        A confirm lost on the wire (or answered with garbage) is sent once more before the
        deadline: confirm is idempotent (every confirm of a checkpoint gets the same reply),
        and at 100k sessions a trainer loop stalled by a long collection can send it on a
        keep-alive connection its peer has just closed."""
        if not cut.detached:
            return []
        deadline = time.time() + self.config.deadline_seconds
        clients = list(cut.detached)
        replies = await by_deadline(
            [c.confirm(cut.checkpoint_id, deadline) for c in clients], deadline
        )
        lost = [i for i, r in enumerate(replies) if isinstance(r, TransportError)]
        if lost and time.time() < deadline:
            again = await by_deadline(
                [clients[i].confirm(cut.checkpoint_id, deadline) for i in lost], deadline
            )
            for i, reply in zip(lost, again, strict=True):
                replies[i] = reply
        failed: list[Blocker] = []
        for client, reply in zip(clients, replies, strict=True):
            if isinstance(reply, BaseException):
                failed.append(blocker(client.label, Verb.CONFIRM, reply))
            elif client.address.kind == ParticipantKind.AGENT:
                cut.agent_exported.setdefault(client.address.replica, reply.exported)
        return failed

    @property
    def damaged_records_files(self) -> int:
        """Trainer records files found damaged before a snapshot named them again."""
        return sum(index.damaged for index in self._indexes.values())

    def _write_trainer_files(self, cut: Cut) -> dict[str, FileEntry]:
        assert cut.ledger is not None and cut.finished_queue is not None, "a cut captures both"
        # Kept as records: each write adds only what changed since the previous one.
        ledger, finished_queue = cut.ledger.as_records(), cut.finished_queue.as_records()
        return {
            LEDGER_FILE: self.store.write_records(
                cut.staging, LEDGER_FILE, ledger, self._indexes[LEDGER_FILE]
            ),
            FINISHED_QUEUE_FILE: self.store.write_records(
                cut.staging, FINISHED_QUEUE_FILE, finished_queue, self._indexes[FINISHED_QUEUE_FILE]
            ),
            TRAINER_FILE: self.store.write_file(
                cut.staging, TRAINER_FILE, orjson.dumps(cut.trainer_doc)
            ),
        }

    def _publish(self, cut: Cut, files: dict[str, FileEntry], pause_s: float) -> SnapshotManifest:
        manifest = SnapshotManifest(
            snapshot_id=cut.staging.snapshot_id,
            checkpoint_id=cut.checkpoint_id,
            created_at=cut.created_at,
            train_step=int(cut.trainer_doc.get("train_step", 0)),
            policy_version=int(cut.trainer_doc.get("policy_version", 0)),
            committed_step=cut.finished_queue.committed_step
            if cut.finished_queue is not None
            else 0,
            pause_seconds=pause_s,
            topology_fingerprint=self.fingerprint(cut.participants),
            participants=self.participant_entries(cut.participants),
            episodes=cut.episodes,
            restarts=cut.restarts,
            finished=cut.finished,
            journaled=cut.journaled,
            files=files,
            config_fingerprint=self._config_fingerprint,
        )
        published = self.store.publish(cut.staging, manifest)
        self._newest_in_store = published
        return published

    async def _renew_leases(self, checkpoint_id: str, prepared: list[ParticipantClient]) -> None:
        """Keep every prepared participant's lease alive while the save runs."""
        interval = max(0.2, self.config.deadline_seconds / 3)
        while True:
            await asyncio.sleep(interval)
            deadline = time.time() + self.config.deadline_seconds
            targets = list(prepared)
            results = await asyncio.gather(
                *(p.renew(checkpoint_id, deadline) for p in targets), return_exceptions=True
            )
            for client, result in zip(targets, results, strict=True):
                if isinstance(result, RollpointError):
                    log.debug("renew on %s: %s", client.label, result.message)


_DISCOVER_RETRY_S = 0.2


_DRAIN_POLL_S = 0.05


async def _drain(models: list[ParticipantClient], until: float) -> None:
    """Wait until no model server of ``models`` runs a call (their gates are closed, so the
    count only falls), or until ``until``; a status that fails just ends the wait."""
    while time.time() < until:
        try:
            statuses = await asyncio.gather(*(m.status() for m in models))
        except RollpointError:
            return
        running = sum(s.counts.get("in_flight", 0) for s in statuses)
        if not running:
            return
        await asyncio.sleep(_DRAIN_POLL_S)


_STORAGE_FAULTS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EIO: "an I/O error",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
_FAILURE_CHARS = 240
"""Each blocker named in the stop message is cut to this: the message stays one line."""


def storage_fault(failure: str) -> str | None:
    """What a failed save's blocker says about the store's disk, if it was one of the write
    faults an operator fixes by freeing space or fixing permissions (from the OS's words:
    a participant reports its failed write over the wire as text)."""
    for code, meaning in _STORAGE_FAULTS.items():
        if os.strerror(code) in failure:
            return meaning
    return None


def stop_message(failures: list[str], failing_for: float, root: str) -> str:
    """One line: how many failed, and what to do; for a full or unwritable store, what to
    free, else the last blockers, each cut short."""
    count = len(failures)
    last = failures[-MAX_FAILED_IN_A_ROW:]
    faults = [storage_fault(f) for f in last]
    head = (
        f"{count} snapshots failed in a row; stopping the run after {failing_for:.1f}s of failures"
    )
    if all(faults):
        return (
            f"{head}: the snapshot store {root} cannot be written ({faults[-1]}); free space "
            "there (older snapshots of other runs, or a lower snapshot.keep) or fix its "
            "permissions, then rerun: the run resumes from its last snapshot"
        )
    shown = [f if len(f) <= _FAILURE_CHARS else f[: _FAILURE_CHARS - 1] + "…" for f in last]
    return f"{head}: " + "; ".join(" ".join(f.split()) for f in shown)
