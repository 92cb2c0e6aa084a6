"""The trainer library: the trainer loop and what a trainer author or a custom step record needs.

A run's trainer (:class:`Trainer`, in :mod:`~rollpoint.trainer.trainer`) plays prompt groups
on the environment over HTTP, trains on whole finished groups through :class:`TrainHooks`,
and takes consistent snapshots with the environment. Its machinery lives in sub-packages by
role, each importing only those below it: ``state/`` (the recovery ledger and the finished
queue), ``control/`` (one client per participant, the replica roster), ``dispatch/`` (the
dispatcher and its barrier), ``snapshot/`` (the coordinator's cut), ``restore/`` (the restore
order, a lost replica's episodes). ``record/`` is rollpoint's own :class:`StepRecord`
(:class:`WorkdirRecord`: ``train_data.jsonl`` and ``checkpoints/``).

This package's names are what a trainer author or a custom :class:`StepRecord` needs; the
machinery's classes are imported from their modules. The library reads no run config: it is
told what it needs as :class:`TrainerSettings` and :class:`SaveSettings` (``rollpoint run``
builds them from its YAML).
"""

from rollpoint.trainer.grpo import advantages_by_episode, group_advantages
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.record.train_data import Coverage
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.settings import SaveSettings, TrainerSettings
from rollpoint.trainer.snapshot.cut import Blocker, SavePhase, SaveReport
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import StepResult, TrainHooks, TrainSample, TrainTurn
from rollpoint.trainer.trainer import RunSummary, Trainer, TrainerStats

__all__ = [
    "Blocker",
    "Coverage",
    "RunSummary",
    "SavePhase",
    "SaveReport",
    "SaveSettings",
    "StepRecord",
    "StepResult",
    "TrainCheckpoint",
    "TrainHooks",
    "TrainSample",
    "TrainTurn",
    "Trainer",
    "TrainerSettings",
    "TrainerStats",
    "WorkdirRecord",
    "advantages_by_episode",
    "group_advantages",
]
