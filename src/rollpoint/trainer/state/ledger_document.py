"""The on-disk shape of the recovery ledger, its schema versions and their migrations.

Owns the pydantic models a saved ledger is validated against and the step from each older
schema to the next; :meth:`rollpoint.trainer.state.ledger.RecoveryLedger.from_document` loads
through :func:`rollpoint.protocol.manifest.load_versioned` with them and then checks what
a schema cannot (every row has a try, no rollout id twice). Building the ledger is not
here.

Schema history:

- **1**: one flat ``records`` list in creation order, every try of every row; states
  were named ``running`` (now ``dispatched``) and ``done`` (now ``finished``); there was
  no ``tries`` count and groups had no ``failed`` reason. Migration 1 → 2 renames the
  states, numbers each row's tries by their order in the list (a version-1 writer only
  ever appended), moves sealed and retired tries to ``archived`` and sets ``failed`` to
  null (a version-1 writer did not record group failures).
- **2**: live tries in ``records``, final ones in ``archived`` as a list of chunks of
  ``[state, group_id, row, rollout_id, attempt, replica, tries]``.
- **3**: current. Each group names the rollout id of every row's first try
  (``rollout_ids``), and a first try nothing has happened to yet (queued, attempt 0, no
  replica) is left out of ``records``: a run that queued a million rows ahead saves none
  of them one by one. Group failures moved to their own ``failed`` map (group id →
  reason). Migration 2 → 3 reads each row's first try (``tries`` 1) from ``records`` or
  ``archived`` and moves ``failed`` out of the groups; it keeps every record as it was.

Also here: :class:`LedgerCapture`, the ledger frozen at one instant (taken while a
snapshot pauses rollouts, in O(live tries + chunks)) and its encoding into the current
schema, done after rollouts resume.

In a snapshot the document is kept as records (:meth:`LedgerCapture.as_records`, joined back
by :func:`document_from_records`): a header, one record per chunk of tasks, groups,
failures and final tries, one per live try. A full chunk's record is made once per run and
is the same object in every snapshot, so the store references where it was first written
instead of writing it again (:mod:`rollpoint.store.trainer_records`). The records join into
the document above; its schema and migrations are unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

import orjson
from pydantic import Field, model_validator

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.manifest import Migration
from rollpoint.protocol.model_base import StrictModel
from rollpoint.trainer.state.append_log import LogChunk

if TYPE_CHECKING:
    from rollpoint.trainer.state.ledger_record import LedgerRecord

LEDGER_SCHEMA_VERSION = 3
_ARCHIVED = frozenset({"sealed", "retired"})

NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
LiveState = Literal["queued", "dispatched", "finished", "abandoned"]
ArchivedState = Literal["sealed", "retired"]


ArchivedTry = tuple[
    ArchivedState,
    Identifier,
    NonNegativeInt,
    Identifier,
    NonNegativeInt,
    Identifier | None,
    PositiveInt,
]
"""``[state, group_id, row, rollout_id, attempt, replica, tries]``."""


class LedgerRecordDoc(StrictModel):
    task_id: Identifier
    group_id: Identifier
    row: NonNegativeInt
    rollout_id: Identifier
    attempt: NonNegativeInt
    state: LiveState
    replica: Identifier | None
    tries: PositiveInt


class LedgerGroupDoc(StrictModel):
    task_id: Identifier
    group_size: PositiveInt
    rollout_ids: list[Identifier]
    """The rollout id of each row's first try, by row."""

    @model_validator(mode="after")
    def _one_first_try_per_row(self) -> LedgerGroupDoc:
        if len(self.rollout_ids) != self.group_size:
            raise ValueError(
                f"names {len(self.rollout_ids)} first tries for {self.group_size} rows"
            )
        return self


class LedgerDocument(StrictModel):
    """Schema 3 of the ledger document."""

    schema_version: Literal[3]
    tasks: dict[str, TaskRow]
    groups: dict[str, LedgerGroupDoc]
    failed: dict[str, str]
    """Failed groups and why."""
    records: list[LedgerRecordDoc]
    """Live tries, except first tries nothing has happened to (their group names them)."""
    archived: list[list[ArchivedTry]]
    """Final tries in chunks (the ledger keeps full chunks unchanged between saves)."""


TaskEntry = tuple[str, TaskRow]
GroupEntry = tuple[str, str, int, tuple[str, ...]]
"""``(group_id, task_id, group_size, first try's rollout id of each row)``."""
FailureEntry = tuple[str, str]
ArchivedEntry = tuple[str, str, int, str, int, str | None, int]
"""``(state, group_id, row, rollout_id, attempt, replica, tries)``."""


class StoredArchivedChunk(Protocol):
    """A full chunk of final tries kept out of memory
    (:class:`~rollpoint.trainer.state.final_tries.StoredChunk`)."""

    def __len__(self) -> int: ...

    @property
    def items(self) -> tuple[ArchivedEntry, ...]: ...

    def encoded(self, encode: Callable[[tuple[ArchivedEntry, ...]], bytes]) -> bytes: ...

    def record(self, make: Callable[[Any], dict[str, Any]]) -> dict[str, Any]: ...

    def json_value(self) -> object:
        """A record value the writer writes as the chunk's JSON (it refers not to the chunk)."""
        ...


