"""Import paths ``package.module:ClassName``: the class one names, checked against a base class.

Owns loading what a config names by import path (an environment, an agent loop), with each
failure one :class:`ConfigError` line naming the reference and what went wrong: a malformed
path, a module that fails to import (its exception quoted), a missing attribute, something
that is not a subclass of the base, an abstract class. What the names mean (built-in names,
entry points) is each caller's.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from rollpoint.protocol.errors import ConfigError

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_import_path(ref: str) -> bool:
    return ":" in ref


def load_class(
    ref: str, base: type[object], *, what: str, base_name: str, via: str | None = None
) -> type[Any]:
    """The class ``ref`` (``package.module:ClassName``) names, a concrete subclass of
    ``base``. ``what`` names the kind in errors (``environment``), ``base_name`` the base
    as users import it (``rollpoint.envs.Environment``), ``via`` how the reference was
    reached (default: the reference itself)."""
    via = via or repr(ref)
    if not _IMPORT_PATH.match(ref):
        raise ConfigError(f"{what} {via}: not an import path (want package.module:ClassName)")
    module_name, _, attr_path = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure of the author's module is the user's to read
        raise ConfigError(
            f"{what} {via}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    value: object = module
    for part in attr_path.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigError(
                f"{what} {via}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not (inspect.isclass(value) and issubclass(value, base)):
        raise ConfigError(
            f"{what} {via}: {ref} is {_describe(value)}, not a subclass of {base_name}"
        )
    if inspect.isabstract(value):
        missing = ", ".join(sorted(getattr(value, "__abstractmethods__", ())))
        raise ConfigError(f"{what} {via}: {ref} is abstract (does not define {missing})")
    return value


def _describe(value: object) -> str:
    if inspect.isclass(value):
        return f"the class {value.__module__}.{value.__qualname__}"
    return f"a {type(value).__name__}"
