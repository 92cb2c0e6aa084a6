"""The resume point: which snapshot a restore starts from (docs/design.md#the-restore-order,
step 1).

Owns picking it (:func:`find_resume_point`): the newest published snapshot that composes
with a durable step of the trainer's record (the finished queue's committed step ≤
checkpoint step ≤ the snapshot's train step). A corrupt, partial or tampered snapshot (a
file or a sealed field that does not match, or a train step, policy version or committed
step that disagrees with its ``trainer.json`` / ``tq.json``) is skipped for the previous
one, the reason kept for the console (:class:`Skipped`). What it picked is a
:class:`ResumePoint`: the manifest, the checkpoint and the trainer's documents read once.
Also owns reading those documents back (:func:`read_trainer_document`), whichever form
they were kept in.

Does not own: what to do when no snapshot is usable (the job's), nor putting anything
back (:class:`~rollpoint.trainer.restore.restorer.Restorer`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from rollpoint.protocol.errors import InvalidCheckpointStateError, RestoreError, RollpointError
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.snapshot.publication import (
    FINISHED_QUEUE_FILE,
    LEDGER_FILE,
    TRAINER_FILE,
)
from rollpoint.trainer.state.finished_queue import finished_queue_document_from_records
from rollpoint.trainer.state.ledger_document import document_from_records
from rollpoint.trainer.step_record import StepRecord
from rollpoint.tuning.collector_pause import collector_paused

log = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """A snapshot and the train checkpoint it composes with."""

    manifest: SnapshotManifest
    checkpoint: TrainCheckpoint
    ledger_doc: dict[str, Any]
    finished_queue_doc: dict[str, Any]
    trainer_doc: dict[str, Any]


@dataclass(frozen=True)
class Skipped:
    """A snapshot the restore could not use, and why (shown on the console)."""

    snapshot_id: str
    reason: str

    def line(self) -> str:
        return f"skipping snapshot {self.snapshot_id}: {self.reason}"


def find_resume_point(
    store: SnapshotStore, step_record: StepRecord
) -> tuple[ResumePoint | None, list[Skipped]]:
    """The newest usable snapshot that composes with a durable step of ``step_record``
    (or None), and every newer snapshot skipped on the way, with the reason."""
    available = step_record.available()
    skipped: list[Skipped] = []
    try:
        summaries = store.list_snapshots(include_invalid=True)
    except OSError as exc:
        raise RestoreError(
            f"cannot read the snapshot store {store.root}: {exc.strerror or exc}; "
            "fix its permissions or mount, then rerun (nothing was changed)"
        ) from None
    for summary in summaries:
        sid = summary.snapshot_id
        if not summary.valid:
            skipped.append(Skipped(sid, summary.reason or "unusable"))
            continue
        try:
            manifest = store.verify(sid)
            ledger_doc = read_trainer_document(store, sid, LEDGER_FILE)
            finished_queue_doc = read_trainer_document(store, sid, FINISHED_QUEUE_FILE)
            trainer_doc = orjson.loads(store.read_file(sid, TRAINER_FILE))
            committed = int(finished_queue_doc.get("committed_step", 0))
            _cross_check(manifest, trainer_doc, committed)
        except (RollpointError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
            detail = exc.message if isinstance(exc, RollpointError) else str(exc)
            skipped.append(Skipped(sid, detail))
            continue
        for checkpoint in available:
            if committed <= checkpoint.step <= manifest.train_step:
                return ResumePoint(
                    manifest, checkpoint, ledger_doc, finished_queue_doc, trainer_doc
                ), skipped
        steps = ", ".join(str(c.step) for c in available)
        skipped.append(
            Skipped(
                sid,
                f"no train checkpoint between its committed step {committed} and its "
                f"train step {manifest.train_step} (checkpoints: {steps})",
            )
        )
    return None, skipped


def read_trainer_document(store: SnapshotStore, snapshot_id: str, name: str) -> dict[str, Any]:
    """The ledger's or the finished queue's document in a snapshot, kept as a document or as records."""
    what = f"{name} of snapshot {snapshot_id}"
    if store.file_format(snapshot_id, name) == "records":
        join = (
            document_from_records if name == LEDGER_FILE else finished_queue_document_from_records
        )
        with collector_paused():  # as for a document: millions of cycle-free records
            records = store.read_records(snapshot_id, name)
        return join(records, what)
    data = store.read_file(snapshot_id, name)
    with collector_paused():  # the ledger decodes into millions of objects
        doc = orjson.loads(data)
    if not isinstance(doc, dict):
        raise InvalidCheckpointStateError(f"{what} is not a JSON object")
    return doc


def choose_resume_point(store: SnapshotStore, step_record: StepRecord) -> ResumePoint | None:
    """:func:`find_resume_point`, the skipped snapshots logged as warnings."""
    point, skipped = find_resume_point(store, step_record)
    for item in skipped:
        log.warning("%s", item.line())
    return point


def _cross_check(manifest: SnapshotManifest, trainer_doc: Any, committed: int) -> None:
    """The fields the restore trusts, against the digest-checked trainer files they were
    copied from: a manifest that disagrees names the field (an unsealed, older manifest
    is caught here too)."""
    if not isinstance(trainer_doc, dict):
        raise InvalidCheckpointStateError(
            f"{TRAINER_FILE} of snapshot {manifest.snapshot_id} is not an object"
        )
    pairs = [
        ("train_step", manifest.train_step, trainer_doc.get("train_step"), TRAINER_FILE),
        (
            "policy_version",
            manifest.policy_version,
            trainer_doc.get("policy_version"),
            TRAINER_FILE,
        ),
    ]
    if manifest.committed_step is not None:
        pairs.append(("committed_step", manifest.committed_step, committed, FINISHED_QUEUE_FILE))
    for name, in_manifest, in_file, file_name in pairs:
        if in_manifest != in_file:
            raise InvalidCheckpointStateError(
                f"manifest field '{name}' is {in_manifest} but {file_name} says {in_file!r} "
                "(tampered or corrupt)"
            )
