"""The trainer's durable record of its steps: the seam between rollpoint and a trainer's
own checkpoints.

Owns the :class:`StepRecord` protocol. A train step is done in three moves: the trainer
updates its policy, the record writes what the step trained (:meth:`StepRecord.write_step`),
and once the trainer's weights of the step are saved for good the record makes the step
durable (:meth:`StepRecord.save`, with the :class:`~.train_checkpoint.TrainCheckpoint`
the loop stamped). The finished queue lets go of the rows a durable step consumed only after that, so any
snapshot taken at a step at or after it composes with it (see :mod:`.restore.resume_point`).

On a rerun the restorer asks the record which steps are durable
(:meth:`StepRecord.available`), checks the one it resumes at before installing anything
(:meth:`StepRecord.check`: a record that does not hold what that step covered is refused,
naming what differs, and nothing changes), and after the install forgets the steps trained
past it (:meth:`StepRecord.cut_back`: their rows are back in the finished queue and are trained again).
Retention asks for the durable steps present (:meth:`StepRecord.steps`) so that it never
prunes a snapshot a kept step needs, and a record prunes its own steps, never one in
``protect``.

rollpoint's own record is :class:`~.workdir_record.WorkdirRecord` (``train_data.jsonl``
and ``checkpoints/`` in the workdir); a trainer with a checkpoint store of its own passes
its record to the trainer loop, the restorer and the façade instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.record.train_data import Coverage
from rollpoint.trainer.train_hooks import TrainSample


class StepRecord(Protocol):
    """What the trainer loop, the restorer and retention need of a trainer's record of
    its steps. Calls may block (file I/O): the loop makes them from a worker thread."""

    @property
    def keep(self) -> int:
        """How many of the newest durable steps the record keeps (besides protected ones)."""
        ...

    def available(self) -> list[TrainCheckpoint]:
        """Every durable step it can restore, newest first, ending with step 0
        (:data:`~.train_checkpoint.INITIAL`: every run composes with nothing trained)."""
        ...

    def steps(self) -> list[int]:
        """The durable steps present, oldest first (cheap: retention asks at every step)."""
        ...

    def progress(self) -> list[str]:
        """What a fresh start would lose, one phrase each (empty: nothing): a workdir that
        holds progress but no usable snapshot is refused with these, never wiped."""
        ...

    def check(self, checkpoint: TrainCheckpoint) -> None:
        """Before a restore installs anything: the record holds exactly what ``checkpoint``
        covers, or a :class:`~rollpoint.protocol.errors.RestoreError` names what differs
        (and nothing was changed)."""
        ...

    def cut_back(self, checkpoint: TrainCheckpoint) -> None:
        """After the restore installed: forget what was written past ``checkpoint`` (the
        steps trained after it are trained again)."""
        ...

    def write_step(self, step: int, samples: list[TrainSample], policy_version: int) -> Coverage:
        """Write durably what ``step`` trained (before it may become durable), and return
        what the record covers now. ``policy_version``: the policy's version when the
        step's rows were generated, for a sample with no model call (each call carries the
        version that answered it)."""
        ...

    def save(self, checkpoint: TrainCheckpoint, *, protect: Iterable[int] = ()) -> None:
        """Make ``checkpoint``'s step durable, then keep the :attr:`keep` newest steps and
        every one in ``protect``; a write that fails raises
        :class:`~rollpoint.protocol.errors.StorageError`."""
        ...
