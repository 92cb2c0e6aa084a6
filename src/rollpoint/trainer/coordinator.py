"""The snapshot coordinator: one consistent cut across the trainer and every replica.

Owns the save order of DESIGN §5 and the failure budget. A save:

1. closes the dispatch barrier (the pause clock starts);
2. prepares every participant of every replica in stages — model servers (admission
   closes, so agents waiting on a policy call reach a boundary), then agents (sessions
   park at boundaries), then resources (tool calls freeze) — against one shared deadline,
   while a background task renews every lease;
3. on any failure or a missed deadline resumes everyone exactly once (the abort) and
   counts one failed snapshot; three in a row stop the run, naming what blocked each;
4. commits every participant in parallel, each replica's scope being the ledger's
   in-flight episodes on it minus the restarts its participants reported;
5. does not drain: finished replies still on the wire are held by their agent and
   exported with its sessions (they are listed as ``finished`` in the manifest);
6. captures the ledger and TQ at the cut;
7. resumes everyone (reverse stages) and reopens the barrier (the pause ends);
8. writes the trainer's files and publishes the manifest last.

It does not own when snapshots happen (the trainer loop decides) nor the files' layout
(:mod:`rollpoint.store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.config import SnapshotConfig
from rollpoint.protocol.control import CommitReply, Phase, StatusReply
from rollpoint.protocol.errors import ConfigError, RollpointError, SnapshotError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import (
    ParticipantEntry,
    RestartEpisode,
    SavedEpisode,
    SnapshotManifest,
    topology_fingerprint,
)
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.store.staging import Staging
from rollpoint.trainer.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.finished_queue import FinishedQueue
from rollpoint.trainer.ledger import LedgerRecord, RecoveryLedger
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.participant_client import ParticipantClient

log = logging.getLogger(__name__)

PREPARE_STAGES = (ParticipantKind.MODEL, ParticipantKind.AGENT, ParticipantKind.RESOURCES)
"""Callers' callees close first; resume runs in the reverse order."""
MAX_FAILED_IN_A_ROW = 3
LEDGER_FILE = "ledger.json"
TQ_FILE = "tq.json"
TRAINER_FILE = "trainer.json"


@dataclass
class SaveReport:
    """What one save attempt did, published or not."""

    snapshot_id: str
    published: bool
    pause_s: float = 0.0
    prepare_s: float = 0.0
    commit_s: float = 0.0
    saved: int = 0
    restarts: int = 0
    finished: int = 0
    blocked_by: str = ""
    manifest: SnapshotManifest | None = None


@dataclass
class _Cut:
    """Everything captured while the barrier was closed, written after it reopens."""

    staging: Staging
    checkpoint_id: str
    created_at: float
    episodes: list[SavedEpisode] = field(default_factory=list)
    restarts: list[RestartEpisode] = field(default_factory=list)
    finished: list[RestartEpisode] = field(default_factory=list)
    ledger_doc: dict[str, Any] = field(default_factory=dict)
    tq_doc: dict[str, Any] = field(default_factory=dict)
    trainer_doc: dict[str, Any] = field(default_factory=dict)


