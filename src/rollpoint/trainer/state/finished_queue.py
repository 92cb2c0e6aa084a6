"""The finished queue: sealed rollouts waiting for training, by whole group (``tq.json`` in a
snapshot, its on-disk name, kept).

Owns every sealed reply from the moment it is sealed until the train checkpoint that
consumed it is durable, like a consumer offset commit:

    put ──▶ partial group ──(all rows sealed)──▶ ready ──take_groups──▶ consumed ──commit──▶ gone

A consumed group is kept until :meth:`FinishedQueue.commit` names a train step at or
after the one that took it, so a snapshot taken between a take and its commit still
holds it (:meth:`FinishedQueue.uncommitted_consumed`), and a restore that composes the
snapshot with an older train checkpoint puts it back (:meth:`FinishedQueue.rewind`).
It does not seal (the trainer seals in the ledger, then puts here) and does not compute
advantages (:mod:`..grpo`).

A snapshot takes :meth:`FinishedQueue.capture` while rollouts are paused (references
only: replies are immutable) and encodes it after they resume, as records
(:meth:`FinishedQueueCapture.as_records`, joined back by :func:`finished_queue_document_from_records`): a header, one
record per partial reply, one per ready or consumed group. A group's record is made once
per state and is the same object in every snapshot while the group waits, so the store
references where it was first written (:mod:`rollpoint.store.trainer_records`).

Schema history of the document (:meth:`FinishedQueue.to_document`): **1**, current.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field

from rollpoint.protocol.episode import RunReply
from rollpoint.protocol.errors import (
    BadRequestError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
)
from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.manifest import Migration, load_versioned
from rollpoint.protocol.model_base import StrictModel

TQ_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class GroupBatch:
    """Every row of one prompt group, in row order: the unit the finished queue hands to training."""

    group_id: str
    replies: tuple[RunReply, ...]
    _records: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)
    """Its snapshot record, by the train step that consumed it (0: ready): made once."""

    @property
    def size(self) -> int:
        return len(self.replies)

    def record(self, train_step: int) -> dict[str, Any]:
        """This group's snapshot record, ready (``train_step`` 0) or consumed by a step."""
        found = self._records.get(train_step)
        if found is None:
            doc = _batch_doc(self)
            if train_step:
                found = {
                    "consumed": orjson.Fragment(orjson.dumps({**doc, "train_step": train_step}))
                }
            else:
                found = {"ready": orjson.Fragment(orjson.dumps(doc))}
            self._records[train_step] = found
        return found


