"""The built-in trainer's checkpoints: what a resumed run needs to train every group once.

A train checkpoint at step S is durable once its file is fsync'd and renamed into
``<workdir>/checkpoints/step-<S>.json``. It records the policy version, what it covers of
``train_data.jsonl`` after step S (the built-in trainer's "weights": what it trained on;
its length, line count and the sha256 of that prefix, see :mod:`.train_data`), and the
run's counters. The finished queue releases the rollouts consumed up to S only after that (see
:meth:`FinishedQueue.commit`), so any snapshot taken at a step ≥ S composes with it.

A real trainer keeps its own weights; it calls :meth:`TrainCheckpointStore.save` with
its step when its own checkpoint is durable, and the same composition rule holds.

It also keeps the trainer's own state at that step (``trainer_state``: any JSON a trainer
hands over with the step, such as where its weights and optimizer state are; handed back
after a restore, see :attr:`rollpoint.Rollouts.resumed_state`).

Schema history: **1** recorded only ``train_data_bytes``; **2** adds ``train_data_lines``
and ``train_data_sha256``; **3** (current) adds ``trainer_state``. Migration 1 → 2 sets
both to ``null``: a version-1 checkpoint is checked for its length and line boundary only.
Migration 2 → 3 sets ``trainer_state`` to ``null`` (the trainer handed none over).

Which checkpoints are kept is not decided here alone: :meth:`TrainCheckpointStore.save`
keeps the ``keep`` newest plus every step in ``protect`` (the steps kept snapshots compose
with, see :mod:`rollpoint.trainer.retention`), so retention never strands a snapshot.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
from pydantic import Field, JsonValue

from rollpoint.protocol.errors import InvalidCheckpointStateError, StorageError
from rollpoint.protocol.manifest import Sha256Hex, decode_document, load_versioned
from rollpoint.protocol.model_base import StrictModel
from rollpoint.trainer.record.train_data import EMPTY_SHA256, Coverage

log = logging.getLogger(__name__)

TRAIN_CHECKPOINT_VERSION = 3
TRAINER_STATE_MAX_BYTES = 1 << 20
"""The trainer's state rides in every checkpoint file: paths and counters, not weights."""
_NAME = re.compile(r"^step-(\d{8})\.json$")


class TrainCheckpoint(StrictModel):
    schema_version: int = TRAIN_CHECKPOINT_VERSION
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    train_data_bytes: int = Field(ge=0)
    """Length of train_data.jsonl once this step's rollouts were appended."""
    train_data_lines: int | None = Field(default=None, ge=0)
    """Lines in those bytes (None: a schema-1 checkpoint)."""
    train_data_sha256: Sha256Hex | None = None
    """sha256 of those bytes (None: a schema-1 checkpoint)."""
    episodes_trained: int = Field(ge=0)
    groups_trained: int = Field(ge=0)
    written_at: float
    trainer_state: JsonValue = None
    """The trainer's own state at this step, as it handed it over (None: none)."""

    @property
    def coverage(self) -> Coverage:
        """What it covers of train_data.jsonl."""
        return Coverage(self.train_data_bytes, self.train_data_lines, self.train_data_sha256)


def _checkpoint_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    for field in ("train_data_lines", "train_data_sha256"):
        if field in doc:
            raise ValueError(f"a version 1 train checkpoint has no '{field}' field")
    doc["train_data_lines"] = None
    doc["train_data_sha256"] = None
    return doc


def _checkpoint_v2_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    if "trainer_state" in doc:
        raise ValueError("a version 2 train checkpoint has no 'trainer_state' field")
    doc["trainer_state"] = None
    return doc


TRAIN_CHECKPOINT_MIGRATIONS = {1: _checkpoint_v1_to_v2, 2: _checkpoint_v2_to_v3}

INITIAL = TrainCheckpoint(
    step=0,
    policy_version=0,
    train_data_bytes=0,
    train_data_lines=0,
    train_data_sha256=EMPTY_SHA256,
    episodes_trained=0,
    groups_trained=0,
    written_at=0.0,
)
"""Step 0: nothing trained yet. Every run composes with it."""


class TrainCheckpointStore:
    def __init__(self, folder: Path, *, keep: int = 3) -> None:
        self.folder = folder
        self.keep = keep

    def save(self, checkpoint: TrainCheckpoint, *, protect: Iterable[int] = ()) -> None:
        """Write durably (temp file, fsync, rename, fsync the folder), then prune old ones
        (never a step in ``protect``); a failed write raises :class:`StorageError`."""
        final = self.folder / f"step-{checkpoint.step:08d}.json"
        tmp = final.with_suffix(".tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as out:
                out.write(
                    orjson.dumps(checkpoint.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
                )
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(
                f"cannot write train checkpoint {final}: {exc.strerror}; free space there and "
                "rerun (the run resumes from its last snapshot)"
            ) from None
        self.prune(protect)

    def prune(self, protect: Iterable[int] = ()) -> None:
        """Remove all but the ``keep`` newest checkpoints and those in ``protect``."""
        kept = set(self._steps()[-self.keep :]) | set(protect)
        for old in self._steps():
            if old in kept:
                continue
            try:
                (self.folder / f"step-{old:08d}.json").unlink()
            except OSError as exc:
                log.warning("could not prune train checkpoint step %d: %s", old, exc)

    def steps(self) -> list[int]:
        """The steps of the checkpoint files present, oldest first (not read)."""
        return self._steps()

    def _steps(self) -> list[int]:
        if not self.folder.exists():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def load(self, step: int) -> TrainCheckpoint:
        path = self.folder / f"step-{step:08d}.json"
        what = f"train checkpoint {path}"
        try:
            doc = decode_document(path.read_bytes(), what)
        except OSError as exc:
            raise InvalidCheckpointStateError(f"{what}: cannot read: {exc.strerror}") from None
        return load_versioned(
            doc, TrainCheckpoint, TRAIN_CHECKPOINT_MIGRATIONS, TRAIN_CHECKPOINT_VERSION, what
        )

    def available(self) -> list[TrainCheckpoint]:
        """Every readable checkpoint, newest first, with :data:`INITIAL` last; unreadable ones
        are skipped with a warning."""
        found = []
        for step in reversed(self._steps()):
            try:
                found.append(self.load(step))
            except InvalidCheckpointStateError as exc:
                log.warning("skipping train checkpoint: %s", exc.message)
        return [*found, INITIAL]


def stamp(
    step: int,
    policy_version: int,
    coverage: Coverage,
    episodes: int,
    groups: int,
    trainer_state: JsonValue = None,
) -> TrainCheckpoint:
    return TrainCheckpoint(
        step=step,
        policy_version=policy_version,
        train_data_bytes=coverage.bytes,
        train_data_lines=coverage.lines,
        train_data_sha256=coverage.sha256,
        episodes_trained=episodes,
        groups_trained=groups,
        written_at=time.time(),
        trainer_state=trainer_state,
    )
