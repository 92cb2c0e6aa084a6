"""Restore after a crash: the restore order of docs/design.md#the-restore-order.

Owns the order in which every piece is put back, and the ledger's moves; each earlier step
is done by the module that owns it:

1. the newest published snapshot that composes with a durable step of the trainer's
   record, a corrupt, partial or tampered one skipped with the reason for the console
   (:func:`~.resume_point.find_resume_point`); what to do when none is usable is the job's;
2. the config keys the saved state depends on must match; ``replicas`` may change
   (:func:`~.restore_checks.check_config`);
3. every saved replica is placed on a live one (:func:`~.restore_checks.place`), an
   elastic N → M restore when the replica that saved it is not live with every
   participant it needs. Checked before anything is installed: a participant no live
   replica serves is named, and so is one whose state would move but is not ``portable``;
4. the saved ledger's in-flight set must equal saved + restarted + finished episodes
   (:func:`~.restore_checks.check_cut`);
5. the saved attempts are stopped and dropped wherever servers that outlived the trainer
   still run them, then every participant the manifest names restores, or none does,
   through one cleanup path and a clear error (:class:`~.installer.Installer`);
6. the ledger moves: saved episodes continue as ``attempt + 1`` on the replica holding
   their restored state (pinned there), restarts start over under new rollout ids (and so
   do tries the saved ledger holds queued for a replica: their state died with its
   servers), finished replies held by an agent are fetched again under their own
   identity (adopted, not rerun); the finished queue puts back what no durable train checkpoint consumed;
   the trainer's record of its steps (:class:`~.step_record.StepRecord`) is checked against
   the checkpoint before anything is installed and cut back to it after (rollpoint's own,
   ``train_data.jsonl``, only to a boundary that verifies: its digest, line count and a
   line end, :mod:`..record.train_data`), else refused unchanged.

:meth:`Restorer.restore_replica` does step 5 alone for one replica restarted mid-run
(:mod:`.replica_recovery` decides what to restore and moves the ledger).

It does not run the job: it hands a :class:`RestoredRun` to the trainer loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from rollpoint.protocol.errors import RestoreError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.restore.installer import PARTICIPANTS_SUBDIR, RERUN_REACH, Installer
from rollpoint.trainer.restore.restore_checks import (
    ELASTIC_CONFIG_KEYS,
    Live,
    Placement,
    check_config,
    check_cut,
    check_modes,
    list_names,
    place,
)
from rollpoint.trainer.restore.resume_point import (
    ResumePoint,
    Skipped,
    choose_resume_point,
    find_resume_point,
    read_trainer_document,
)
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_record import RolloutState
from rollpoint.trainer.step_record import StepRecord

# The resume point moved to resume_point, the checks and the placement to restore_checks,
# the install to installer: their names stay importable from here.
__all__ = [
    "ELASTIC_CONFIG_KEYS",
    "PARTICIPANTS_SUBDIR",
    "RERUN_REACH",
    "Placement",
    "RestoredRun",
    "Restorer",
    "ResumePoint",
    "Skipped",
    "check_config",
    "choose_resume_point",
    "find_resume_point",
    "place",
    "read_trainer_document",
]

log = logging.getLogger(__name__)


@dataclass
class RestoredRun:
    """What the trainer loop starts from after a restore."""

    snapshot_id: str
    checkpoint: TrainCheckpoint
    ledger: RecoveryLedger
    finished_queue: FinishedQueue
    trainer_doc: dict[str, Any] = field(default_factory=dict)
    """The trainer's counters at the cut (for display; training state is the checkpoint's)."""
    continued: list[EpisodeId] = field(default_factory=list)
    restarted: int = 0
    lost_external: list[str] = field(default_factory=list)
    """Saved episodes of an ``external`` environment whose state did not survive: restarted
    (counted in ``restarted`` too)."""
    adopted: int = 0
    resent: int = 0
    """Tries a journal-mode snapshot held in flight, sent again under their own id and
    attempt to their replica, to continue there from its journals."""
    tq_requeued: int = 0
    placement: dict[str, str] = field(default_factory=dict)
    """Saved replica → the live replica its state went to (differs after an elastic restore)."""


class Restorer:
    def __init__(self, participants: list[ParticipantClient]) -> None:
        self._participants = participants
        self._installer = Installer(participants)

    async def restore(
        self,
        point: ResumePoint,
        *,
        step_record: StepRecord,
        deadline_s: float = 30.0,
        continue_episodes: bool = True,
    ) -> RestoredRun:
        """``continue_episodes=False`` is ``recovery: restart``: the saved episodes start over
        from their prompts (their sessions are not installed); the rest is the same.
        ``step_record``: the trainer's record of its steps (the one ``point`` was found in):
        checked against the point's checkpoint before anything is installed, cut back to
        it once everything is."""
        manifest = point.manifest
        await asyncio.to_thread(step_record.check, point.checkpoint)
        placement = await self._check_topology(manifest)
        ledger = RecoveryLedger.from_document(
            point.ledger_doc, what=f"ledger of snapshot {manifest.snapshot_id}"
        )
        check_cut(manifest, ledger)
        finished_queue = FinishedQueue.from_document(
            point.finished_queue_doc, what=f"the finished queue of snapshot {manifest.snapshot_id}"
        )
        saved = manifest.episodes if continue_episodes else []
        lost = await self._installer.install(manifest, placement, saved, deadline_s)
        run = RestoredRun(
            snapshot_id=manifest.snapshot_id,
            checkpoint=point.checkpoint,
            ledger=ledger,
            finished_queue=finished_queue,
            trainer_doc=point.trainer_doc,
            placement=placement.target_of,
        )
        # A queued try pinned to a replica waits for state (a session, a held reply) that
        # lived only in the servers that crashed: it is not in this snapshot, so start over.
        for record in list(ledger.live_records()):
            if record.state is RolloutState.QUEUED and record.replica is not None:
                ledger.abandon(record.rollout_id)
                run.restarted += 1
        for episode in manifest.episodes:
            if not continue_episodes or episode.rollout_id in lost:
                ledger.abandon(episode.rollout_id)
                run.restarted += 1
                if episode.rollout_id in lost:
                    run.lost_external.append(episode.rollout_id)
                continue
            pin = placement.target_of[episode.replica]
            record = ledger.continue_attempt(episode.rollout_id, pin=pin)
            run.continued.append(EpisodeId(rollout_id=record.rollout_id, attempt=record.attempt))
        for restart in manifest.restarts:
            ledger.abandon(restart.rollout_id)
            run.restarted += 1
        for finished in manifest.finished:
            holder = placement.target_of.get(finished.replica, finished.replica)
            ledger.requeue(finished.rollout_id, keep_replica=True, pin=holder)
            run.adopted += 1
        # A journal-mode snapshot saved no episode: its tries in flight go back under their
        # own identity to the replica whose journals hold their turns (docs/design.md
        # "Pause-free snapshots"); a row finished there is only verified again.
        for journaled in manifest.journaled:
            holder = placement.target_of.get(journaled.replica, journaled.replica)
            ledger.requeue(journaled.rollout_id, keep_replica=True, pin=holder)
            run.resent += 1
        run.tq_requeued = finished_queue.rewind(point.checkpoint.step)
        await asyncio.to_thread(step_record.cut_back, point.checkpoint)
        return run

    async def restore_replica(
        self,
        manifest: SnapshotManifest,
        replica: str,
        episodes: list[EpisodeId],
        *,
        deadline_s: float = 30.0,
    ) -> set[str]:
        """Install ``replica``'s saved state (the saved attempts in ``episodes``, plus the
        finished replies its agent held) into its restarted servers, all or nothing.
        Returns the rollouts an ``external`` environment could not continue (to start over).

        The restorer's participants are that replica's; the trainer moves its ledger."""
        live = await self._live()
        placement = Placement({replica: replica})
        saved = [p for p in manifest.participants if p.replica == replica]
        missing = [
            f"{p.kind.value} '{p.name}'"
            for p in saved
            if (p.kind.value, p.name, replica) not in live
        ]
        if missing:
            raise RestoreError(
                f"{replica} restarted without {list_names(missing)} of snapshot {manifest.snapshot_id}"
            )
        only = manifest.model_copy(update={"participants": saved})
        check_modes(only, live, placement)
        wanted = {e.key for e in episodes}
        chosen = [e for e in manifest.episodes if f"{e.rollout_id}#{e.attempt}" in wanted]
        return await self._installer.install(only, placement, chosen, deadline_s)

    async def _live(self) -> Live:
        replies = await asyncio.gather(
            *(p.status() for p in self._participants), return_exceptions=True
        )
        return {
            (r.kind.value, r.name, r.replica): r
            for r in replies
            if not isinstance(r, BaseException)
        }

    async def _check_topology(self, manifest: SnapshotManifest) -> Placement:
        live = await self._live()
        placement = place(manifest, live)
        check_modes(manifest, live, placement)
        for source, target in sorted(placement.moved.items()):
            log.warning(
                "snapshot %s: the state of %s is restored onto %s",
                manifest.snapshot_id,
                source,
                target,
            )
        return placement