class FinishedQueue:
    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        """Every group the finished queue still has to do with (expected, partial, ready or consumed)."""
        self._partial: dict[str, dict[int, RunReply]] = {}
        self._ready: deque[GroupBatch] = deque()
        self._ready_ids: set[str] = set()
        self._ready_rollouts = 0
        self._consumed: dict[str, tuple[int, GroupBatch]] = {}
        self._committed_step = 0
        self._last_take_step = 0

    # --- filling ---------------------------------------------------------------------

    def expect_group(self, group_id: str, group_size: int) -> None:
        """Declare a group the finished queue will receive ``group_size`` sealed rows of."""
        if group_size < 1:
            raise BadRequestError(f"finished queue: group {group_id}: group_size must be >= 1")
        known = self._sizes.setdefault(group_id, group_size)
        if known != group_size:
            raise BadRequestError(
                f"finished queue: group {group_id} has {known} rows, not {group_size}"
            )

    def put(self, reply: RunReply) -> bool:
        """Hold one sealed reply; True when its group just became trainable."""
        gid = reply.group_id
        size = self._sizes.get(gid)
        if size is None:
            raise NotFoundError(
                f"finished queue: group {gid} was never expected (or is already trained)"
            )
        if not 0 <= reply.row < size:
            raise BadRequestError(
                f"finished queue: row {reply.row} of {gid} is outside 0..{size - 1}"
            )
        if gid in self._ready_ids or gid in self._consumed:
            raise InvalidPhaseError(
                f"finished queue: group {gid} is complete; {reply.episode} would train twice"
            )
        rows = self._partial.setdefault(gid, {})
        if reply.row in rows:
            raise InvalidPhaseError(
                f"finished queue: row {reply.row} of {gid} is already held ({rows[reply.row].episode}); "
                f"{reply.episode} would train twice"
            )
        rows[reply.row] = reply
        if len(rows) < size:
            return False
        del self._partial[gid]
        self._push_ready(GroupBatch(gid, tuple(rows[row] for row in range(size))), left=False)
        return True

    def drop_group(self, group_id: str) -> int:
        """Forget a group that failed: it will never be trained. Returns rollouts dropped."""
        if group_id in self._consumed:
            raise InvalidPhaseError(
                f"finished queue: group {group_id} was already taken for training"
            )
        dropped = len(self._partial.pop(group_id, {}))
        if group_id in self._ready_ids:
            batch = next(b for b in self._ready if b.group_id == group_id)
            self._ready.remove(batch)
            self._ready_ids.discard(group_id)
            self._ready_rollouts -= batch.size
            dropped += batch.size
        self._sizes.pop(group_id, None)
        return dropped

    # --- training --------------------------------------------------------------------

    def take_groups(self, max_rollouts: int, *, train_step: int) -> list[GroupBatch]:
        """Take ready groups, oldest first, until they hold ``max_rollouts`` rollouts.

        Whole groups only, so the count rounds up; at least one group when any is ready,
        none otherwise. The groups stay held (consumed) until ``commit(train_step)``.
        """
        if max_rollouts < 1:
            raise BadRequestError(f"finished queue: max_rollouts must be >= 1, got {max_rollouts}")
        if train_step <= self._committed_step or train_step < self._last_take_step:
            raise InvalidPhaseError(
                f"finished queue: train step {train_step} is behind (committed {self._committed_step}, "
                f"last taken {self._last_take_step})"
            )
        taken: list[GroupBatch] = []
        count = 0
        while self._ready and count < max_rollouts:
            batch = self._ready.popleft()
            self._ready_ids.discard(batch.group_id)
            self._ready_rollouts -= batch.size
            self._consumed[batch.group_id] = (train_step, batch)
            taken.append(batch)
            count += batch.size
        if taken:
            self._last_take_step = train_step
        return taken

    def commit(self, train_step: int) -> int:
        """The train checkpoint of ``train_step`` is durable: what it (and earlier steps)
        consumed leaves the finished queue for good. Returns how many rollouts left."""
        if train_step < self._committed_step:
            raise InvalidPhaseError(
                f"finished queue: commit of step {train_step} is behind the committed step "
                f"{self._committed_step}"
            )
        self._committed_step = train_step
        gone = [gid for gid, (step, _) in self._consumed.items() if step <= train_step]
        left = 0
        for gid in gone:
            left += self._consumed.pop(gid)[1].size
            self._sizes.pop(gid, None)
        return left

    def uncommitted_consumed(self) -> list[GroupBatch]:
        """Groups taken for training whose train checkpoint is not durable yet."""
        return [batch for _, batch in self._consumed.values()]

    def rewind(self, committed_step: int) -> int:
        """Compose with the train checkpoint of ``committed_step`` (after a restore).

        Groups consumed by that step or earlier are durable and leave; groups consumed
        later go back to the front of the ready queue, in the order they were taken.
        Returns how many rollouts went back.
        """
        if committed_step < self._committed_step:
            raise InvalidCheckpointStateError(
                f"finished queue: train step {committed_step} is older than the step {self._committed_step} "
                "this finished queue already committed: the rollouts in between are gone"
            )
        self.commit(committed_step)
        back = [batch for _, batch in self._consumed.values()]
        self._consumed.clear()
        self._last_take_step = self._committed_step
        for batch in reversed(back):
            self._push_ready(batch, left=True)
        return sum(b.size for b in back)

    # --- state -----------------------------------------------------------------------

    @property
    def ready_rollouts(self) -> int:
        return self._ready_rollouts

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def committed_step(self) -> int:
        return self._committed_step

    def counts(self) -> dict[str, int]:
        return {
            "partial_groups": len(self._partial),
            "partial_rollouts": sum(len(rows) for rows in self._partial.values()),
            "ready_groups": len(self._ready),
            "ready_rollouts": self._ready_rollouts,
            "consumed_groups": len(self._consumed),
            "consumed_rollouts": sum(b.size for _, b in self._consumed.values()),
            "committed_step": self._committed_step,
        }

    def _push_ready(self, batch: GroupBatch, *, left: bool) -> None:
        if left:
            self._ready.appendleft(batch)
        else:
            self._ready.append(batch)
        self._ready_ids.add(batch.group_id)
        self._ready_rollouts += batch.size

    # --- document --------------------------------------------------------------------

    def capture(self) -> FinishedQueueCapture:
        """The finished queue frozen at this instant: references to its (immutable) replies, nothing encoded."""
        return FinishedQueueCapture(
            committed_step=self._committed_step,
            last_take_step=self._last_take_step,
            groups=dict(self._sizes),
            partial=tuple(r for rows in self._partial.values() for r in rows.values()),
            ready=tuple(self._ready),
            consumed=tuple(self._consumed.values()),
        )

    def to_document(self) -> dict[str, Any]:
        return self.capture().to_document()

    @classmethod
    def from_document(
        cls, doc: dict[str, Any], *, what: str = "the finished queue"
    ) -> FinishedQueue:
        parsed = load_versioned(doc, TQDocument, TQ_MIGRATIONS, TQ_SCHEMA_VERSION, what)
        finished_queue = cls()
        finished_queue._committed_step = parsed.committed_step
        finished_queue._last_take_step = parsed.last_take_step
        for gid, size in parsed.groups.items():
            finished_queue.expect_group(gid, size)
        try:
            for reply in parsed.partial:
                if finished_queue.put(reply):
                    raise InvalidCheckpointStateError(
                        f"{what}: partial group {reply.group_id} is complete"
                    )
            for ready in parsed.ready:
                finished_queue._push_ready(finished_queue._check_batch(ready, what), left=False)
            for consumed in parsed.consumed:
                finished_queue._consumed[consumed.group_id] = (
                    consumed.train_step,
                    finished_queue._check_batch(consumed, what),
                )
        except (BadRequestError, NotFoundError, InvalidPhaseError) as exc:
            raise InvalidCheckpointStateError(f"{what}: {exc.message}") from None
        return finished_queue

    def _check_batch(self, doc: BatchDoc, what: str) -> GroupBatch:
        size = self._sizes.get(doc.group_id)
        rows = [r.row for r in doc.replies]
        if size is None or rows != list(range(size)):
            raise InvalidCheckpointStateError(
                f"{what}: group {doc.group_id} is not whole: rows {rows}"
            )
        if (
            doc.group_id in self._partial
            or doc.group_id in self._ready_ids
            or doc.group_id in self._consumed
        ):
            raise InvalidCheckpointStateError(f"{what}: group {doc.group_id} appears twice")
        if any(r.group_id != doc.group_id for r in doc.replies):
            raise InvalidCheckpointStateError(
                f"{what}: group {doc.group_id} holds another group's reply"
            )
        return GroupBatch(doc.group_id, tuple(doc.replies))


