"""The publication: what a save writes once the pause is over, and its manifest, last.

Owns the writes of step 8 of the save order (docs/design.md#the-save-order): the trainer's
files (:data:`LEDGER_FILE` and :data:`FINISHED_QUEUE_FILE`, kept as records so each write
adds only what changed since the previous one, and :data:`TRAINER_FILE`), written while
every participant whose commit listed ``detached-write`` writes what it captured; the
confirm of each such write (a confirm lost on the wire is sent once more: it is
idempotent); and the manifest, assembled from the cut and the participants' statuses and
published by the store last. A write that fails fails the save: nothing is published.

It does not sort the cut's tries (:meth:`~rollpoint.trainer.snapshot.cut.Cut.classify`),
nor decide what a failed write does to the run
(:class:`~rollpoint.trainer.snapshot.coordinator.SnapshotCoordinator`), nor lay out the
files (:mod:`rollpoint.store`).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from pydantic import JsonValue

from rollpoint.protocol.control import Verb
from rollpoint.protocol.errors import RollpointError, TransportError
from rollpoint.protocol.manifest import FileEntry, SnapshotManifest
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.store.record_packs import PackIndex
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.snapshot.control_calls import blocker, by_deadline
from rollpoint.trainer.snapshot.cut import Blocker, Cut, SaveBlocked, SavePhase
from rollpoint.trainer.snapshot.participant_statuses import ParticipantStatuses

__all__ = ["FINISHED_QUEUE_FILE", "LEDGER_FILE", "TRAINER_FILE", "Publication"]

LEDGER_FILE = "ledger.json"
FINISHED_QUEUE_FILE = "tq.json"
TRAINER_FILE = "trainer.json"


class Publication:
    """Writes one coordinator's saves after their pause and publishes their manifests."""

    def __init__(
        self,
        store: SnapshotStore,
        statuses: ParticipantStatuses,
        config_fingerprint: dict[str, JsonValue],
    ) -> None:
        self._store = store
        self._statuses = statuses
        self._config_fingerprint = config_fingerprint
        self._indexes = {LEDGER_FILE: PackIndex(), FINISHED_QUEUE_FILE: PackIndex()}
        """Where each trainer file's last write put its records (snapshot_growth)."""
        self.newest: SnapshotManifest | None = None
        """The newest manifest this publication wrote (set by the thread that publishes)."""

    @property
    def damaged_records_files(self) -> int:
        """Trainer records files found damaged before a snapshot named them again."""
        return sum(index.damaged for index in self._indexes.values())

    async def write(self, cut: Cut, deadline_s: float) -> dict[str, FileEntry]:
        """The trainer's files, written while the participants finish writing what their
        commits captured; :class:`SaveBlocked` names every write that failed."""
        written = asyncio.ensure_future(asyncio.to_thread(self._write_trainer_files, cut))
        failed = await self._confirm_all(cut, deadline_s)
        try:
            files = await written
        except (RollpointError, OSError) as exc:
            failed.insert(0, blocker(None, SavePhase.WRITE, exc))
        if failed:
            raise SaveBlocked(failed)
        return files

    async def _confirm_all(self, cut: Cut, deadline_s: float) -> list[Blocker]:
        """Wait for every detached write; one line per participant whose write failed.

        A confirm lost on the wire (or answered with garbage) is sent once more before the
        deadline: confirm is idempotent (every confirm of a checkpoint gets the same reply),
        and at 100k sessions a trainer loop stalled by a long collection can send it on a
        keep-alive connection its peer has just closed."""
        if not cut.detached:
            return []
        deadline = time.time() + deadline_s
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

    def _write_trainer_files(self, cut: Cut) -> dict[str, FileEntry]:
        assert cut.ledger is not None and cut.finished_queue is not None, "a cut captures both"
        # Kept as records: each write adds only what changed since the previous one.
        ledger, finished_queue = cut.ledger.as_records(), cut.finished_queue.as_records()
        return {
            LEDGER_FILE: self._store.write_records(
                cut.staging, LEDGER_FILE, ledger, self._indexes[LEDGER_FILE]
            ),
            FINISHED_QUEUE_FILE: self._store.write_records(
                cut.staging, FINISHED_QUEUE_FILE, finished_queue, self._indexes[FINISHED_QUEUE_FILE]
            ),
            TRAINER_FILE: self._store.write_file(
                cut.staging, TRAINER_FILE, orjson.dumps(cut.trainer_doc)
            ),
        }

    def publish(self, cut: Cut, files: dict[str, FileEntry], pause_s: float) -> SnapshotManifest:
        """Assemble the manifest of ``cut`` and publish it (in a thread: it writes)."""
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
            topology_fingerprint=self._statuses.fingerprint(cut.participants),
            participants=self._statuses.entries(cut.participants),
            episodes=cut.episodes,
            restarts=cut.restarts,
            finished=cut.finished,
            journaled=cut.journaled,
            files=files,
            config_fingerprint=self._config_fingerprint,
        )
        published = self._store.publish(cut.staging, manifest)
        self.newest = published
        return published