class SnapshotCoordinator:
    def __init__(
        self,
        participants: list[ParticipantClient],
        *,
        store: SnapshotStore,
        ledger: RecoveryLedger,
        tq: FinishedQueue,
        barrier: DispatchBarrier,
        config: SnapshotConfig,
        metrics: TrainerMetrics,
        trainer_state: Callable[[], dict[str, Any]],
        config_fingerprint: dict[str, JsonValue],
    ) -> None:
        self.participants = participants
        self.store = store
        self.ledger = ledger
        self.tq = tq
        self.barrier = barrier
        self.config = config
        self.metrics = metrics
        self._trainer_state = trainer_state
        self._config_fingerprint = config_fingerprint
        self._statuses: dict[str, StatusReply] = {}
        self._failures: list[str] = []
        self._lock = asyncio.Lock()
        self._sequence = 0
        self.history: list[SaveReport] = []
        self.before_save: Callable[[], Awaitable[None]] | None = None
        """Runs before the barrier closes (the trainer flushes retires and forgets: DESIGN §5.1)."""

    @property
    def saving(self) -> bool:
        """True while a save is in progress (barrier closed or files being published)."""
        return self._lock.locked()

    # --- setup -------------------------------------------------------------------------

    async def discover(self) -> list[StatusReply]:
        """Ask every participant who it is; refuse restart-only servers unless allowed."""
        replies = await asyncio.gather(
            *(p.status() for p in self.participants), return_exceptions=True
        )
        for client, reply in zip(self.participants, replies, strict=True):
            if isinstance(reply, BaseException):
                detail = reply.message if isinstance(reply, RollpointError) else repr(reply)
                raise SnapshotError(f"participant {client.label} did not answer status: {detail}")
            if reply.kind != client.address.kind:
                raise ConfigError(
                    f"{client.label} says it is a {reply.kind} server, not a {client.address.kind}"
                )
            self._statuses[client.label] = reply
        restart_only = [
            c.label
            for c in self.participants
            if self._statuses[c.label].mode == CheckpointMode.RESTART_ONLY
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
        return [self._statuses[c.label] for c in self.participants]

    def participant_entries(self) -> list[ParticipantEntry]:
        entries = []
        for client in self.participants:
            status = self._statuses[client.label]
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

    def fingerprint(self) -> str:
        return topology_fingerprint(
            [e.model_dump(mode="json") | {"features": []} for e in self.participant_entries()]
        )

    # --- save --------------------------------------------------------------------------

    async def save(self) -> SaveReport:
        """Take one snapshot. A failed one is reported (and counted); the third failure in
        a row raises :class:`SnapshotError` naming what blocked each."""
        async with self._lock:
            if not self._statuses:
                await self.discover()
            if self.before_save is not None:
                try:
                    await self.before_save()
                except RollpointError as exc:
                    log.warning("before a snapshot: %s", exc.message)
            self._sequence += 1
            snapshot_id = f"snap-{int(time.time() * 1000)}-{self._sequence:04d}"
            report = await self._save(snapshot_id)
            self.history.append(report)
            self.metrics.record_snapshot(
                outcome="published" if report.published else "failed",
                pause_s=report.pause_s,
                prepare_s=report.prepare_s,
                commit_s=report.commit_s,
                parked=report.saved,
                restarts=report.restarts,
                snapshot_id=snapshot_id,
                detail=report.blocked_by,
            )
            if report.published:
                self._failures.clear()
                return report
            self._failures.append(f"{snapshot_id}: {report.blocked_by}")
            log.warning(
                "snapshot %s failed (%d in a row): %s",
                snapshot_id,
                len(self._failures),
                report.blocked_by,
            )
            if len(self._failures) >= MAX_FAILED_IN_A_ROW:
                raise SnapshotError(
                    f"{MAX_FAILED_IN_A_ROW} snapshots failed in a row; stopping the run: "
                    + "; ".join(self._failures)
                )
            return report

    async def _save(self, snapshot_id: str) -> SaveReport:
        report = SaveReport(snapshot_id=snapshot_id, published=False)
        checkpoint_id = snapshot_id
        started_at = time.time()
        self.barrier.close()
        paused_at = time.monotonic()
        staging: Staging | None = None
        prepared: list[ParticipantClient] = []
        renewer: asyncio.Task[None] | None = None
        cut: _Cut | None = None
        try:
            deadline = time.time() + self.config.deadline_seconds
            renewer = asyncio.create_task(self._renew_leases(checkpoint_id, prepared))
            t0 = time.monotonic()
            restarts, finished_unacked = await self._prepare_all(checkpoint_id, deadline, prepared)
            report.prepare_s = time.monotonic() - t0
            staging = await asyncio.to_thread(self.store.begin, snapshot_id)
            t1 = time.monotonic()
            cut = await self._commit_all(staging, checkpoint_id, restarts, finished_unacked)
            cut.created_at = started_at
            report.commit_s = time.monotonic() - t1
        except RollpointError as exc:
            report.blocked_by = exc.message
        except Exception as exc:  # a bug must not leave every participant closed
            log.exception("snapshot %s failed unexpectedly", snapshot_id)
            report.blocked_by = f"{type(exc).__name__}: {exc}"
        finally:
            if renewer is not None:
                renewer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renewer
            # Resume is the abort before a publish and the reopen after a good cut: one path.
            await self._resume_all(checkpoint_id, prepared)
            self.barrier.open()
            report.pause_s = time.monotonic() - paused_at
        if cut is None:
            if staging is not None:
                await asyncio.to_thread(self.store.abort, staging)
            return report
        try:
            report.manifest = await asyncio.to_thread(self._publish, cut, report.pause_s)
        except RollpointError as exc:
            report.blocked_by = f"publish: {exc.message}"
            with contextlib.suppress(RollpointError, OSError):
                await asyncio.to_thread(self.store.abort, cut.staging)
            return report
        report.published = True
        report.saved, report.restarts, report.finished = (
            len(cut.episodes),
            len(cut.restarts),
            len(cut.finished),
        )
        if cut.restarts:
            log.info(
                "snapshot %s: %d in-flight episodes would start over",
                snapshot_id,
                len(cut.restarts),
            )
        return report

    async def _prepare_all(
        self, checkpoint_id: str, deadline: float, prepared: list[ParticipantClient]
    ) -> tuple[set[str], set[str]]:
        restarts: set[str] = set()
        finished_unacked: set[str] = set()
        for stage in PREPARE_STAGES:
            stage_clients = [p for p in self.participants if p.address.kind == stage]
            # Record the clients before awaiting: one whose reply is lost may still have closed.
            prepared.extend(stage_clients)
            replies = await asyncio.gather(
                *(p.prepare(checkpoint_id, deadline) for p in stage_clients), return_exceptions=True
            )
            blocked: list[str] = []
            for client, reply in zip(stage_clients, replies, strict=True):
                if isinstance(reply, BaseException):
                    detail = reply.message if isinstance(reply, RollpointError) else repr(reply)
                    blocked.append(f"{client.label} failed prepare: {detail}")
                elif reply.phase != Phase.PREPARED:
                    r = reply.report
                    blocked.append(
                        f"{client.label} not ready by the deadline: {r.blocker_count} blocker(s) "
                        f"{', '.join(r.blockers[:5])}{'…' if r.blocker_count > 5 else ''}"
                    )
                else:
                    restarts.update(e.key for e in reply.report.restarts)
                    finished_unacked.update(e.key for e in reply.report.finished_unacked)
            if blocked:
                raise SnapshotError("; ".join(blocked))
        return restarts, finished_unacked

    async def _commit_all(
        self, staging: Staging, checkpoint_id: str, restarts: set[str], finished_unacked: set[str]
    ) -> _Cut:
        cut = _Cut(staging=staging, checkpoint_id=checkpoint_id, created_at=time.time())
        in_flight: dict[str, list[LedgerRecord]] = {}
        for client in self.participants:
            if client.address.replica not in in_flight:
                in_flight[client.address.replica] = self.ledger.in_flight(client.address.replica)
        scopes = {
            replica: [EpisodeId(rollout_id=r.rollout_id, attempt=r.attempt) for r in records]
            for replica, records in in_flight.items()
        }
        for replica in scopes:
            scopes[replica] = [e for e in scopes[replica] if e.key not in restarts]
        deadline = time.time() + self.config.deadline_seconds
        replies = await asyncio.gather(
            *(
                p.commit(
                    checkpoint_id,
                    deadline,
                    staging.participants_relative_dir,
                    scopes[p.address.replica],
                )
                for p in self.participants
            ),
            return_exceptions=True,
        )
        failed = [
            f"{client.label} failed commit: {reply.message if isinstance(reply, RollpointError) else repr(reply)}"
            for client, reply in zip(self.participants, replies, strict=True)
            if isinstance(reply, BaseException)
        ]
        if failed:
            raise SnapshotError("; ".join(failed))
        agent_replies = {
            client.address.replica: reply
            for client, reply in zip(self.participants, replies, strict=True)
            if client.address.kind == ParticipantKind.AGENT and isinstance(reply, CommitReply)
        }
        self._classify(cut, in_flight, agent_replies, restarts, finished_unacked)
        # The ledger and TQ at the cut; serialised after the barrier reopens.
        cut.ledger_doc = self.ledger.to_document()
        cut.tq_doc = self.tq.to_document()
        cut.trainer_doc = self._trainer_state()
        return cut

    def _classify(
        self,
        cut: _Cut,
        in_flight: dict[str, list[LedgerRecord]],
        agent_replies: dict[str, CommitReply],
        restarts: set[str],
        finished_unacked: set[str],
    ) -> None:
        """Every in-flight episode is saved, finished (reply held) or a restart — exactly one."""
        for replica, records in in_flight.items():
            reply = agent_replies.get(replica)
            exported = {e.episode.key: e for e in reply.exported} if reply is not None else {}
            for record in records:
                key = f"{record.rollout_id}#{record.attempt}"
                base: dict[str, Any] = {
                    "rollout_id": record.rollout_id,
                    "attempt": record.attempt,
                    "replica": replica,
                    "group_id": record.group_id,
                    "row": record.row,
                }
                if key in exported:
                    turns = exported[key].turns_completed or 0
                    cut.episodes.append(SavedEpisode(**base, turns_completed=turns))
                elif key in finished_unacked:
                    cut.finished.append(RestartEpisode(**base))
                else:
                    if key not in restarts:
                        # Dispatched, but its /run never reached the agent before the cut: it had
                        # not started, so starting over loses nothing.
                        log.info(
                            "snapshot %s: %s on %s had not started; it restarts",
                            cut.checkpoint_id,
                            key,
                            replica,
                        )
                    cut.restarts.append(RestartEpisode(**base))

    def _publish(self, cut: _Cut, pause_s: float) -> SnapshotManifest:
        files = {
            LEDGER_FILE: self.store.write_file(
                cut.staging, LEDGER_FILE, orjson.dumps(cut.ledger_doc)
            ),
            TQ_FILE: self.store.write_file(cut.staging, TQ_FILE, orjson.dumps(cut.tq_doc)),
            TRAINER_FILE: self.store.write_file(
                cut.staging, TRAINER_FILE, orjson.dumps(cut.trainer_doc)
            ),
        }
        manifest = SnapshotManifest(
            snapshot_id=cut.staging.snapshot_id,
            checkpoint_id=cut.checkpoint_id,
            created_at=cut.created_at,
            train_step=int(cut.trainer_doc.get("train_step", 0)),
            policy_version=int(cut.trainer_doc.get("policy_version", 0)),
            pause_seconds=pause_s,
            topology_fingerprint=self.fingerprint(),
            participants=self.participant_entries(),
            episodes=cut.episodes,
            restarts=cut.restarts,
            finished=cut.finished,
            files=files,
            config_fingerprint=self._config_fingerprint,
        )
        return self.store.publish(cut.staging, manifest)

    async def _renew_leases(self, checkpoint_id: str, prepared: list[ParticipantClient]) -> None:
        """Keep every prepared participant's lease alive while the save runs."""
        interval = max(0.2, self.config.deadline_seconds / 3)
        while True:
            await asyncio.sleep(interval)
            deadline = time.time() + self.config.deadline_seconds
            results = await asyncio.gather(
                *(p.renew(checkpoint_id, deadline) for p in list(prepared)), return_exceptions=True
            )
            for client, result in zip(list(prepared), results, strict=False):
                if isinstance(result, RollpointError):
                    log.debug("renew on %s: %s", client.label, result.message)

    async def _resume_all(self, checkpoint_id: str, clients: Iterable[ParticipantClient]) -> None:
        """Resume each participant once, callees last (reverse stages). A resume that fails is
        retried once on that participant only; its lease reopens it if that fails too."""
        by_stage = list(clients)
        for stage in reversed(PREPARE_STAGES):
            stage_clients = [p for p in by_stage if p.address.kind == stage]
            results = await asyncio.gather(
                *(p.resume(checkpoint_id) for p in stage_clients), return_exceptions=True
            )
            retry = [
                c
                for c, r in zip(stage_clients, results, strict=True)
                if isinstance(r, BaseException)
            ]
            if not retry:
                continue
            again = await asyncio.gather(
                *(p.resume(checkpoint_id) for p in retry), return_exceptions=True
            )
            for client, result in zip(retry, again, strict=True):
                if isinstance(result, BaseException):
                    detail = result.message if isinstance(result, RollpointError) else repr(result)
                    log.warning(
                        "resume of %s failed twice (%s); its lease will reopen it",
                        client.label,
                        detail,
                    )
