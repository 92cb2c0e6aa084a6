"""The trainer side: recovery ledger, dispatch barrier, dispatcher, TQ, GRPO, the train loop.

Everything here runs in the trainer process and reaches the environment over HTTP
(:class:`~rollpoint.http.client.HttpClient`); control calls go through a
:class:`~rollpoint.trainer.control_transport.ControlTransport`, HTTP in a run. The snapshot coordinator composes these
parts through a :class:`Trainer`'s ``ledger``, ``barrier``, ``tq`` and ``dispatcher``.

The library reads no run config: it is told what it needs as :class:`TrainerSettings` and
:class:`SaveSettings` (``rollpoint run`` builds them from its YAML).
"""

from rollpoint.trainer.cut import Blocker, SavePhase, SaveReport
from rollpoint.trainer.dispatch_barrier import DispatchBarrier
from rollpoint.trainer.dispatcher import Dispatcher, GroupOutcome
from rollpoint.trainer.finished_queue import FinishedQueue, GroupBatch
from rollpoint.trainer.grpo import advantages_by_episode, group_advantages
from rollpoint.trainer.ledger import (
    LedgerMove,
    LedgerRecord,
    RecoveryLedger,
    RolloutState,
)
from rollpoint.trainer.settings import SaveSettings, TrainerSettings
from rollpoint.trainer.train_hooks import StepResult, TrainHooks, TrainSample
from rollpoint.trainer.trainer_loop import RunSummary, Trainer, TrainerStats

__all__ = [
    "Blocker",
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
    "StepResult",
    "TrainHooks",
    "TrainSample",
    "Trainer",
    "TrainerSettings",
    "TrainerStats",
    "advantages_by_episode",
    "group_advantages",
]