ArchivedChunk = LogChunk[ArchivedEntry] | StoredArchivedChunk
"""A chunk of final tries: the open one in memory, or a stored one."""


@dataclass(frozen=True, slots=True)
class LedgerCapture:
    """The ledger at one instant, as shared immutable chunks plus its touched live tries.

    Taking one costs O(live tries + chunks) and it never changes afterwards, so the
    snapshot coordinator takes it while rollouts are paused and encodes it after they
    resume, from a worker thread, while the ledger moves on.
    """

    tasks: tuple[LogChunk[TaskEntry], ...]
    groups: tuple[LogChunk[GroupEntry], ...]
    failed: tuple[LogChunk[FailureEntry], ...]
    records: tuple[LedgerRecord, ...]
    archived: tuple[ArchivedChunk, ...]

    def to_document(self) -> dict[str, Any]:
        """The document as plain JSON-ready values at the current schema version."""
        return {
            "schema_version": LEDGER_SCHEMA_VERSION,
            "tasks": {tid: task.model_dump(mode="json") for tid, task in _items(self.tasks)},
            "groups": {entry[0]: _group_doc(entry) for entry in _items(self.groups)},
            "failed": dict(_items(self.failed)),
            "records": [_record_doc(r) for r in self.records],
            # Full chunks' item tuples are shared as they are, never copied.
            "archived": [chunk.items for chunk in self.archived],
        }

    def as_records(self) -> list[dict[str, Any]]:
        """The document as snapshot records (:func:`document_from_records` joins them).

        Each full chunk's record is made once and then handed out again as the same
        object; the live tries are one small record each.
        """
        records: list[dict[str, Any]] = [{"schema_version": LEDGER_SCHEMA_VERSION}]
        records += [chunk.record(_tasks_record) for chunk in self.tasks if len(chunk)]
        records += [chunk.record(_groups_record) for chunk in self.groups if len(chunk)]
        records += [chunk.record(_failed_record) for chunk in self.failed if len(chunk)]
        records += [chunk.record(_archived_record) for chunk in self.archived if len(chunk)]
        records += [r.snapshot_record(_try_record) for r in self.records]
        return records

    def to_bytes(self) -> bytes:
        """The document encoded as JSON (:meth:`encode_parts` joined)."""
        return b"".join(self.encode_parts())

    def encode_parts(self) -> Iterator[bytes]:
        """The JSON encoding of the document, in pieces to write one after the other.

        Every full chunk's piece is encoded once per run and then reused as it is, so a
        writer mostly copies bytes it already has (without the GIL), and no single
        buffer of the whole document is ever built.
        """
        yield b'{"schema_version":%d,"tasks":' % LEDGER_SCHEMA_VERSION
        yield from _json_object(self.tasks, _encode_tasks)
        yield b',"groups":'
        yield from _json_object(self.groups, _encode_groups)
        yield b',"failed":' + orjson.dumps(dict(_items(self.failed)))
        yield b',"records":' + orjson.dumps([_record_doc(r) for r in self.records])
        yield b',"archived":['
        for index, chunk in enumerate(self.archived):
            yield b"," if index else b""
            yield chunk.encoded(orjson.dumps)
        yield b"]}"


def _items(chunks: Iterable[LogChunk[Any] | ArchivedChunk]) -> Iterable[Any]:
    for chunk in chunks:
        yield from chunk.items


def _group_doc(entry: GroupEntry) -> dict[str, Any]:
    _, task_id, size, rollout_ids = entry
    return {"task_id": task_id, "group_size": size, "rollout_ids": list(rollout_ids)}


def _record_doc(r: LedgerRecord) -> dict[str, Any]:
    return {
        "task_id": r.task_id,
        "group_id": r.group_id,
        "row": r.row,
        "rollout_id": r.rollout_id,
        "attempt": r.attempt,
        "state": r.state.value,
        "replica": r.replica,
        "tries": r.tries,
    }


def _try_record(r: LedgerRecord) -> dict[str, Any]:
    return {"try": _record_doc(r)}


def _json_object(
    chunks: tuple[LogChunk[Any], ...], encode: Callable[[Any], bytes]
) -> Iterator[bytes]:
    """One JSON object from chunks of ``(key, …)`` entries, each chunk's members encoded once."""
    yield b"{"
    members = (chunk.encoded(encode) for chunk in chunks if len(chunk))
    for index, member in enumerate(members):
        yield b"," if index else b""
        yield member
    yield b"}"


def _encode_tasks(items: tuple[TaskEntry, ...]) -> bytes:
    # An object's members without its braces, so chunks join into one object.
    return orjson.dumps({tid: task.model_dump(mode="json") for tid, task in items})[1:-1]


def _encode_groups(items: tuple[GroupEntry, ...]) -> bytes:
    return orjson.dumps({entry[0]: _group_doc(entry) for entry in items})[1:-1]


def _tasks_record(chunk: LogChunk[TaskEntry]) -> dict[str, Any]:
    return {"tasks": orjson.Fragment(b"{" + _encode_tasks(chunk.items) + b"}")}


