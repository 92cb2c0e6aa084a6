"""Restore after a crash: the restore order of DESIGN §6.

Owns choosing what to resume from and putting every piece back:

1. the newest published snapshot that composes with a durable train checkpoint (TQ's
   committed step ≤ checkpoint step ≤ the snapshot's train step); a corrupt or partial
   snapshot is skipped with a warning for the previous one; none → fresh start;
2. the config keys the saved state depends on must match (a mismatch names the key);
3. every participant the manifest names must be live — checked before anything is
   installed, naming the missing ones;
4. the saved ledger's in-flight set must equal saved + restarted + finished episodes
   (a mismatch names the episodes and replicas);
5. every participant the manifest names restores, or none does: any failure goes through
   one cleanup path (retire the next attempts, resume each participant exactly once) and a
   clear error. A live participant the manifest does not name (its replica was down at the
   cut) has nothing to install and is left alone;
6. the ledger moves: saved episodes continue as ``attempt + 1`` on the replica that saved
   them, restarts start over under new rollout ids, finished replies held by an agent are
   fetched again under their own identity (adopted, not rerun); TQ puts back what no
   durable train checkpoint consumed; ``train_data.jsonl`` is cut back to the checkpoint.

It does not run the job: it hands a :class:`RestoredRun` to the trainer loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.protocol.errors import ConfigError, RestoreError, RollpointError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR, SnapshotStore
from rollpoint.trainer.coordinator import (
    LEDGER_FILE,
    PREPARE_STAGES,
    TQ_FILE,
    TRAINER_FILE,
)
from rollpoint.trainer.finished_queue import FinishedQueue
from rollpoint.trainer.ledger import RecoveryLedger
from rollpoint.trainer.participant_client import ParticipantClient
from rollpoint.trainer.train_checkpoint import TrainCheckpoint, TrainCheckpointStore

log = logging.getLogger(__name__)

PARTICIPANTS_SUBDIR = "participants"
_LIST_LIMIT = 10


@dataclass
class ResumePoint:
    """A snapshot and the train checkpoint it composes with."""

    manifest: SnapshotManifest
    checkpoint: TrainCheckpoint
    ledger_doc: dict[str, Any]
    tq_doc: dict[str, Any]
    trainer_doc: dict[str, Any]


@dataclass
class RestoredRun:
    """What the trainer loop starts from after a restore."""

    snapshot_id: str
    checkpoint: TrainCheckpoint
    ledger: RecoveryLedger
    tq: FinishedQueue
    trainer_doc: dict[str, Any] = field(default_factory=dict)
    """The trainer's counters at the cut (for display; training state is the checkpoint's)."""
    continued: list[EpisodeId] = field(default_factory=list)
    restarted: int = 0
    adopted: int = 0
    tq_requeued: int = 0


def choose_resume_point(
    store: SnapshotStore, checkpoints: TrainCheckpointStore
) -> ResumePoint | None:
    """The newest usable snapshot that composes with a durable train checkpoint, or None."""
    available = checkpoints.available()
    for summary in store.list_snapshots(include_invalid=True):
        sid = summary.snapshot_id
        if not summary.valid:
            log.warning("skipping snapshot %s: %s", sid, summary.reason)
            continue
        try:
            manifest = store.verify(sid)
            ledger_doc = orjson.loads(store.read_file(sid, LEDGER_FILE))
            tq_doc = orjson.loads(store.read_file(sid, TQ_FILE))
            trainer_doc = orjson.loads(store.read_file(sid, TRAINER_FILE))
        except (RollpointError, orjson.JSONDecodeError) as exc:
            detail = exc.message if isinstance(exc, RollpointError) else str(exc)
            log.warning("skipping snapshot %s: %s", sid, detail)
            continue
        committed = int(tq_doc.get("committed_step", 0))
        for checkpoint in available:
            if committed <= checkpoint.step <= manifest.train_step:
                return ResumePoint(manifest, checkpoint, ledger_doc, tq_doc, trainer_doc)
        log.warning(
            "skipping snapshot %s: no train checkpoint between its committed step %d and its train step %d",
            sid,
            committed,
            manifest.train_step,
        )
    return None


def check_config(manifest: SnapshotManifest, live: dict[str, JsonValue]) -> None:
    """Refuse a config that makes the snapshot unusable, naming the first key that differs."""
    for key, saved in manifest.config_fingerprint.items():
        now = live.get(key)
        if now != saved:
            raise ConfigError(
                f"config key '{key}' is {now!r} but snapshot {manifest.snapshot_id} was taken with {saved!r}; "
                "change it back, or start over with --fresh --force"
            )


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f" and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


class Restorer:
    def __init__(self, participants: list[ParticipantClient]) -> None:
        self._participants = participants

    async def restore(
        self,
        point: ResumePoint,
        *,
        train_data: Path,
        deadline_s: float = 30.0,
        continue_episodes: bool = True,
    ) -> RestoredRun:
        """``continue_episodes=False`` is ``recovery: restart``: the saved episodes start over
        from their prompts (their sessions are not installed); the rest is the same."""
        manifest = point.manifest
        await self._check_topology(manifest)
        ledger = RecoveryLedger.from_document(
            point.ledger_doc, what=f"ledger of snapshot {manifest.snapshot_id}"
        )
        _check_cut(manifest, ledger)
        tq = FinishedQueue.from_document(
            point.tq_doc, what=f"TQ of snapshot {manifest.snapshot_id}"
        )
        await self._install(manifest, deadline_s, sessions=continue_episodes)
        run = RestoredRun(
            snapshot_id=manifest.snapshot_id,
            checkpoint=point.checkpoint,
            ledger=ledger,
            tq=tq,
            trainer_doc=point.trainer_doc,
        )
        for saved in manifest.episodes:
            if not continue_episodes:
                ledger.abandon(saved.rollout_id)
                run.restarted += 1
                continue
            record = ledger.continue_attempt(saved.rollout_id)
            run.continued.append(EpisodeId(rollout_id=record.rollout_id, attempt=record.attempt))
        for restart in manifest.restarts:
            ledger.abandon(restart.rollout_id)
            run.restarted += 1
        for finished in manifest.finished:
            ledger.requeue(finished.rollout_id, keep_replica=True)
            run.adopted += 1
        run.tq_requeued = tq.rewind(point.checkpoint.step)
        await asyncio.to_thread(_cut_back, train_data, point.checkpoint.train_data_bytes)
        return run

    async def _check_topology(self, manifest: SnapshotManifest) -> None:
        replies = await asyncio.gather(
            *(p.status() for p in self._participants), return_exceptions=True
        )
        live = {
            (r.kind.value, r.name, r.replica): r
            for r in replies
            if not isinstance(r, BaseException)
        }
        missing = [
            f"{p.kind.value} '{p.name}' of {p.replica}"
            for p in manifest.participants
            if (p.kind.value, p.name, p.replica) not in live
        ]
        if missing:
            raise RestoreError(
                f"snapshot {manifest.snapshot_id} needs participants that are not live: {_names(missing)}; "
                "nothing was installed"
            )
        changed = [
            f"{p.kind.value} '{p.name}' of {p.replica} was {p.mode}, is now {live[(p.kind.value, p.name, p.replica)].mode}"
            for p in manifest.participants
            if live[(p.kind.value, p.name, p.replica)].mode != p.mode
        ]
        if changed:
            raise RestoreError(
                f"snapshot {manifest.snapshot_id}: participants changed checkpoint mode: {_names(changed)}; "
                "nothing was installed"
            )

    async def _install(
        self, manifest: SnapshotManifest, deadline_s: float, *, sessions: bool
    ) -> None:
        """Restore every participant or none: one cleanup path on any failure. Without
        ``sessions`` the scope is empty: only held finished replies are installed."""
        restore_id = f"restore-{int(time.time() * 1000)}"
        directory = f"{SNAPSHOTS_DIR}/{manifest.snapshot_id}/{PARTICIPANTS_SUBDIR}"
        scopes: dict[str, list[EpisodeId]] = defaultdict(list)
        for saved in manifest.episodes if sessions else []:
            scopes[saved.replica].append(
                EpisodeId(rollout_id=saved.rollout_id, attempt=saved.attempt)
            )
        deadline = time.time() + deadline_s
        clients = _named(self._participants, manifest)
        # A failed restore into these same servers left retire marks on the next attempts
        # (its cleanup); forget them first, or the continued attempts would be refused.
        rollout_ids = [e.rollout_id for e in manifest.episodes]
        if rollout_ids:
            await asyncio.gather(*(p.forget(rollout_ids) for p in clients), return_exceptions=True)
        results = await asyncio.gather(
            *(
                p.restore(
                    restore_id,
                    deadline,
                    directory,
                    scopes.get(p.address.replica, []),
                    manifest.checkpoint_id,
                )
                for p in clients
            ),
            return_exceptions=True,
        )
        failed = [
            f"{c.label}: {r.message if isinstance(r, RollpointError) else repr(r)}"
            for c, r in zip(clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            await self._clean_up(restore_id, manifest)
            raise RestoreError(
                f"restore of snapshot {manifest.snapshot_id} failed, nothing kept: {'; '.join(failed)}"
            )
        await self._resume_all(restore_id, manifest)

    async def _clean_up(self, restore_id: str, manifest: SnapshotManifest) -> None:
        """The one cleanup path: the next attempts can never run, then each participant
        is resumed exactly once."""
        next_attempts = [
            EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt + 1) for e in manifest.episodes
        ]
        if next_attempts:
            await asyncio.gather(
                *(p.retire(next_attempts) for p in self._participants), return_exceptions=True
            )
        await self._resume_all(restore_id, manifest)

    async def _resume_all(self, restore_id: str, manifest: SnapshotManifest) -> None:
        named = _named(self._participants, manifest)
        for stage in reversed(PREPARE_STAGES):
            stage_clients = [p for p in named if p.address.kind == stage]
            results = await asyncio.gather(
                *(p.resume(restore_id) for p in stage_clients), return_exceptions=True
            )
            for client, result in zip(stage_clients, results, strict=True):
                if isinstance(result, BaseException):
                    detail = result.message if isinstance(result, RollpointError) else repr(result)
                    log.warning(
                        "resume of %s after restore failed (%s); its lease reopens it",
                        client.label,
                        detail,
                    )


def _named(
    participants: list[ParticipantClient], manifest: SnapshotManifest
) -> list[ParticipantClient]:
    """The participants the snapshot holds state for (one per kind and replica)."""
    named = {(p.kind, p.replica) for p in manifest.participants}
    return [p for p in participants if (p.address.kind, p.address.replica) in named]


def _check_cut(manifest: SnapshotManifest, ledger: RecoveryLedger) -> None:
    """The saved ledger's in-flight tries must be exactly the snapshot's saved, restarted
    and finished episodes, each on the same replica."""
    in_ledger = {f"{r.rollout_id}#{r.attempt}": r.replica for r in ledger.in_flight()}
    listed: dict[str, str] = {}
    for group in (manifest.episodes, manifest.restarts, manifest.finished):
        for e in group:
            listed[f"{e.rollout_id}#{e.attempt}"] = e.replica
    only_ledger = sorted(f"{k} on {v}" for k, v in in_ledger.items() if k not in listed)
    only_manifest = sorted(f"{k} on {v}" for k, v in listed.items() if k not in in_ledger)
    moved = sorted(
        f"{k} (ledger {in_ledger[k]}, manifest {v})"
        for k, v in listed.items()
        if k in in_ledger and in_ledger[k] != v
    )
    problems = []
    if only_ledger:
        problems.append(f"in flight in the ledger but not saved: {_names(only_ledger)}")
    if only_manifest:
        problems.append(f"saved but not in flight in the ledger: {_names(only_manifest)}")
    if moved:
        problems.append(f"on another replica: {_names(moved)}")
    if problems:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} does not match its ledger: {'; '.join(problems)}"
        )


def _cut_back(train_data: Path, size: int) -> None:
    """Forget what was trained after the checkpoint: those rollouts are back in TQ."""
    if not train_data.exists():
        if size:
            raise RestoreError(
                f"{train_data} is missing but the train checkpoint says it held {size} bytes"
            )
        return
    actual = train_data.stat().st_size
    if actual < size:
        raise RestoreError(
            f"{train_data} holds {actual} bytes but the train checkpoint says {size}: it was truncated"
        )
    if actual > size:
        with train_data.open("r+b") as out:
            out.truncate(size)
            out.flush()
            os.fsync(out.fileno())
