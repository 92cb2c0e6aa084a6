"""rollpoint: checkpoint and recover in-flight multi-turn agent rollouts.

The package is split by which side of the wire a module lives on:

- ``protocol/``  wire models, ids and the error tree shared by both sides
- ``http/``      the one HTTP seam: app factory, client transport, auth
- ``participant/`` environment side: the participant SDK (public): hooks, fence, retire
  marks, gate, control routes, checkpoint writes, state images
- ``servers/``   environment side: the built-in model, agent and resources servers, each
  its own package, built only on ``participant/``
- ``envs/``      built-in environments (workplace, blackjack, math)
- ``policy/``    the scripted OpenAI-compatible policy
- ``trainer/``   RL side: ledger, dispatcher, finished-rollout queue, trainer loop
- ``loop/``      the built-in loop ``rollpoint run`` trains with, on the façade only
- ``store/``     snapshot store (the only place that knows about files)
- ``runtime/``   process launchers (the only place that knows about processes)

The top level exports the trainer's façade (:class:`~rollpoint.rollouts.Rollouts`, see
docs/trainers.md) and the config it takes, imported on first use (PEP 562), so that
``import rollpoint.protocol`` or the participant SDK does not load the trainer side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpoint.app.config import RunConfig, load_config, parse_config
    from rollpoint.preemption import StopRequest
    from rollpoint.protocol.deployment import ReplicaEndpoints, ServedDeployment
    from rollpoint.protocol.episode import TaskRow
    from rollpoint.protocol.errors import RollpointError, RunPreemptedError
    from rollpoint.rollouts import Rollouts, RunProgress, SyncRollouts, TrainBatch, load_served
    from rollpoint.trainer.train_hooks import TrainSample, TrainTurn, token_segments

__version__ = "0.1.0"

__all__ = [
    "ReplicaEndpoints",
    "Rollouts",
    "RollpointError",
    "RunConfig",
    "RunPreemptedError",
    "RunProgress",
    "ServedDeployment",
    "StopRequest",
    "SyncRollouts",
    "TaskRow",
    "TrainBatch",
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
    "SyncRollouts": "rollpoint.rollouts",
    "RunProgress": "rollpoint.rollouts",
    "StopRequest": "rollpoint.preemption",
    "load_served": "rollpoint.rollouts",
    "ServedDeployment": "rollpoint.protocol.deployment",
    "ReplicaEndpoints": "rollpoint.protocol.deployment",
    "RollpointError": "rollpoint.protocol.errors",
    "RunPreemptedError": "rollpoint.protocol.errors",
    "TaskRow": "rollpoint.protocol.episode",
    "RunConfig": "rollpoint.app.config",
    "load_config": "rollpoint.app.config",
    "parse_config": "rollpoint.app.config",
    "TrainSample": "rollpoint.trainer.train_hooks",
    "TrainTurn": "rollpoint.trainer.train_hooks",
    "token_segments": "rollpoint.trainer.train_hooks",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rollpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
