"""The ledger's capture: frozen at one instant, O(touched tries), encoded after the pause."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.store.record_packs import encode_record
from rollpoint.trainer.state.append_log import AppendLog
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_document import LEDGER_SCHEMA_VERSION, document_from_records
from rollpoint.trainer.state.ledger_record import RolloutState

GOLDEN = Path(__file__).parents[2] / "golden"
S = RolloutState


def task(i: int) -> TaskRow:
    return TaskRow(task_id=f"t{i}", environment="math", prompt=f"What is {i} + 1?")


def busy_ledger(groups: int, sealed: int) -> RecoveryLedger:
    """``groups`` 2-row groups: the first ``sealed`` sealed, one dispatched, the rest queued."""
    ledger = RecoveryLedger()
    for i in range(groups):
        for record in ledger.add_group(task(i), f"g{i}", 2):
            if i < sealed or i == sealed:
                ledger.dispatch(record.rollout_id, "replica-0")
            if i < sealed:
                ledger.finish(record.rollout_id)
                ledger.seal(record.rollout_id)
    return ledger


def test_an_append_log_shares_full_chunks_and_copies_its_tail_once_it_grew() -> None:
    log: AppendLog[int] = AppendLog(chunk=4)
    for i in range(10):
        log.append(i)
    first, second = log.capture(), log.capture()
    assert [c.items for c in first] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert first[0] is second[0] and first[1] is second[1]
    assert first[2] is second[2]  # nothing appended in between: the same tail
    log.append(10)
    third = log.capture()
    assert third[2] is not first[2] and third[2].items == (8, 9, 10)
    assert first[2].items == (8, 9)  # an earlier capture stays as it was
    assert list(log) == list(range(11)) and len(log) == 11


def test_a_tail_refilled_to_the_same_length_is_copied_again() -> None:
    log: AppendLog[int] = AppendLog(chunk=4)
    log.append(0)
    (before,) = log.capture()
    for i in range(1, 5):  # fills the chunk, then one item in a new tail
        log.append(i)
    after = log.capture()
    assert len(after[-1]) == len(before) == 1
    assert after[-1] is not before and after[-1].items == (4,)


def test_a_chunk_encodes_once() -> None:
    log: AppendLog[int] = AppendLog(chunk=2)
    log.append(1)
    log.append(2)
    (chunk, _) = log.capture()
    calls: list[tuple[int, ...]] = []

    def encode(items: tuple[int, ...]) -> bytes:
        calls.append(items)
        return orjson.dumps(items)

    assert chunk.encoded(encode) == chunk.encoded(encode) == b"[1,2]"
    assert calls == [(1, 2)]


def test_a_capture_holds_only_the_touched_live_tries() -> None:
    ledger = busy_ledger(groups=3000, sealed=2500)
    capture = ledger.capture()
    # 2 dispatched tries; the 998 queued rows are implied by their groups.
    assert [r.state for r in capture.records] == [S.DISPATCHED, S.DISPATCHED]
    assert ledger.counts()[S.QUEUED] == 998
    assert sum(len(c) for c in capture.archived) == 5000


def test_a_capture_does_not_change_while_the_ledger_moves_on() -> None:
    ledger = busy_ledger(groups=3000, sealed=2500)
    capture = ledger.capture()
    before = capture.to_bytes()
    for record in ledger.add_group(task(9999), "late", 2):
        ledger.dispatch(record.rollout_id, "replica-1")
    for record in ledger.in_flight("replica-0"):
        ledger.finish(record.rollout_id)
        ledger.seal(record.rollout_id)
    ledger.fail_group("g2999", "bad task")
    assert capture.to_bytes() == before
    assert orjson.loads(ledger.capture().to_bytes()) != orjson.loads(before)


def test_the_encoded_capture_is_the_document_and_round_trips() -> None:
    ledger = busy_ledger(groups=5000, sealed=4200)  # two full archive chunks, an open one
    ledger.fail_group("g4999", "bad task")
    abandoned = ledger.in_flight("replica-0")[0]
    ledger.abandon(abandoned.rollout_id)
    encoded = ledger.capture().to_bytes()
    doc = orjson.loads(encoded)
    assert doc == json.loads(json.dumps(ledger.to_document()))
    assert doc["schema_version"] == LEDGER_SCHEMA_VERSION
    restored = RecoveryLedger.from_document(doc)
    assert restored.to_document() == ledger.to_document()
    assert restored.capture().to_bytes() == encoded
    assert restored.counts() == ledger.counts()
    assert restored.failed_groups() == {"g4999": "bad task"}
    assert restored.current("g4200", 0).tries == 2
    # A second encoding reuses the full chunks' bytes and gives the same document.
    assert ledger.capture().to_bytes() == encoded


def test_an_untouched_first_try_comes_back_queued_under_its_rollout_id() -> None:
    ledger = RecoveryLedger()
    first = ledger.add_group(task(1), "g", 3)
    ledger.dispatch(first[1].rollout_id, "replica-0")
    ledger.requeue(first[1].rollout_id)  # refused at admission: untouched again
    doc = ledger.to_document()
    assert doc["records"] == []
    restored = RecoveryLedger.from_document(json.loads(json.dumps(doc)))
    assert restored.group_records("g") == first


def test_the_version_2_golden_ledger_migrates_to_version_3() -> None:
    doc = json.loads((GOLDEN / "ledger_v2.json").read_text())
    assert doc["schema_version"] == 2
    ledger = RecoveryLedger.from_document(doc, what="ledger_v2.json")
    assert ledger.failed_groups() == {"t1-g1": "bad task"}
    assert ledger.current("t1-g0", 0).state is S.SEALED
    assert ledger.current("t1-g0", 1).tries == 2
    assert ledger.current("t1-g0", 2).attempt == 1
    assert ledger.current("t2-g0", 0).replica == "replica-1"
    assert ledger.current("t2-g0", 1).state is S.QUEUED
    assert {r.rollout_id for r in ledger.abandoned()} == {"r0000000000000c07", "r0000000000000c08"}
    migrated = ledger.to_document()
    assert migrated["groups"]["t1-g0"]["rollout_ids"] == [
        "r0000000000000c01",
        "r0000000000000c02",
        "r0000000000000c03",
    ]
    assert RecoveryLedger.from_document(migrated).to_document() == migrated


def _as_lines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records as a snapshot reads them back: each encoded as its line, then decoded."""
    return [orjson.loads(encode_record(r)) for r in records]


