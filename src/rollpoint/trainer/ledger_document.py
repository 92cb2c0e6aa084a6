"""The on-disk shape of the recovery ledger, its schema versions and their migrations.

Owns the pydantic models a saved ledger is validated against and the step from each older
schema to the next; :meth:`rollpoint.trainer.ledger.RecoveryLedger.from_document` loads
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
- **2**: current; live tries in ``records``, final ones in ``archived`` as a list of
  chunks of ``[state, group_id, row, rollout_id, attempt, replica, tries]``.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any, Literal

from pydantic import Field

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.manifest import Migration
from rollpoint.protocol.model_base import StrictModel

LEDGER_SCHEMA_VERSION = 2
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
    failed: str | None


class LedgerDocument(StrictModel):
    """Schema 2 of the ledger document."""

    schema_version: Literal[2]
    tasks: dict[str, TaskRow]
    groups: dict[str, LedgerGroupDoc]
    records: list[LedgerRecordDoc]
    """Live tries (not final)."""
    archived: list[list[ArchivedTry]]
    """Final tries in chunks (the ledger keeps full chunks unchanged between saves)."""


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


LEDGER_MIGRATIONS: dict[int, Migration] = {1: _ledger_v1_to_v2}
