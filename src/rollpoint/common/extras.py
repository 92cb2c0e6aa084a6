"""The optional dependencies: which extra provides which import, and the error naming it.

Owns :data:`EXTRAS` (an extra → the top-level modules it brings) and :func:`need`, which a
feature calls before importing them. A plain ``pip install rollpoint`` imports the trainer,
the participant SDK, the environments and the protocol; a feature whose extra is missing
refuses in one line, a :class:`~rollpoint.protocol.errors.ConfigError` (an installation is
user input, like a config: the CLI prints it and exits 2)::

    the Ray runtime (runtime: ray) needs the 'ray' extra: pip install 'rollpoint[ray]'

The modules themselves are still imported where they are used (inside the function, so a
type checker sees the real module); ``tests/integration/test_no_extras.py`` checks it in a
virtual environment without them.
"""

from __future__ import annotations

import importlib.util

from rollpoint.protocol.errors import ConfigError

EXTRAS: dict[str, tuple[str, ...]] = {
    "ray": ("ray",),
    "gym": ("gymnasium", "numpy"),
    "metrics": ("prometheus_client",),
    "cli": ("typer", "rich"),
    "report": ("matplotlib",),
    "s3": ("s3fs",),
    "verifiers": ("verifiers", "datasets"),
    "mcp": ("mcp",),
    "openenv": ("openenv",),  # websockets comes with it
    "parquet": ("pyarrow",),
    "datasets": ("datasets", "pyarrow"),
}
"""Each extra of pyproject.toml's ``[project.optional-dependencies]`` and what it brings
(``all`` is every one of them; ``cli`` brings ``metrics`` too)."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (empty: it is installed)."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def need(extra: str, feature: str) -> None:
    """Refuse ``feature`` in one line unless every module of ``extra`` can be imported."""
    if missing(extra):
        raise ConfigError(extra_message(extra, feature))


def extra_message(extra: str, feature: str) -> str:
    return f"{feature} needs the '{extra}' extra: pip install 'rollpoint[{extra}]'"
