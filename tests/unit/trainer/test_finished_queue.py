"""TQ: whole-group batches, and items kept until the train checkpoint that consumed them."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from rollpoint.protocol.episode import RunReply
from rollpoint.protocol.errors import InvalidCheckpointStateError, InvalidPhaseError, NotFoundError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.trainer.state.finished_queue import (
    TQ_SCHEMA_VERSION,
    FinishedQueue,
    tq_document_from_records,
)


def reply(group_id: str, row: int, reward: float = 1.0) -> RunReply:
    return RunReply(
        episode=EpisodeId(rollout_id=f"r{group_id}x{row}", attempt=0),
        task_id=group_id.removesuffix("-g0"),
        group_id=group_id,
        row=row,
        reward=reward,
        messages=[{"role": "user", "content": "hi"}],
        model_calls=[],
        turns=1,
        finish_reason="final",
    )


def filled(groups: dict[str, int]) -> FinishedQueue:
    tq = FinishedQueue()
    for gid, size in groups.items():
        tq.expect_group(gid, size)
        for row in range(size):
            tq.put(reply(gid, row))
    return tq


def test_a_group_is_trainable_only_when_every_row_is_sealed() -> None:
    tq = FinishedQueue()
    tq.expect_group("a", 3)
    assert tq.put(reply("a", 2)) is False
    assert tq.put(reply("a", 0)) is False
    assert tq.take_groups(8, train_step=1) == []
    assert tq.put(reply("a", 1)) is True
    (batch,) = tq.take_groups(8, train_step=1)
    assert [r.row for r in batch.replies] == [0, 1, 2]


def test_batches_are_whole_groups_rounded_up_and_at_least_one() -> None:
    tq = filled({"a": 4, "b": 4, "c": 4})
    assert [b.group_id for b in tq.take_groups(5, train_step=1)] == ["a", "b"]
    assert [b.group_id for b in tq.take_groups(1, train_step=2)] == ["c"]
    assert tq.counts()["ready_rollouts"] == 0


def test_consumed_groups_stay_until_their_train_step_is_committed() -> None:
    tq = filled({"a": 2, "b": 2, "c": 2})
    tq.take_groups(2, train_step=1)
    tq.take_groups(2, train_step=2)
    assert [b.group_id for b in tq.uncommitted_consumed()] == ["a", "b"]
    assert tq.commit(1) == 2
    assert [b.group_id for b in tq.uncommitted_consumed()] == ["b"]
    with pytest.raises(InvalidPhaseError):
        tq.take_groups(2, train_step=1)  # behind the committed step
    assert tq.commit(2) == 2
    assert tq.uncommitted_consumed() == []
    with pytest.raises(NotFoundError):
        tq.put(reply("a", 0))  # gone for good: a late copy cannot train twice


def test_rewind_puts_back_what_no_durable_train_step_consumed() -> None:
    tq = filled({"a": 2, "b": 2, "c": 2})
    tq.take_groups(2, train_step=1)
    tq.take_groups(2, train_step=2)
    assert tq.rewind(1) == 2
    assert tq.committed_step == 1
    assert [b.group_id for b in tq.take_groups(4, train_step=2)] == ["b", "c"]


def test_a_row_cannot_be_put_twice() -> None:
    tq = FinishedQueue()
    tq.expect_group("a", 2)
    tq.put(reply("a", 0))
    with pytest.raises(InvalidPhaseError, match="train twice"):
        tq.put(reply("a", 0))


def test_dropping_a_failed_group_forgets_its_rows() -> None:
    tq = FinishedQueue()
    tq.expect_group("a", 3)
    tq.put(reply("a", 0))
    assert tq.drop_group("a") == 1
    assert tq.counts()["partial_rollouts"] == 0
    with pytest.raises(NotFoundError):
        tq.put(reply("a", 1))


def test_document_round_trip_keeps_partial_ready_and_consumed_groups() -> None:
    tq = filled({"a": 2, "b": 2, "c": 2})
    tq.expect_group("d", 2)
    tq.put(reply("d", 1))
    tq.take_groups(2, train_step=1)
    tq.commit(1)
    tq.take_groups(2, train_step=2)
    doc = json.loads(json.dumps(tq.to_document()))
    assert doc["schema_version"] == TQ_SCHEMA_VERSION
    restored = FinishedQueue.from_document(doc)
    assert restored.to_document() == tq.to_document()
    assert restored.counts() == tq.counts()
    assert restored.put(reply("d", 0)) is True
    assert [b.group_id for b in restored.uncommitted_consumed()] == ["b"]


def test_a_newer_or_inconsistent_tq_document_is_refused() -> None:
    doc = filled({"a": 2}).to_document()
    with pytest.raises(InvalidCheckpointStateError, match="newer"):
        FinishedQueue.from_document(doc | {"schema_version": TQ_SCHEMA_VERSION + 1})
    broken = json.loads(json.dumps(doc))
    broken["ready"][0]["replies"].pop()
    with pytest.raises(InvalidCheckpointStateError, match="not whole"):
        FinishedQueue.from_document(broken)


def _as_lines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records as a snapshot reads them back: each encoded as its line, then decoded."""
    return [orjson.loads(orjson.dumps(r)) for r in records]


def _group_of(record: dict[str, Any]) -> str:
    [line] = _as_lines([record])
    return str(next(iter(line.values()))["group_id"])


def test_records_join_into_the_document_and_a_waiting_group_is_the_same_record() -> None:
    tq = filled({"a": 2, "b": 2, "c": 2})
    tq.expect_group("d", 2)
    tq.put(reply("d", 1))
    tq.take_groups(2, train_step=1)
    first = tq.capture().as_records()

    tq.take_groups(2, train_step=2)  # "b" moves from ready to consumed
    second = tq.capture().as_records()

    joined = tq_document_from_records(_as_lines(second), "tq")
    assert joined == json.loads(json.dumps(tq.to_document()))
    assert FinishedQueue.from_document(joined).counts() == tq.counts()
    # "a" stayed consumed by step 1 and "c" ready: their records are the very same
    # objects, so a snapshot's writer references them; "b"'s changed with its state.
    by_group = {_group_of(r): r for r in first[2:]}
    again = {_group_of(r): r for r in second[2:]}
    assert first[1] == {"partial": reply("d", 1).model_dump(mode="json")}
    assert again["a"] is by_group["a"] and again["c"] is by_group["c"]
    assert "ready" in by_group["b"] and "consumed" in again["b"]


def test_a_tq_record_of_another_shape_is_refused_naming_it() -> None:
    records = _as_lines(filled({"a": 2}).capture().as_records())
    with pytest.raises(InvalidCheckpointStateError, match="record 2 is not a TQ record"):
        tq_document_from_records([records[0], {"trained": {}}], "tq")
    with pytest.raises(InvalidCheckpointStateError, match="not TQ's header"):
        tq_document_from_records(records[1:], "tq")
