"""A trainer's own record of its steps (``rollpoint.trainer.StepRecord``), through the façade.

The record here keeps what each step trained and which steps are durable in a SQLite
database of the trainer's, outside the workdir, instead of rollpoint's ``train_data.jsonl``
and ``checkpoints/``. A run stopped after step 2 was made durable resumes at step 2 from
that database: the steps past it are cut back there, every row ends up trained exactly once
(counted in the trainer's own table), and rollpoint wrote no record of its own.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable
from pathlib import Path

import orjson
import pytest

from rollpoint import SyncRollouts
from rollpoint.app.config import RunConfig
from rollpoint.protocol.errors import RestoreError
from rollpoint.trainer import (
    Coverage,
    StepRecord,
    TrainCheckpoint,
    TrainSample,
    WorkdirRecord,
)
from rollpoint.trainer.record.train_checkpoint import INITIAL
from tests.support.small_job import small_job

pytestmark = pytest.mark.integration


class SqliteRecord:
    """A trainer's record in one SQLite file: a row per trained sample, a row per durable
    step. Coverage is the count of rows, their bytes and a digest over them in order."""

    keep = 3

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS rows (step INT, n INT, line BLOB)")
        self.db.execute("CREATE TABLE IF NOT EXISTS steps (step INT PRIMARY KEY, doc BLOB)")

    def available(self) -> list[TrainCheckpoint]:
        docs = self.db.execute("SELECT doc FROM steps ORDER BY step DESC").fetchall()
        return [*(TrainCheckpoint.model_validate_json(d) for (d,) in docs), INITIAL]

    def steps(self) -> list[int]:
        return [s for (s,) in self.db.execute("SELECT step FROM steps ORDER BY step")]

    def progress(self) -> list[str]:
        return [f"steps {self.steps()} in the trainer's database"] if self.steps() else []

    def _coverage(self, up_to: int | None = None) -> Coverage:
        rows = self.db.execute("SELECT step, line FROM rows ORDER BY step, n").fetchall()
        lines = [line for step, line in rows if up_to is None or step <= up_to]
        return Coverage(
            sum(map(len, lines)), len(lines), hashlib.sha256(b"".join(lines)).hexdigest()
        )

    def check(self, checkpoint: TrainCheckpoint) -> None:
        if self._coverage(checkpoint.step) != checkpoint.coverage:
            raise RestoreError(f"the trainer's database does not hold step {checkpoint.step}")

    def cut_back(self, checkpoint: TrainCheckpoint) -> None:
        self.db.execute("DELETE FROM rows WHERE step > ?", (checkpoint.step,))

    def write_step(self, step: int, samples: list[TrainSample], policy_version: int) -> Coverage:
        self.db.executemany(
            "INSERT INTO rows VALUES (?, ?, ?)",
            [
                (step, n, orjson.dumps({"group_id": s.group_id, "row": s.row}) + b"\n")
                for n, s in enumerate(samples)
            ],
        )
        return self._coverage()

    def save(self, checkpoint: TrainCheckpoint, *, protect: Iterable[int] = ()) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO steps VALUES (?, ?)",
            (checkpoint.step, checkpoint.model_dump_json()),
        )

    def trained(self) -> list[tuple[str, int]]:
        return [
            (doc["group_id"], doc["row"])
            for (line,) in self.db.execute("SELECT line FROM rows")
            for doc in [orjson.loads(line)]
        ]


def job(tmp_path: Path) -> RunConfig:
    return small_job(tmp_path)


def test_a_run_resumes_at_the_step_the_trainers_own_record_made_durable(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    database = tmp_path / "trainer.sqlite"
    record: StepRecord = SqliteRecord(database)
    with SyncRollouts(config, step_record=record) as run:
        for batch in run.batches():
            if batch.step == 3:
                break  # step 1 durable, step 2 written but never durable, step 3 never done
            batch.done(durable=batch.step == 1)
    assert SqliteRecord(database).steps() == [1]
    assert len(SqliteRecord(database).trained()) == 8
    assert not (config.workdir / "train_data.jsonl").exists()
    assert not (config.workdir / "checkpoints").exists()

    again = SqliteRecord(database)
    with SyncRollouts(config, step_record=again) as run:
        assert run.resumed_step == 1
        steps = []
        for batch in run.batches():
            steps.append(batch.step)
            batch.done()
        run.summary()
    assert steps == [2, 3]  # step 2's rows cut back from the database, then trained again
    trained = again.trained()
    assert len(set(trained)) == len(trained) == 12


def test_a_record_that_does_not_hold_its_durable_step_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    database = tmp_path / "trainer.sqlite"
    with SyncRollouts(config, step_record=SqliteRecord(database)) as run:
        for batch in run.batches():
            if batch.step == 3:
                break
            batch.done()
    damaged = SqliteRecord(database)
    damaged.db.execute("DELETE FROM rows WHERE step = 1")
    with (
        pytest.raises(RestoreError, match="does not hold step 2"),
        SyncRollouts(config, step_record=damaged),
    ):
        pass
    assert damaged.steps() == [1, 2]  # nothing was cut back or deleted


def test_rollpoints_own_record_cuts_back_only_what_came_after_its_checkpoint(
    tmp_path: Path,
) -> None:
    config = job(tmp_path)
    with SyncRollouts(config) as run:
        for batch in run.batches():
            if batch.step == 3:
                break
            batch.done(durable=batch.step == 1)  # step 2 written, never durable
    record = WorkdirRecord(config.workdir)
    (checkpoint, *_) = record.available()
    assert checkpoint.step == 1 and record.steps() == [1]
    lines = (config.workdir / "train_data.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 8  # steps 1 and 2, four rows each
    record.check(checkpoint)
    record.cut_back(checkpoint)
    assert (config.workdir / "train_data.jsonl").read_bytes() == b"".join(lines[:4])
    assert record.coverage() == checkpoint.coverage
