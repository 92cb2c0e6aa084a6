"""The trainer side: recovery ledger, dispatch barrier, dispatcher, TQ, GRPO, the train loop.

Everything here runs in the trainer process and reaches the environment over HTTP
(:class:`~rollpoint.http.client.HttpClient`); control calls go through a
:class:`~rollpoint.trainer.control.control_transport.ControlTransport`, HTTP in a run. The snapshot coordinator composes these
parts through a :class:`Trainer`'s ``ledger``, ``barrier``, ``tq`` and ``dispatcher``.

What the trainer trained and which steps are durable is kept by a :class:`StepRecord`
(rollpoint's own: :class:`WorkdirRecord`, ``train_data.jsonl`` and ``checkpoints/``).

The library reads no run config: it is told what it needs as :class:`TrainerSettings` and
:class:`SaveSettings` (``rollpoint run`` builds them from its YAML).
"""

from rollpoint.trainer.dispatch.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatch.dispatcher import Dispatcher, GroupOutcome
from rollpoint.trainer.grpo import advantages_by_episode, group_advantages
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.record.train_data import Coverage
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.settings import SaveSettings, TrainerSettings
from rollpoint.trainer.snapshot.cut import Blocker, SavePhase, SaveReport
from rollpoint.trainer.state.finished_queue import FinishedQueue, GroupBatch
from rollpoint.trainer.state.ledger import (
    LedgerMove,
    LedgerRecord,
    RecoveryLedger,
    RolloutState,
)
from rollpoint.trainer.step_record import StepRecord
from rollpoint.trainer.train_hooks import StepResult, TrainHooks, TrainSample
from rollpoint.trainer.trainer import RunSummary, Trainer, TrainerStats

__all__ = [
    "Blocker",
    "Coverage",
    "DispatchBarrier",
    "Dispatcher",
    "FinishedQueue",
    "GroupBatch",
    "GroupOutcome",
    "LedgerMove",
    "LedgerRecord",
    "RecoveryLedger",
    "RolloutState",
    "RunSummary",
    "SavePhase",
    "SaveReport",
    "SaveSettings",
    "StepRecord",
    "StepResult",
    "TrainCheckpoint",
    "TrainHooks",
    "TrainSample",
    "Trainer",
    "TrainerSettings",
    "TrainerStats",
    "WorkdirRecord",
    "advantages_by_episode",
    "group_advantages",
]