def _groups_record(chunk: LogChunk[GroupEntry]) -> dict[str, Any]:
    return {"groups": orjson.Fragment(b"{" + _encode_groups(chunk.items) + b"}")}


def _failed_record(chunk: LogChunk[FailureEntry]) -> dict[str, Any]:
    return {"failed": dict(chunk.items)}


def _archived_record(chunk: ArchivedChunk) -> dict[str, Any]:
    if isinstance(chunk, LogChunk):
        return {"archived": orjson.Fragment(orjson.dumps(chunk.items))}
    # A stored chunk's record is kept by the store's index while a snapshot names it: it
    # holds a value read back when a writer needs the bytes, not the bytes (final_tries).
    # Never the chunk itself: chunk -> record -> chunk would be a cycle, freed only by a
    # full collection, which the trainer schedules rarely (each open chunk's copy, ~0.4 MB,
    # then stayed: 13 KiB a row in the soak).
    return {"archived": chunk.json_value()}


_JOINED = {"tasks": "task", "groups": "group", "failed": "failed group"}
"""The document's objects a ledger's records join, and what each member is called."""


def document_from_records(records: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """The ledger document :meth:`LedgerCapture.as_records` were made of, to load as any
    saved document (its schema version checked there); a record of another shape, or a
    key two records both hold, is an :class:`InvalidCheckpointStateError` naming it."""
    if not records or "schema_version" not in records[0]:
        raise InvalidCheckpointStateError(f"{what}: its first record is not the ledger's header")
    doc: dict[str, Any] = {**records[0], "tasks": {}, "groups": {}, "failed": {}}
    doc["records"], doc["archived"] = [], []
    for number, record in enumerate(records[1:], start=2):
        if len(record) != 1:
            raise InvalidCheckpointStateError(
                f"{what}: record {number} has fields {sorted(record)}, expected one"
            )
        [(key, value)] = record.items()
        if key in _JOINED and isinstance(value, dict):
            joined = doc[key]
            twice = next((k for k in value if k in joined), None)
            if twice is not None:
                raise InvalidCheckpointStateError(
                    f"{what}: {_JOINED[key]} {twice!r} is saved twice"
                )
            joined.update(value)
        elif key == "archived" and isinstance(value, list):
            doc["archived"].append(value)
        elif key == "try" and isinstance(value, dict):
            doc["records"].append(value)
        else:
            raise InvalidCheckpointStateError(
                f"{what}: record {number} ({key!r}) is not a ledger record"
            )
    return doc


_V1_STATES = {
    "queued": "queued",
    "running": "dispatched",
    "done": "finished",
    "sealed": "sealed",
    "abandoned": "abandoned",
    "retired": "retired",
}


def _ledger_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    records = doc.pop("records")
    if not isinstance(records, list):
        raise ValueError("'records' must be a list")
    tries: Counter[tuple[Any, Any]] = Counter()
    live, archived = [], []
    for record in records:
        if not isinstance(record, dict):
            raise ValueError("every record must be an object")
        if "tries" in record:
            raise ValueError("a version 1 record has no 'tries' field")
        key = (record.get("group_id"), record.get("row"))
        tries[key] += 1
        state = _V1_STATES.get(str(record.get("state")))
        if state is None:
            raise ValueError(f"state {record.get('state')!r} is not a version 1 state name")
        migrated = {**record, "state": state, "tries": tries[key]}
        if state in _ARCHIVED:
            archived.append(
                [
                    state,
                    migrated["group_id"],
                    migrated["row"],
                    migrated["rollout_id"],
                    migrated["attempt"],
                    migrated["replica"],
                    migrated["tries"],
                ]
            )
        else:
            live.append(migrated)
    groups = doc.get("groups")
    if not isinstance(groups, dict):
        raise ValueError("'groups' must be an object")
    doc["groups"] = {gid: {**g, "failed": None} for gid, g in groups.items()}
    doc["records"] = live
    doc["archived"] = [archived]
    return doc


def _ledger_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    first: dict[tuple[Any, Any], Any] = {}
    for record in doc["records"]:
        if record["tries"] == 1:
            first[(record["group_id"], record["row"])] = record["rollout_id"]
    for chunk in doc["archived"]:
        for _, group_id, row, rollout_id, _, _, tries in chunk:
            if tries == 1:
                first[(group_id, row)] = rollout_id
    groups, failed = {}, {}
    for gid, group in doc["groups"].items():
        if group["failed"] is not None:
            failed[gid] = group["failed"]
        ids = [first.get((gid, row)) for row in range(group["group_size"])]
        missing = [row for row, rid in enumerate(ids) if rid is None]
        if missing:
            raise ValueError(f"group {gid} has no first try of rows {missing}")
        groups[gid] = {
            "task_id": group["task_id"],
            "group_size": group["group_size"],
            "rollout_ids": ids,
        }
    doc["groups"] = groups
    doc["failed"] = failed
    return doc


LEDGER_MIGRATIONS: dict[int, Migration] = {1: _ledger_v1_to_v2, 2: _ledger_v2_to_v3}
