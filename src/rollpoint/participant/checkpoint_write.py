"""One participant's commit writes: each checkpoint's state captured once and written once.

Owns :class:`CheckpointWrite` (a checkpoint's capture task, its write task, the captured
records until a write succeeds, the manifest after) and :class:`CheckpointWrites`, the last
:data:`REMEMBERED_WRITES` of them by checkpoint id: what ``commit`` captures and what
``confirm`` finds after the checkpoint resumed. A capture is the participant's ``export``
(or, for a :class:`~rollpoint.participant.participant.CapturingParticipant`, its ``capture``: a
copy taken in the pause, and a function that builds the records from it) and the reply;
a write builds the records if the capture left that for later, then encodes, hashes and
stores them in a worker thread
(:func:`rollpoint.store.participant_state.write_participant_state`).

Memory stays bounded: before a new capture, an earlier write still running is awaited and
an earlier capture nobody asked to write (its checkpoint was aborted) is dropped, so at most
one checkpoint's records wait in memory. The captured records are written after the
participant moved on, so exports hand out records nobody changes afterwards.

It does not decide whether a commit or confirm is legal (phase, ids, readiness, lease: the
fence does, :mod:`rollpoint.participant.fence`), what a record holds (the participant's export), or
the file format (:mod:`rollpoint.store.participant_state`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import JsonValue

from rollpoint.participant.episode_scope import EpisodeScope
from rollpoint.participant.participant import CapturingParticipant, Participant, await_hook
from rollpoint.participant.ready_queue import FrontTask
from rollpoint.protocol.control import CommitReply, Phase
from rollpoint.protocol.errors import DeadlineExceededError, SnapshotError
from rollpoint.protocol.manifest import JournalMark, ParticipantManifest
from rollpoint.store.participant_state import write_participant_state
from rollpoint.store.record_packs import PackIndex
from rollpoint.tuning.collector_pause import collector_paused

log = logging.getLogger(__name__)

T = TypeVar("T")

REMEMBERED_WRITES = 8
"""Commits kept (by checkpoint id) for ``confirm`` after their checkpoint resumed."""


@dataclass
class CheckpointWrite:
    """One checkpoint's commit: captured once, then written until a write succeeds.

    The capture (the export, and the reply built from it) is what a commit waits for; the
    write encodes, hashes and stores the captured records. A commit that does not wait
    for the write lets the checkpoint resume first, and ``confirm`` collects the manifest.
    """

    checkpoint_id: str
    checkpoint_dir: str
    """As the request named it (relative to the snapshot root)."""
    directory: str
    """The participant's own folder, resolved inside the snapshot root."""
    scope: EpisodeScope
    capture: FrontTask[CommitReply] | None = None
    """Its first step, and a commit's wake-up once it is done, run ahead of the data plane
    (:mod:`rollpoint.participant.ready_queue`): the capture is inside the pause."""
    store: asyncio.Task[ParticipantManifest] | None = None
    records: list[dict[str, JsonValue]] | None = None
    """Kept from the export until a write succeeds, so a failed write is tried again
    without exporting again (the participant has moved on since)."""
    build: Callable[[], list[dict[str, JsonValue]]] | None = None
    """What a :class:`CapturingParticipant`'s capture returned: makes ``records`` in the
    writer's thread, after the pause."""
    manifest: ParticipantManifest | None = None
    exported: dict[str, int | None] | None = None
    """The scoped episodes the written records hold (:func:`exported`), made with the
    write: after the pause, where a scan of every record costs the cut nothing."""
    journal: JournalMark | None = None
    """The participant's journal position when the cut opened, saved in the manifest (a
    journal-mode checkpoint saves its floor there instead)."""
    position: JournalMark | None = None
    """A journal-mode checkpoint's journal position as it was taken (its reply's)."""

    @property
    def key(self) -> tuple[str, frozenset[str]]:
        """What makes a retry the same commit: the folder and the scope as a set."""
        return self.directory, self.scope.key_set

    @property
    def capturing(self) -> bool:
        """A capture is running or has succeeded (a failed one may be started again)."""
        return self.capture is not None and not failed(self.capture.task)


