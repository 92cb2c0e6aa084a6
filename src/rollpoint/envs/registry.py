"""The registry of built-in environments: a name from a config or a task row → an instance.

Owns only the name → class table; what each environment does lives in its own module.
"""

from __future__ import annotations

from typing import Any

from rollpoint.envs.base import Environment
from rollpoint.envs.blackjack import BlackjackEnvironment
from rollpoint.envs.math import MathEnvironment
from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.protocol.errors import ConfigError

_ENVIRONMENTS: dict[str, type[Environment[Any]]] = {
    cls.name: cls for cls in (WorkplaceEnvironment, BlackjackEnvironment, MathEnvironment)
}


def environment_names() -> list[str]:
    """The names of the built-in environments, sorted."""
    return sorted(_ENVIRONMENTS)


def get_environment(name: str) -> Environment[Any]:
    """A new instance of the environment called ``name``; ConfigError naming the valid ones."""
    cls = _ENVIRONMENTS.get(name)
    if cls is None:
        valid = ", ".join(environment_names())
        raise ConfigError(f"unknown environment {name!r} (valid: {valid})")
    return cls()