def test_the_ledger_as_records_joins_into_its_document_and_round_trips() -> None:
    ledger = busy_ledger(groups=5000, sealed=4200)  # two full archive chunks, an open one
    ledger.fail_group("g4999", "bad task")

    joined = document_from_records(_as_lines(ledger.capture().as_records()), "ledger")

    assert joined == json.loads(json.dumps(ledger.to_document()))
    restored = RecoveryLedger.from_document(joined)
    assert restored.to_document() == ledger.to_document()
    assert restored.failed_groups() == {"g4999": "bad task"}


def test_what_did_not_change_is_the_same_record_in_the_next_capture() -> None:
    ledger = busy_ledger(groups=5000, sealed=4200)  # group 4200's two rows in flight
    first = ledger.capture().as_records()
    moved, stayed = ledger.in_flight("replica-0")
    ledger.finish(moved.rollout_id)
    ledger.seal(moved.rollout_id)
    second = ledger.capture().as_records()

    kept = [r for r in second if any(r is f for f in first)]
    # Unchanged, so the same objects: the tasks (a full chunk of 4096 and the open 904: no
    # task was added), the groups (a full chunk and the open tail), the two full chunks of
    # final tries, and the try still in flight. New: the header and the final tries' open
    # chunk (the seal went there); the sealed try left the live ones.
    assert len(kept) == 2 + 2 + 2 + 1
    assert [r["try"]["rollout_id"] for r in kept if "try" in r] == [stayed.rollout_id]
    assert moved.rollout_id not in {r["try"]["rollout_id"] for r in second if "try" in r}
    # A try that moves is a new record of its new state.
    ledger.finish(stayed.rollout_id)
    third = ledger.capture().as_records()
    mine = next(r for r in third if "try" in r and r["try"]["rollout_id"] == stayed.rollout_id)
    assert mine["try"]["state"] == "finished"
    assert not any(mine is r for r in second)


def test_a_ledger_record_of_another_shape_or_saved_twice_is_refused() -> None:
    records = _as_lines(busy_ledger(groups=3, sealed=1).capture().as_records())
    header, tasks = records[0], next(r for r in records if "tasks" in r)
    with pytest.raises(InvalidCheckpointStateError, match="ledger: task 't0' is saved twice"):
        document_from_records([header, tasks, tasks], "ledger")
    with pytest.raises(InvalidCheckpointStateError, match="record 2 \\('rows'\\) is not a ledger"):
        document_from_records([header, {"rows": []}], "ledger")
    with pytest.raises(InvalidCheckpointStateError, match="not the ledger's header"):
        document_from_records(records[1:], "ledger")