class CheckpointWrites:
    """The commits of one participant, by checkpoint id, newest last."""

    def __init__(
        self,
        participant: Participant,
        instance: str,
        clock: Callable[[], float],
        *,
        root: str | None = None,
    ) -> None:
        """``root``: the snapshot root every write stays inside, checked as each file is
        opened (:mod:`rollpoint.store.contained_filesystem`)."""
        self._participant = participant
        self._root = root
        self._index = PackIndex()
        """Where this participant's last write put each record: the next writes only what
        changed (:mod:`rollpoint.store.record_packs`)."""
        self._instance = instance
        self._clock = clock
        self._writes: OrderedDict[str, CheckpointWrite] = OrderedDict()

    def get(self, checkpoint_id: str) -> CheckpointWrite | None:
        return self._writes.get(checkpoint_id)

    def start_capture(self, write: CheckpointWrite) -> None:
        """Remember ``write`` (forgetting the oldest past :data:`REMEMBERED_WRITES`) and
        start its capture."""
        self._writes[write.checkpoint_id] = write
        while len(self._writes) > REMEMBERED_WRITES:
            self._writes.popitem(last=False)
        write.capture = FrontTask(self._capture(write))
        write.capture.task.add_done_callback(_log_failure)

    async def captured(self, write: CheckpointWrite, deadline_ts: float, what: str) -> CommitReply:
        """The capture's reply (``manifest`` None), by the deadline."""
        assert write.capture is not None, "a write is captured only once started"
        try:
            return await write.capture.result(max(deadline_ts - self._clock(), 0.0))
        except TimeoutError:
            raise DeadlineExceededError(f"{what}: the capture outlived the deadline") from None

    async def stored(
        self, write: CheckpointWrite, deadline_ts: float, what: str
    ) -> ParticipantManifest:
        """The written state's manifest, by the deadline; starts the write if none is
        running (none started yet, or the last one failed)."""
        if write.store is None or failed(write.store):
            write.store = asyncio.create_task(self._store(write))
            write.store.add_done_callback(_log_failure)
        late = f"{what}: the write outlived the deadline; it goes on, and a retry collects it"
        return await self._by_deadline(write.store, deadline_ts, late)

    async def _capture(self, write: CheckpointWrite) -> CommitReply:
        p = self._participant
        for cid, earlier in list(self._writes.items()):
            if earlier is write:
                continue
            if earlier.store is None:
                del self._writes[cid]  # captured for a checkpoint that was aborted
            elif not earlier.store.done():
                await asyncio.wait([earlier.store])
        # An export allocates containers for every record while the process holds every
        # session: full collections on the way walked that whole heap (profiled at 10k
        # sessions: most of a commit's seconds).
        with collector_paused():
            if write.records is None and write.build is None:
                if isinstance(p, CapturingParticipant):
                    write.build = await await_hook("capture", p.capture(write.scope), SnapshotError)
                else:
                    write.records = await await_hook("export", p.export(write.scope), SnapshotError)
        return CommitReply(
            phase=Phase.COMMITTED,
            checkpoint_id=write.checkpoint_id,
            checkpoint_dir=write.checkpoint_dir,
            state_dir=f"{p.kind.value}/{self._instance}",
            scope_size=len(write.scope),
            manifest=None,
            exported=None,  # made with the write, after the pause (a scan of every record)
        )

    async def _store(self, write: CheckpointWrite) -> ParticipantManifest:
        if write.manifest is not None:
            return write.manifest
        if write.records is None:
            assert write.build is not None, "a write is stored only once captured"
            built = asyncio.to_thread(_built, write.build)
            write.records = await await_hook("records from the capture", built, SnapshotError)
            write.build = None
        records = write.records
        store = asyncio.to_thread(
            write_participant_state,
            write.directory,
            kind=self._participant.kind.value,
            instance=self._instance,
            checkpoint_id=write.checkpoint_id,
            records=records,
            root=self._root,
            index=self._index,
            journal=write.journal,
        )
        manifest = await await_hook("state write", store, SnapshotError)
        write.exported = await asyncio.to_thread(exported, records, write.scope)
        write.manifest = manifest
        write.records = None  # written: the manifest and map are all a retry or confirm needs
        return manifest

    async def _by_deadline(self, task: asyncio.Task[T], deadline_ts: float, late: str) -> T:
        """``task``'s result, or :class:`DeadlineExceededError` (``late``) at the deadline;
        the task goes on either way, so a retry awaits the same work."""
        if not task.done():
            try:
                async with asyncio.timeout(max(deadline_ts - self._clock(), 0.0)):
                    await asyncio.shield(task)
            except TimeoutError:
                raise DeadlineExceededError(late) from None
        return task.result()


def exported(records: list[dict[str, JsonValue]], scope: EpisodeScope) -> dict[str, int | None]:
    """The scoped episodes the records hold state for, by the records' top-level ``episode``:
    episode key → the record's top-level ``turn`` (None without one).

    This is what lets the coordinator check saved + restarts against its ledger without
    reading any participant's records.
    """
    wanted = scope.key_set
    found: dict[str, int | None] = {}
    for record in records:
        raw = record.get("episode")
        if not isinstance(raw, dict):
            continue
        key = f"{raw.get('rollout_id')}#{raw.get('attempt')}"
        if key in wanted and key not in found:
            turn = record.get("turn")
            found[key] = turn if isinstance(turn, int) else None
    return {k: found[k] for k in sorted(found)}


def _built(build: Callable[[], list[dict[str, JsonValue]]]) -> list[dict[str, JsonValue]]:
    # Tens of thousands of new lists and no cycles among them: see collector_pause.
    with collector_paused():
        return build()


def failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


def _log_failure(task: asyncio.Task[Any]) -> None:
    # A capture or write nobody awaits any more (its commit hit the deadline) must not log
    # "exception was never retrieved"; its failure is reported to the next commit or confirm.
    if not task.cancelled() and task.exception() is not None:
        log.warning("checkpoint write failed: %s", task.exception())