@dataclass(frozen=True, slots=True)
class FinishedQueueCapture:
    """What :meth:`FinishedQueue.capture` took; encoding it may happen in another thread."""

    committed_step: int
    last_take_step: int
    groups: dict[str, int]
    partial: tuple[RunReply, ...]
    ready: tuple[GroupBatch, ...]
    consumed: tuple[tuple[int, GroupBatch], ...]

    def to_document(self) -> dict[str, Any]:
        return {
            "schema_version": TQ_SCHEMA_VERSION,
            "committed_step": self.committed_step,
            "last_take_step": self.last_take_step,
            "groups": dict(self.groups),
            "partial": [r.model_dump(mode="json") for r in self.partial],
            "ready": [_batch_doc(b) for b in self.ready],
            "consumed": [{**_batch_doc(b), "train_step": step} for step, b in self.consumed],
        }

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_document())

    def as_records(self) -> list[dict[str, Any]]:
        """The document as snapshot records (:func:`finished_queue_document_from_records` joins them)."""
        header = {
            "schema_version": TQ_SCHEMA_VERSION,
            "committed_step": self.committed_step,
            "last_take_step": self.last_take_step,
            "groups": dict(self.groups),
        }
        records: list[dict[str, Any]] = [header]
        records += [{"partial": r.model_dump(mode="json")} for r in self.partial]
        records += [batch.record(0) for batch in self.ready]
        records += [batch.record(step) for step, batch in self.consumed]
        return records


_LISTS = frozenset({"partial", "ready", "consumed"})


def finished_queue_document_from_records(
    records: list[dict[str, Any]], what: str
) -> dict[str, Any]:
    """The finished queue document :meth:`FinishedQueueCapture.as_records` were made of, to load as any saved
    document; a record of another shape is an :class:`InvalidCheckpointStateError`."""
    if not records or "schema_version" not in records[0]:
        raise InvalidCheckpointStateError(
            f"{what}: its first record is not the finished queue's header"
        )
    doc: dict[str, Any] = {**records[0], "partial": [], "ready": [], "consumed": []}
    for number, record in enumerate(records[1:], start=2):
        key = next(iter(record), None) if len(record) == 1 else None
        if key not in _LISTS or not isinstance(record[key], dict):
            raise InvalidCheckpointStateError(
                f"{what}: record {number} is not a finished queue record"
            )
        doc[key].append(record[key])
    return doc


def _batch_doc(batch: GroupBatch) -> dict[str, Any]:
    return {
        "group_id": batch.group_id,
        "replies": [r.model_dump(mode="json") for r in batch.replies],
    }


NonNegativeInt = Annotated[int, Field(ge=0)]


class BatchDoc(StrictModel):
    group_id: Identifier
    replies: list[RunReply]


class ConsumedDoc(BatchDoc):
    train_step: Annotated[int, Field(ge=1)]


class TQDocument(StrictModel):
    """Schema 1 of the finished queue document."""

    schema_version: Literal[1]
    committed_step: NonNegativeInt
    last_take_step: NonNegativeInt
    groups: dict[Identifier, Annotated[int, Field(ge=1)]]
    partial: list[RunReply]
    ready: list[BatchDoc]
    consumed: list[ConsumedDoc]


TQ_MIGRATIONS: dict[int, Migration] = {}
