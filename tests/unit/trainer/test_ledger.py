"""The recovery ledger: its transition table, its indices, its document and migrations."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import (
    BadRequestError,
    InvalidCheckpointStateError,
    InvalidPhaseError,
    NotFoundError,
)
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_document import LEDGER_SCHEMA_VERSION
from rollpoint.trainer.state.ledger_record import (
    TRANSITIONS,
    LedgerMove,
    LedgerRecord,
    RolloutState,
)

GOLDEN = Path(__file__).parents[2] / "golden"
S, M = RolloutState, LedgerMove


def task(task_id: str = "t1") -> TaskRow:
    return TaskRow(task_id=task_id, environment="math", prompt="What is 1 + 1?")


def record_in(ledger: RecoveryLedger, state: RolloutState, group_id: str = "g") -> LedgerRecord:
    """A fresh one-row group whose try has been driven into ``state``."""
    (record,) = ledger.add_group(task(), group_id, 1)
    rid = record.rollout_id
    if state is S.QUEUED:
        return record
    ledger.dispatch(rid, "replica-0")
    if state is S.FINISHED or state is S.SEALED:
        ledger.finish(rid)
    if state is S.SEALED:
        ledger.seal(rid)
    if state is S.ABANDONED or state is S.RETIRED:
        ledger.abandon(rid)
    if state is S.RETIRED:
        ledger.retire(rid)
    return ledger.get(rid)


def apply(ledger: RecoveryLedger, rollout_id: str, move: LedgerMove) -> LedgerRecord:
    if move is M.DISPATCH:
        return ledger.dispatch(rollout_id, "replica-0")
    if move is M.PIN:
        return ledger.pin(rollout_id, "replica-1")
    if move is M.ABANDON:
        ledger.abandon(rollout_id)
        return ledger.get(rollout_id)
    verb = {M.REQUEUE: "requeue", M.CONTINUE: "continue_attempt"}.get(move, move.value)
    result: LedgerRecord = getattr(ledger, verb)(rollout_id)
    return result


LEGAL = sorted(TRANSITIONS, key=str)
ILLEGAL = sorted(
    ((s, m) for s in RolloutState for m in LedgerMove if (s, m) not in TRANSITIONS), key=str
)


@pytest.mark.parametrize(("state", "move"), LEGAL)
def test_every_legal_move_lands_in_the_state_the_table_names(
    state: RolloutState, move: LedgerMove
) -> None:
    ledger = RecoveryLedger()
    record = record_in(ledger, state)
    after = apply(ledger, record.rollout_id, move)
    assert after.state is TRANSITIONS[(state, move)]
    assert ledger.counts()[after.state] >= 1


@pytest.mark.parametrize(("state", "move"), ILLEGAL)
def test_every_illegal_move_is_refused_and_changes_nothing(
    state: RolloutState, move: LedgerMove
) -> None:
    ledger = RecoveryLedger()
    record = record_in(ledger, state)
    before = ledger.to_document()
    with pytest.raises(
        InvalidPhaseError, match=move.value if state not in (S.SEALED, S.RETIRED) else "final"
    ):
        apply(ledger, record.rollout_id, move)
    assert ledger.to_document() == before


def test_a_new_group_queues_every_row_under_its_own_fresh_id() -> None:
    ledger = RecoveryLedger()
    records = ledger.add_group(task(), "t1-g0", 4)
    assert [r.row for r in records] == [0, 1, 2, 3]
    assert len({r.rollout_id for r in records}) == 4
    assert all((r.state, r.attempt, r.tries, r.replica) == (S.QUEUED, 0, 1, None) for r in records)
    assert ledger.counts()[S.QUEUED] == 4
    with pytest.raises(BadRequestError, match="already exists"):
        ledger.add_group(task(), "t1-g0", 4)


def test_abandon_queues_the_row_again_under_a_new_id_and_keeps_the_old_try_for_retirement() -> None:
    ledger = RecoveryLedger()
    (first,) = ledger.add_group(task(), "g", 1)
    ledger.dispatch(first.rollout_id, "replica-1")
    fresh = ledger.abandon(first.rollout_id)
    assert fresh.rollout_id != first.rollout_id
    assert (fresh.state, fresh.tries, fresh.attempt, fresh.replica) == (S.QUEUED, 2, 0, None)
    assert ledger.current("g", 0) == fresh
    assert [r.rollout_id for r in ledger.abandoned()] == [first.rollout_id]
    assert ledger.in_flight() == []
    ledger.retire(first.rollout_id)
    assert ledger.abandoned() == []
    assert ledger.get(first.rollout_id).state is S.RETIRED
    assert ledger.current("g", 0) == fresh


def test_requeue_keeps_identity_and_spends_no_try_and_continue_pins_the_next_attempt() -> None:
    ledger = RecoveryLedger()
    (record,) = ledger.add_group(task(), "g", 1)
    rid = record.rollout_id
    ledger.dispatch(rid, "replica-0")
    requeued = ledger.requeue(rid)
    assert (requeued.rollout_id, requeued.attempt, requeued.tries) == (rid, 0, 1)
    assert requeued.replica is None  # a first try may go anywhere
    ledger.dispatch(rid, "replica-1")
    continued = ledger.continue_attempt(rid)
    assert (continued.attempt, continued.replica, continued.state) == (1, "replica-1", S.QUEUED)
    with pytest.raises(InvalidPhaseError, match="must go back to replica-1"):
        ledger.dispatch(rid, "replica-0")
    ledger.dispatch(rid, "replica-1")
    assert ledger.requeue(rid).replica == "replica-1"  # its saved state lives there


def test_in_flight_is_indexed_per_replica() -> None:
    ledger = RecoveryLedger()
    records = ledger.add_group(task(), "g", 5)
    for record, replica in zip(records, ["a", "b", "a", "a", "b"], strict=True):
        ledger.dispatch(record.rollout_id, replica)
    assert ledger.in_flight_count("a") == 3
    assert ledger.in_flight_count("b") == 2
    assert ledger.in_flight_count("c") == 0
    assert ledger.in_flight_count() == 5
    ledger.finish(records[0].rollout_id)
    ledger.requeue(records[1].rollout_id)
    assert {r.rollout_id for r in ledger.in_flight("a")} == {
        records[2].rollout_id,
        records[3].rollout_id,
    }
    assert [r.rollout_id for r in ledger.in_flight("b")] == [records[4].rollout_id]
    assert len(ledger.in_flight()) == ledger.in_flight_count() == 3


def test_lookups_reach_sealed_tries_without_keeping_them_live() -> None:
    ledger = RecoveryLedger()
    sealed = record_in(ledger, S.SEALED)
    assert ledger.archived_count == 1
    assert list(ledger.live_records()) == []
    assert ledger.get(sealed.rollout_id) == sealed
    assert ledger.current("g", 0) == sealed
    assert sealed.rollout_id in ledger
    with pytest.raises(NotFoundError):
        ledger.get("rnope")


def sealed_ledger(groups: int, size: int = 8) -> RecoveryLedger:
    ledger = RecoveryLedger()
    for g in range(groups):
        for record in ledger.add_group(task(), f"g{g}", size):
            rid = record.rollout_id
            ledger.dispatch(rid, "replica-0")
            ledger.finish(rid)
            ledger.seal(rid)
    return ledger


def test_the_snapshot_scope_and_capture_do_not_grow_with_finished_work() -> None:
    ledger = sealed_ledger(6000)
    for record in ledger.add_group(task(), "live", 8):
        ledger.dispatch(record.rollout_id, "replica-1")
    assert ledger.archived_count == 48_000
    assert len(ledger.in_flight()) == 8
    assert ledger.counts()[S.DISPATCHED] == 8
    first, second = ledger.capture(), ledger.capture()
    assert len(first.records) == 8
    # Full archive chunks are immutable and shared between captures, not rebuilt: the
    # capture's cost is the live tries plus one reference per chunk (timings live in bench/).
    pairs = list(zip(first.archived, second.archived, strict=True))
    full = [(a, b) for a, b in pairs if len(a) == 4096]
    assert len(full) == 11 and all(a is b for a, b in full)
    assert len(ledger.to_document()["archived"]) == 12


def test_a_ledger_with_many_archive_chunks_round_trips() -> None:
    ledger = sealed_ledger(1100)  # 8800 sealed tries: two full chunks and an open one
    doc = json.loads(json.dumps(ledger.to_document()))
    assert [len(chunk) for chunk in doc["archived"]] == [4096, 4096, 608]
    restored = RecoveryLedger.from_document(doc)
    assert restored.archived_count == 8800
    assert restored.to_document() == ledger.to_document()


def test_fail_group_abandons_unfinished_tries_without_replacing_them() -> None:
    ledger = RecoveryLedger()
    a, b, c = ledger.add_group(task(), "g", 3)
    ledger.dispatch(a.rollout_id, "replica-0")
    ledger.dispatch(b.rollout_id, "replica-0")
    ledger.finish(b.rollout_id)
    ledger.seal(b.rollout_id)
    abandoned = ledger.fail_group("g", "row 2: bad task")
    assert {r.rollout_id for r in abandoned} == {a.rollout_id, c.rollout_id}
    assert ledger.failed_groups() == {"g": "row 2: bad task"}
    assert ledger.current("g", 0).state is S.ABANDONED
    assert ledger.current("g", 1).state is S.SEALED
    with pytest.raises(InvalidPhaseError, match="failed"):
        ledger.abandon(ledger.current("g", 2).rollout_id)


def test_document_round_trip_keeps_every_try_and_index() -> None:
    ledger = RecoveryLedger()
    record_in(ledger, S.SEALED, "g1")
    record_in(ledger, S.RETIRED, "g2")
    record_in(ledger, S.FINISHED, "g3")
    records = ledger.add_group(task("t2"), "g4", 3)
    ledger.dispatch(records[0].rollout_id, "replica-1")
    ledger.dispatch(records[1].rollout_id, "replica-0")
    ledger.abandon(records[1].rollout_id)
    ledger.fail_group("g3", "data")
    doc = json.loads(json.dumps(ledger.to_document()))
    assert doc["schema_version"] == LEDGER_SCHEMA_VERSION
    restored = RecoveryLedger.from_document(doc)
    assert restored.to_document() == ledger.to_document()
    assert restored.counts() == ledger.counts()
    assert restored.in_flight("replica-1") == ledger.in_flight("replica-1")
    assert restored.abandoned() == ledger.abandoned()
    assert restored.current("g4", 1) == ledger.current("g4", 1)
    assert restored.current("g4", 1).tries == 2
    assert restored.failed_groups() == {"g3": "data"}


def test_the_version_1_golden_ledger_migrates_to_the_current_shape() -> None:
    doc = json.loads((GOLDEN / "ledger_v1.json").read_text())
    ledger = RecoveryLedger.from_document(doc, what="ledger_v1.json")
    running = ledger.get("r0000000000000a01")
    assert (running.state, running.attempt, running.replica, running.tries) == (
        S.DISPATCHED,
        1,
        "replica-0",
        1,
    )
    # Row 1 of t1-g0: its first try was retired, its second is queued and current.
    assert ledger.get("r0000000000000a02").state is S.RETIRED
    assert ledger.current("t1-g0", 1).rollout_id == "r0000000000000a03"
    assert ledger.current("t1-g0", 1).tries == 2
    assert ledger.get("r0000000000000b01").state is S.SEALED
    assert ledger.current("t2-g0", 1).state is S.FINISHED
    assert [r.rollout_id for r in ledger.abandoned()] == ["r0000000000000b02"]
    assert ledger.archived_count == 2
    assert ledger.failed_groups() == {}
    assert RecoveryLedger.from_document(ledger.to_document()).to_document() == ledger.to_document()


def test_a_newer_ledger_is_refused_with_a_clear_message() -> None:
    doc = RecoveryLedger().to_document() | {"schema_version": LEDGER_SCHEMA_VERSION + 1}
    with pytest.raises(InvalidCheckpointStateError, match="newer than this rollpoint"):
        RecoveryLedger.from_document(doc, what="ledger.json")


def test_a_ledger_without_a_version_is_refused() -> None:
    doc = RecoveryLedger().to_document()
    del doc["schema_version"]
    with pytest.raises(InvalidCheckpointStateError, match="no schema_version"):
        RecoveryLedger.from_document(doc)


def test_a_version_1_ledger_with_an_unknown_state_is_refused() -> None:
    doc = json.loads((GOLDEN / "ledger_v1.json").read_text())
    doc["records"][0]["state"] = "dispatched"  # a version 2 name in a version 1 file
    with pytest.raises(InvalidCheckpointStateError, match="not a version 1 state"):
        RecoveryLedger.from_document(doc)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: d["records"].append(dict(d["records"][0])), "appears twice|two tries"),
        (lambda d: d["groups"]["g"]["rollout_ids"].pop(), "names 1 first tries for 2 rows"),
        (lambda d: d["records"][0].update(rollout_id="r-other"), "two tries numbered 1"),
        (lambda d: d["failed"].update(h="why"), "failed group h is not a group"),
        (lambda d: d["records"][0].update(row=7), "does not fit"),
        (lambda d: d["records"][0].update(state="sealed"), "records.0.state"),
    ],
)
def test_an_inconsistent_ledger_is_refused(
    corrupt: Callable[[dict[str, Any]], object], message: str
) -> None:
    ledger = RecoveryLedger()
    for record in ledger.add_group(task(), "g", 2):
        ledger.dispatch(record.rollout_id, "replica-0")
    doc = ledger.to_document()
    corrupt(doc)
    with pytest.raises(InvalidCheckpointStateError, match=message):
        RecoveryLedger.from_document(doc)
