"""rollpoint: checkpoint and recover in-flight multi-turn agent rollouts.

The package is split by which side of the wire a module lives on (docs/design.md#layout
says why, with the rules between the parts):

- ``protocol/``  wire models, ids and the error tree shared by both sides
- ``common/``    what every layer may use: stopping a task, the optional extras, import paths
- ``http/``      the one HTTP seam: app factory, client transport, auth
- ``participant/`` environment side: the participant SDK (public): hooks, fence, retire
  marks, gate, control routes, checkpoint writes, state images
- ``servers/``   environment side: the built-in model, agent and resources servers, each
  its own package, built only on ``participant/``
- ``agent_loops/`` environment side: custom agent loops, the agent server's plug-in
- ``envs/``      the environment interface, the built-in environments (workplace, blackjack,
  math) and the gymnasium: and verifiers: adapters
- ``policy/``    the scripted OpenAI-compatible policy
- ``tuning/``    performance tricks, reached through the checkpoint seam
- ``trainer/``   RL side: the trainer library (the trainer, train hooks, step record) with
  its machinery in sub-packages by role (state, control, dispatch, snapshot, restore, record)
- ``rollouts.py`` the trainer's façade (``sync_rollouts.py`` for a synchronous loop;
  ``preemption.py``, its signals)
- ``job/``       one run assembled (lock, resume point, servers, restore, trainer): what
  the façade and ``rollpoint run`` drive
- ``loop/``      the built-in training loop ``rollpoint run`` trains with, on the façade only
- ``store/``     snapshot store (the only place that knows about files)
- ``runtime/``   process launchers (the only place that knows about processes)
- ``testing/``   the test kit: fault proxy and transport, conformance kit, local cluster
- ``schemas/``   the JSON Schema of ``train_data.jsonl``, shipped with the package
- ``app/``       the ``rollpoint`` command: CLI, run config, report, chaos runner

The top level exports the trainer's façade (:class:`~rollpoint.rollouts.Rollouts`, see
docs/trainers.md), what it takes (the run config ``rollpoint run`` reads, or the job
settings it stands for) and every type its signatures take or return (the run's summary, a
save's report, the train hooks and the step record with theirs), imported on first use
(PEP 562), so that ``import rollpoint.protocol`` or the participant SDK does not load the
trainer side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpoint.app.config import RunConfig, load_config, parse_config
    from rollpoint.job.settings import JobConfig, JobSettings
    from rollpoint.preemption import StopRequest
    from rollpoint.protocol.deployment import ReplicaEndpoints, ServedDeployment
    from rollpoint.protocol.episode import TaskRow
    from rollpoint.protocol.errors import RollpointError, RunPreemptedError
    from rollpoint.rollouts import Rollouts, RunProgress, TrainBatch, load_served
    from rollpoint.sync_rollouts import SyncRollouts
    from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
    from rollpoint.trainer.record.train_data import Coverage
    from rollpoint.trainer.snapshot.cut import Blocker, SavePhase, SaveReport
    from rollpoint.trainer.step_record import StepRecord
    from rollpoint.trainer.train_hooks import (
        StepResult,
        TrainHooks,
        TrainSample,
        TrainTurn,
        token_segments,
    )
    from rollpoint.trainer.trainer import RunSummary

__version__ = "0.1.0"

__all__ = [
    "Blocker",
    "Coverage",
    "JobConfig",
    "JobSettings",
    "ReplicaEndpoints",
    "Rollouts",
    "RollpointError",
    "RunConfig",
    "RunPreemptedError",
    "RunProgress",
    "RunSummary",
    "SavePhase",
    "SaveReport",
    "ServedDeployment",
    "StepRecord",
    "StepResult",
    "StopRequest",
    "SyncRollouts",
    "TaskRow",
    "TrainBatch",
    "TrainCheckpoint",
    "TrainHooks",
    "TrainSample",
    "TrainTurn",
    "load_config",
    "load_served",
    "parse_config",
    "token_segments",
]

_HOMES = {
    "Rollouts": "rollpoint.rollouts",
    "TrainBatch": "rollpoint.rollouts",
    "SyncRollouts": "rollpoint.sync_rollouts",
    "RunProgress": "rollpoint.rollouts",
    "StopRequest": "rollpoint.preemption",
    "load_served": "rollpoint.rollouts",
    "ServedDeployment": "rollpoint.protocol.deployment",
    "ReplicaEndpoints": "rollpoint.protocol.deployment",
    "RollpointError": "rollpoint.protocol.errors",
    "RunPreemptedError": "rollpoint.protocol.errors",
    "TaskRow": "rollpoint.protocol.episode",
    "RunConfig": "rollpoint.app.config",
    "JobSettings": "rollpoint.job.settings",
    "JobConfig": "rollpoint.job.settings",
    "load_config": "rollpoint.app.config",
    "parse_config": "rollpoint.app.config",
    "TrainSample": "rollpoint.trainer.train_hooks",
    "TrainTurn": "rollpoint.trainer.train_hooks",
    "token_segments": "rollpoint.trainer.train_hooks",
    "Blocker": "rollpoint.trainer.snapshot.cut",
    "SavePhase": "rollpoint.trainer.snapshot.cut",
    "SaveReport": "rollpoint.trainer.snapshot.cut",
    "Coverage": "rollpoint.trainer.record.train_data",
    "TrainCheckpoint": "rollpoint.trainer.record.train_checkpoint",
    "RunSummary": "rollpoint.trainer.trainer",
    "StepRecord": "rollpoint.trainer.step_record",
    "StepResult": "rollpoint.trainer.train_hooks",
    "TrainHooks": "rollpoint.trainer.train_hooks",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rollpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
