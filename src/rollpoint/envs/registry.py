"""Which environment a config or a task row names: a reference → an :class:`Environment` class.

Owns resolving an environment *reference*, which is one of:

- a built-in name (``workplace``, ``blackjack``, ``math``);
- a name an installed package registers in the entry-point group ``rollpoint.environments``
  (``[project.entry-points."rollpoint.environments"] sandbox = "sandbox_env:SandboxEnvironment"``);
- an import path ``package.module:ClassName``;
- ``gymnasium:<env id>``: a registered Gymnasium environment (``rollpoint.envs.gymnasium_env``);
- ``verifiers:<module>[:<attr>]``: a verifiers ``MultiTurnEnv`` (``rollpoint.envs.verifiers_env``);
- ``mcp:<spec file>``: the tools of an MCP server (``rollpoint.envs.mcp_env``);
- ``openenv:<module>:<app>`` or ``openenv:http://host:port``: an OpenEnv environment server
  (``rollpoint.envs.openenv_env``);
- ``nemo-gym:http://host:port@<rows.jsonl>``: a NeMo-Gym resources server
  (``rollpoint.envs.nemo_gym_env``).

Every failure is one :class:`ConfigError` line naming the reference and what was tried: a
name nothing provides, a module that fails to import, a missing attribute, something that is
not an :class:`Environment` subclass, or a name two providers claim. The config is resolved
when it is loaded, before any server starts; each server process resolves the same
reference again (servers are separate processes); resolutions are kept per process, and a
task row off the wire is matched against them without importing anything.

What each environment does lives in its own module; this one owns only the lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from rollpoint.common.import_path import is_import_path, load_class
from rollpoint.envs.base import Environment, check_declarations
from rollpoint.envs.blackjack import BlackjackEnvironment
from rollpoint.envs.math import MathEnvironment
from rollpoint.envs.tool_call import check_tools
from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.protocol.errors import ConfigError

ENTRY_POINT_GROUP = "rollpoint.environments"

_BUILTIN: dict[str, type[Environment[Any]]] = {
    cls.name: cls for cls in (WorkplaceEnvironment, BlackjackEnvironment, MathEnvironment)
}

ADAPTERS: dict[str, tuple[str, str]] = {
    "gymnasium:": ("rollpoint.envs.gymnasium_env", "gymnasium_environment"),
    "verifiers:": ("rollpoint.envs.verifiers_env", "verifiers_environment"),
    "mcp:": ("rollpoint.envs.mcp_env", "mcp_environment"),
    "openenv:": ("rollpoint.envs.openenv_env", "openenv_environment"),
    "nemo-gym:": ("rollpoint.envs.nemo_gym_env", "nemo_gym_environment"),
}
"""A reference's prefix → the adapter module and its factory (reference → class). Each
module is imported only when a reference names it: every server process resolves its
environment, and the adapters' imports (httpx, yaml, their models) cost ~0.1 s of CPU in
each process that would not use them."""


def adapter_prefix(ref: str) -> str | None:
    """The :data:`ADAPTERS` prefix ``ref`` starts with, if any."""
    return next((prefix for prefix in ADAPTERS if ref.startswith(prefix)), None)


def _entry_points() -> list[EntryPoint]:
    return list(entry_points(group=ENTRY_POINT_GROUP))


def _provider(ep: EntryPoint) -> str:
    dist = ep.dist
    return f"package {dist.name}" if dist is not None else f"entry point {ep.value}"


def environment_names() -> list[str]:
    """The names a config may use without an import path: built-ins and registered, sorted."""
    return sorted(set(_BUILTIN) | {ep.name for ep in _entry_points()})


def _load_import_path(ref: str, *, via: str) -> type[Environment[Any]]:
    cls: type[Environment[Any]] = load_class(
        ref, Environment, what="environment", base_name="rollpoint.envs.Environment", via=via
    )
    if not isinstance(getattr(cls, "name", None), str):
        raise ConfigError(f"environment {via}: {ref} has no class attribute 'name' (a string)")
    return cls


_RESOLVED: dict[str, type[Environment[Any]]] = {}
"""Every reference this process resolved, and its class: what :func:`environment_matches`
may consult without importing anything."""


def resolve_environment(ref: str) -> type[Environment[Any]]:
    """The class ``ref`` names (see the module docstring); ConfigError saying what was tried."""
    cls = _RESOLVED.get(ref)
    if cls is None:
        cls = _RESOLVED[ref] = _resolve(ref)
    return cls


def _resolve(ref: str) -> type[Environment[Any]]:
    prefix = adapter_prefix(ref)
    if prefix is not None:
        module, factory = ADAPTERS[prefix]
        make: Callable[[str], type[Environment[Any]]] = getattr(
            importlib.import_module(module), factory
        )
        return make(ref)
    if is_import_path(ref):
        return _load_import_path(ref, via=repr(ref))
    claims = [ep for ep in _entry_points() if ep.name == ref]
    providers = (["rollpoint (built-in)"] if ref in _BUILTIN else []) + [
        _provider(ep) for ep in claims
    ]
    if len(providers) > 1:
        raise ConfigError(
            f"environment {ref!r} is claimed by {' and '.join(sorted(set(providers)))}"
            f" (entry-point group {ENTRY_POINT_GROUP}); name it by import path instead"
        )
    if ref in _BUILTIN:
        return _BUILTIN[ref]
    if claims:
        (ep,) = claims
        return _load_import_path(ep.value, via=f"{ref!r} ({_provider(ep)}: {ep.value})")
    raise ConfigError(
        f"unknown environment {ref!r} (valid: {', '.join(environment_names())};"
        f" or an import path package.module:ClassName, gymnasium:<env id>,"
        f" verifiers:<module>, mcp:<spec file>, openenv:<module>:<app>"
        f" or nemo-gym:<url>@<rows.jsonl>)"
    )


def get_environment(ref: str) -> Environment[Any]:
    """A new instance of the environment ``ref`` names; ConfigError saying what was tried,
    or naming a tool whose function fits no calling convention (:func:`check_tools`)."""
    cls = resolve_environment(ref)
    try:
        environment = cls()
    except ConfigError:
        raise  # already says what is wrong (a missing extra: rollpoint.common.extras)
    except Exception as exc:
        raise ConfigError(
            f"environment {ref!r}: {cls.__qualname__}() failed ({type(exc).__name__}: {exc})"
        ) from None
    check_tools(environment)
    check_declarations(environment)
    return environment


def environment_matches(
    ref: str,
    environment: Environment[Any] | type[Environment[Any]],
    *,
    resolve: bool = False,
) -> bool:
    """Whether a task row's ``environment`` names this environment: its own ``name``, or a
    reference that resolves to its class (a row may name it by import path or entry point).

    ``resolve=False`` (servers: rows come off the wire) consults only the references this
    process already resolved and imports nothing: a request must never make a server import
    a module it names. ``resolve=True`` (a local dataset) resolves ``ref`` if need be."""
    cls = environment if isinstance(environment, type) else type(environment)
    if ref == cls.name:
        return True
    if not resolve:
        return _RESOLVED.get(ref) is cls
    try:
        return resolve_environment(ref) is cls
    except ConfigError:
        return False
