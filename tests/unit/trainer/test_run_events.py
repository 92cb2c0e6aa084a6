"""The run's event log: the v1 golden file reads, the writer appends, bad lines are skipped."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from rollpoint.trainer.run_events import (
    EVENTS_VERSION,
    InFlight,
    Preemption,
    ReplicaDown,
    ReplicaUp,
    Restore,
    RunEnd,
    RunEvents,
    RunStart,
    TrainStep,
    read_events,
    without_secrets,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "run_events"


def test_golden_v1_file_reads_every_kind() -> None:
    log = read_events(GOLDEN / "run_events_v1.jsonl")
    assert (log.skipped, log.newer) == (0, 0)
    kinds = [type(e) for e in log.events]
    assert kinds == [
        RunStart,
        InFlight,
        TrainStep,
        ReplicaDown,
        ReplicaUp,
        Preemption,
        RunEnd,
        RunStart,
        Restore,
        InFlight,
    ]
    restore = log.events[8]
    assert isinstance(restore, Restore)
    assert (restore.continued, restore.restarted, restore.adopted, restore.requeued) == (
        12,
        1,
        3,
        4,
    )
    assert restore.turns_kept == 41
    # policy_calls is optional: a sample without it reads as empty.
    last = log.events[9]
    assert isinstance(last, InFlight) and last.policy_calls == {}


def test_written_lines_read_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "run_events.jsonl"
    events = RunEvents(path)
    events.append(TrainStep(ts=1.0, step=1, rollouts=4, groups=2))
    events.preemption("SIGTERM", snapshot_id="snap-1-0001")
    log = read_events(path)
    assert [type(e) for e in log.events] == [TrainStep, Preemption]
    preemption = log.events[1]
    assert isinstance(preemption, Preemption)
    assert preemption.snapshot_id == "snap-1-0001"
    assert abs(preemption.ts - time.time()) < 60
    for line in path.read_bytes().splitlines():
        assert orjson.loads(line)["v"] == EVENTS_VERSION


def test_a_torn_line_and_a_newer_version_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "run_events.jsonl"
    good = orjson.dumps(TrainStep(ts=1.0, step=1, rollouts=4, groups=2).model_dump())
    newer = orjson.dumps({"v": 2, "ts": 2.0, "kind": "train_step", "shape": "new"})
    unknown = orjson.dumps({"v": 1, "ts": 3.0, "kind": "no_such_kind"})
    path.write_bytes(b"\n".join([good, newer, unknown, good[:20]]))
    log = read_events(path)
    assert len(log.events) == 1
    assert (log.skipped, log.newer) == (2, 1)


def test_a_missing_file_reads_as_no_events(tmp_path: Path) -> None:
    log = read_events(tmp_path / "run_events.jsonl")
    assert (log.events, log.skipped, log.newer) == ([], 0, 0)


def test_a_writer_without_a_path_writes_nothing(tmp_path: Path) -> None:
    RunEvents(None).append(TrainStep(ts=1.0, step=1, rollouts=1, groups=1))
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_file_never_raises_into_the_run(tmp_path: Path) -> None:
    events = RunEvents(tmp_path / "missing-dir" / "run_events.jsonl")
    events.append(TrainStep(ts=1.0, step=1, rollouts=1, groups=1))
    events.append(TrainStep(ts=2.0, step=2, rollouts=1, groups=1))
    assert not (tmp_path / "missing-dir").exists()


def test_config_secrets_are_redacted() -> None:
    doc = {"policy": {"api_key": "sk-secret", "model": "m"}, "list": [{"api_key": None}]}
    assert without_secrets(doc) == {
        "policy": {"api_key": "<redacted>", "model": "m"},
        "list": [{"api_key": None}],
    }


def test_events_refuse_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        TrainStep.model_validate({"ts": 1.0, "step": 1, "rollouts": 1, "groups": 1, "x": 1})
