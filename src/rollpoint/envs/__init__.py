"""Environments: the interface an environment author implements, the built-ins, and the lookup.

Everything an environment author needs is importable from here (``__all__`` is the public,
pinned surface; the submodules are not): the :class:`Environment` base class with its
:class:`Tool` entries and :class:`ToolArguments` models, the task and verifier wire models
(:class:`TaskRow`, :class:`VerifyReply`), :class:`CheckpointMode`, the errors an environment
raises, the call context a tool may take (:class:`ToolContext`) and the
:func:`slow_tool` mark, what an environment's ``reconcile`` hook is asked about an effect in
doubt and answers (:class:`InDoubtEffect`, :class:`Reconciled`), task datasets (:func:`load_tasks`, :func:`write_tasks`) and the lookup of an
environment reference (a built-in name, a name registered in the entry-point group
:data:`ENTRY_POINT_GROUP`, or an import path ``package.module:ClassName``).
See docs/environments.md.
"""

from rollpoint.envs.base import Environment, NoArguments, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.dataset import load_tasks, write_tasks
from rollpoint.envs.effects import InDoubtEffect, Reconciled
from rollpoint.envs.registry import (
    ENTRY_POINT_GROUP,
    environment_matches,
    environment_names,
    get_environment,
    resolve_environment,
)
from rollpoint.envs.tool_call import ToolContext, slow_tool
from rollpoint.protocol.episode import TaskRow, VerifyReply
from rollpoint.protocol.errors import ConfigError, EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.participant import CheckpointMode

__all__ = [
    "ENTRY_POINT_GROUP",
    "CheckpointMode",
    "ConfigError",
    "Environment",
    "EpisodeError",
    "InDoubtEffect",
    "InvalidCheckpointStateError",
    "NoArguments",
    "Reconciled",
    "TaskRow",
    "Tool",
    "ToolArgumentError",
    "ToolArguments",
    "ToolContext",
    "VerifyReply",
    "environment_matches",
    "environment_names",
    "get_environment",
    "load_tasks",
    "resolve_environment",
    "slow_tool",
    "write_tasks",
]
