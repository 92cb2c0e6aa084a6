"""rollpoint's own record of the trainer's steps: ``train_data.jsonl`` and ``checkpoints/``
in the workdir.

Owns :class:`WorkdirRecord`, the built-in :class:`~.step_record.StepRecord`: each step's
rows are appended to ``train_data.jsonl`` (fsync'd, one JSON line per trained rollout:
its schema is in docs/protocol.md) with a running digest (:mod:`.train_data`), and a
durable step is a checkpoint file ``checkpoints/step-<N>.json`` recording what it covers
of that file (:mod:`.train_checkpoint`). A restore verifies the file against the checkpoint
it resumes at (digest, line count, a line end) before anything is installed, and truncates
the rows written after it once the install is done.

It is what ``rollpoint run`` and the façade use unless a trainer brings a record of its own,
and what the chaos invariants read back (``train_data.jsonl`` is where "every row trained
exactly once" is counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import orjson

from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint, TrainCheckpointStore
from rollpoint.trainer.record.train_data import Coverage, TrainData
from rollpoint.trainer.train_hooks import TrainSample

TRAIN_DATA_FILE = "train_data.jsonl"
CHECKPOINTS_DIR = "checkpoints"


class WorkdirRecord:
    """The record in ``workdir``: ``train_data.jsonl`` and ``checkpoints/``; ``keep`` is
    how many of the newest checkpoints are kept (besides those a kept snapshot needs)."""

    def __init__(self, workdir: Path, *, keep: int = 3) -> None:
        self.workdir = workdir
        self.train_data_path = workdir / TRAIN_DATA_FILE
        self.checkpoints = TrainCheckpointStore(workdir / CHECKPOINTS_DIR, keep=keep)
        self._data: TrainData | None = None
        """The file at its verified end, digest running (opened or checked on first use)."""
        self._checked: TrainCheckpoint | None = None
        """The checkpoint the file was last verified against (the job checks before the
        servers start, the restorer before it installs: the file is read once)."""

    @property
    def keep(self) -> int:
        return self.checkpoints.keep

    def available(self) -> list[TrainCheckpoint]:
        return self.checkpoints.available()

    def steps(self) -> list[int]:
        return self.checkpoints.steps()

    def progress(self) -> list[str]:
        found = []
        path = self.train_data_path
        if path.exists() and path.stat().st_size > 0:
            found.append(f"{TRAIN_DATA_FILE}: {path.stat().st_size} bytes")
        steps = self.steps()
        if steps:
            found.append(f"train checkpoints of steps {', '.join(map(str, steps[-5:]))}")
        return found

    def check(self, checkpoint: TrainCheckpoint) -> None:
        if self._data is not None and self._checked == checkpoint:
            return
        self._data = TrainData.verify(self.train_data_path, checkpoint.coverage)
        self._checked = checkpoint

    def cut_back(self, checkpoint: TrainCheckpoint) -> None:
        self.check(checkpoint)
        assert self._data is not None
        self._data.cut_back()

    def write_step(self, step: int, samples: list[TrainSample], policy_version: int) -> Coverage:
        data = self._opened()
        data.append(train_rows(step, samples, policy_version))
        return data.coverage()

    def coverage(self) -> Coverage:
        """What the file holds now (its verified end, and every step written since)."""
        return self._opened().coverage()

    def save(self, checkpoint: TrainCheckpoint, *, protect: Iterable[int] = ()) -> None:
        self.checkpoints.save(checkpoint, protect=protect)

    def _opened(self) -> TrainData:
        if self._data is None:
            self._data = TrainData.open(self.train_data_path)
        return self._data


def train_rows(step: int, samples: list[TrainSample], default_version: int) -> bytes:
    """``step``'s lines of ``train_data.jsonl``, one per sample."""
    lines = bytearray()
    for s in samples:
        # The oldest policy that wrote any turn of the episode: its staleness.
        versions = [call.policy_version for call in s.model_calls]
        lines += orjson.dumps(
            {
                "task_id": s.task_id,
                "group_id": s.group_id,
                "row": s.row,
                "rollout_id": s.rollout_id,
                "attempt": s.attempt,
                "reward": s.reward,
                "advantage": s.advantage,
                "messages": s.messages,
                "train_step": step,
                "policy_version": min(versions, default=default_version),
                # Versions behind the live one when the batch was handed out, its oldest
                # turn's (each turn's is in ``turns``): what train.max_policy_lag bounds.
                "policy_lag": s.policy_lag,
                "turn_count": s.turns,
                # One entry per model call: the ids and logprobs the engine sampled and
                # the policy version that sampled them (schema: docs/protocol.md).
                "turns": [t.to_json() for t in s.trajectory],
                # Which attempt asked each turn: a continued episode shows its pre-cut
                # turns answered once, by the attempt before the restore.
                "model_calls": [{"turn": c.turn, "attempt": c.attempt} for c in s.model_calls],
            },
            option=orjson.OPT_APPEND_NEWLINE,
        )
    return bytes(lines)
