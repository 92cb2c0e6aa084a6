"""finished queue: whole-group batches, and items kept until the train checkpoint that consumed them."""

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
    finished_queue_document_from_records,
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
    finished_queue = FinishedQueue()
    for gid, size in groups.items():
        finished_queue.expect_group(gid, size)
        for row in range(size):
            finished_queue.put(reply(gid, row))
    return finished_queue


def test_a_group_is_trainable_only_when_every_row_is_sealed() -> None:
    finished_queue = FinishedQueue()
    finished_queue.expect_group("a", 3)
    assert finished_queue.put(reply("a", 2)) is False
    assert finished_queue.put(reply("a", 0)) is False
    assert finished_queue.take_groups(8, train_step=1) == []
    assert finished_queue.put(reply("a", 1)) is True
    (batch,) = finished_queue.take_groups(8, train_step=1)
    assert [r.row for r in batch.replies] == [0, 1, 2]


def test_batches_are_whole_groups_rounded_up_and_at_least_one() -> None:
    finished_queue = filled({"a": 4, "b": 4, "c": 4})
    assert [b.group_id for b in finished_queue.take_groups(5, train_step=1)] == ["a", "b"]
    assert [b.group_id for b in finished_queue.take_groups(1, train_step=2)] == ["c"]
    assert finished_queue.counts()["ready_rollouts"] == 0


def test_consumed_groups_stay_until_their_train_step_is_committed() -> None:
    finished_queue = filled({"a": 2, "b": 2, "c": 2})
    finished_queue.take_groups(2, train_step=1)
    finished_queue.take_groups(2, train_step=2)
    assert [b.group_id for b in finished_queue.uncommitted_consumed()] == ["a", "b"]
    assert finished_queue.commit(1) == 2
    assert [b.group_id for b in finished_queue.uncommitted_consumed()] == ["b"]
    with pytest.raises(InvalidPhaseError):
        finished_queue.take_groups(2, train_step=1)  # behind the committed step
    assert finished_queue.commit(2) == 2
    assert finished_queue.uncommitted_consumed() == []
    with pytest.raises(NotFoundError):
        finished_queue.put(reply("a", 0))  # gone for good: a late copy cannot train twice


def test_rewind_puts_back_what_no_durable_train_step_consumed() -> None:
    finished_queue = filled({"a": 2, "b": 2, "c": 2})
    finished_queue.take_groups(2, train_step=1)
    finished_queue.take_groups(2, train_step=2)
    assert finished_queue.rewind(1) == 2
    assert finished_queue.committed_step == 1
    assert [b.group_id for b in finished_queue.take_groups(4, train_step=2)] == ["b", "c"]


def test_a_row_cannot_be_put_twice() -> None:
    finished_queue = FinishedQueue()
    finished_queue.expect_group("a", 2)
    finished_queue.put(reply("a", 0))
    with pytest.raises(InvalidPhaseError, match="train twice"):
        finished_queue.put(reply("a", 0))


def test_dropping_a_failed_group_forgets_its_rows() -> None:
    finished_queue = FinishedQueue()
    finished_queue.expect_group("a", 3)
    finished_queue.put(reply("a", 0))
    assert finished_queue.drop_group("a") == 1
    assert finished_queue.counts()["partial_rollouts"] == 0
    with pytest.raises(NotFoundError):
        finished_queue.put(reply("a", 1))


def test_document_round_trip_keeps_partial_ready_and_consumed_groups() -> None:
    finished_queue = filled({"a": 2, "b": 2, "c": 2})
    finished_queue.expect_group("d", 2)
    finished_queue.put(reply("d", 1))
    finished_queue.take_groups(2, train_step=1)
    finished_queue.commit(1)
    finished_queue.take_groups(2, train_step=2)
    doc = json.loads(json.dumps(finished_queue.to_document()))
    assert doc["schema_version"] == TQ_SCHEMA_VERSION
    restored = FinishedQueue.from_document(doc)
    assert restored.to_document() == finished_queue.to_document()
    assert restored.counts() == finished_queue.counts()
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
    finished_queue = filled({"a": 2, "b": 2, "c": 2})
    finished_queue.expect_group("d", 2)
    finished_queue.put(reply("d", 1))
    finished_queue.take_groups(2, train_step=1)
    first = finished_queue.capture().as_records()

    finished_queue.take_groups(2, train_step=2)  # "b" moves from ready to consumed
    second = finished_queue.capture().as_records()

    joined = finished_queue_document_from_records(_as_lines(second), "tq")
    assert joined == json.loads(json.dumps(finished_queue.to_document()))
    assert FinishedQueue.from_document(joined).counts() == finished_queue.counts()
    # "a" stayed consumed by step 1 and "c" ready: their records are the very same
    # objects, so a snapshot's writer references them; "b"'s changed with its state.
    by_group = {_group_of(r): r for r in first[2:]}
    again = {_group_of(r): r for r in second[2:]}
    assert first[1] == {"partial": reply("d", 1).model_dump(mode="json")}
    assert again["a"] is by_group["a"] and again["c"] is by_group["c"]
    assert "ready" in by_group["b"] and "consumed" in again["b"]


def test_a_tq_record_of_another_shape_is_refused_naming_it() -> None:
    records = _as_lines(filled({"a": 2}).capture().as_records())
    with pytest.raises(
        InvalidCheckpointStateError, match="record 2 is not a finished queue record"
    ):
        finished_queue_document_from_records([records[0], {"trained": {}}], "tq")
    with pytest.raises(InvalidCheckpointStateError, match="not the finished queue's header"):
        finished_queue_document_from_records(records[1:], "tq")
