"""Built-in environments (workplace, blackjack, math), their interface and task datasets."""

from rollpoint.envs.base import Environment, Tool, ToolArgumentError, ToolArguments
from rollpoint.envs.dataset import load_tasks, write_tasks
from rollpoint.envs.registry import environment_names, get_environment

__all__ = [
    "Environment",
    "Tool",
    "ToolArgumentError",
    "ToolArguments",
    "environment_names",
    "get_environment",
    "load_tasks",
    "write_tasks",
]
