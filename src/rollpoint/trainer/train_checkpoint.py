"""The built-in trainer's checkpoints: what a resumed run needs to train every group once.

A train checkpoint at step S is durable once its file is fsync'd and renamed into
``<workdir>/checkpoints/step-<S>.json``. It records the policy version, the byte length of
``train_data.jsonl`` after step S (the built-in trainer's "weights": what it trained on),
and the run's counters. TQ releases the rollouts consumed up to S only after that (see
:meth:`FinishedQueue.commit`), so any snapshot taken at a step ≥ S composes with it.

A real trainer keeps its own weights; it calls :meth:`TrainCheckpointStore.save` with
its step when its own checkpoint is durable, and the same composition rule holds.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import orjson
from pydantic import Field

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.manifest import decode_document, load_versioned
from rollpoint.protocol.model_base import StrictModel

log = logging.getLogger(__name__)

TRAIN_CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})\.json$")


class TrainCheckpoint(StrictModel):
    schema_version: int = TRAIN_CHECKPOINT_VERSION
    step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    train_data_bytes: int = Field(ge=0)
    """Length of train_data.jsonl once this step's rollouts were appended."""
    episodes_trained: int = Field(ge=0)
    groups_trained: int = Field(ge=0)
    written_at: float


INITIAL = TrainCheckpoint(
    step=0,
    policy_version=0,
    train_data_bytes=0,
    episodes_trained=0,
    groups_trained=0,
    written_at=0.0,
)
"""Step 0: nothing trained yet. Every run composes with it."""


class TrainCheckpointStore:
    def __init__(self, folder: Path, *, keep: int = 3) -> None:
        self.folder = folder
        self.keep = keep

    def save(self, checkpoint: TrainCheckpoint) -> None:
        """Write durably (temp file, fsync, rename, fsync the folder), then prune old ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"step-{checkpoint.step:08d}.json"
        tmp = final.with_suffix(".tmp")
        with tmp.open("wb") as out:
            out.write(orjson.dumps(checkpoint.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in self._steps()[: -self.keep]:
            try:
                (self.folder / f"step-{old:08d}.json").unlink()
            except OSError as exc:
                log.warning("could not prune train checkpoint step %d: %s", old, exc)

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
        return load_versioned(doc, TrainCheckpoint, {}, TRAIN_CHECKPOINT_VERSION, what)

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
    step: int, policy_version: int, train_data: Path, episodes: int, groups: int
) -> TrainCheckpoint:
    size = train_data.stat().st_size if train_data.exists() else 0
    return TrainCheckpoint(
        step=step,
        policy_version=policy_version,
        train_data_bytes=size,
        episodes_trained=episodes,
        groups_trained=groups,
        written_at=time.time(),
    )
