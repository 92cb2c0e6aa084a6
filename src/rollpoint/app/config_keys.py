"""The config's keys by name: "did you mean" for a key the config does not have.

Owns :func:`did_you_mean`: for an unknown key at a path in :class:`~rollpoint.app.config.RunConfig`
(``policy.base_ur``), the closest key of that section (``base_url``), found with
:mod:`difflib`; and :func:`config_keys`, every key as a dotted path (the docs' settings
are checked against it).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Sequence

from pydantic import BaseModel


def _section(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    field = model.model_fields.get(name)
    annotation = None if field is None else field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def did_you_mean(model: type[BaseModel], loc: Sequence[int | str]) -> str:
    """`` (did you mean 'base_url'?)`` for the unknown key at ``loc``, or ``""``."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        if section is None or not isinstance(part, str):
            return ""
        section = _section(section, part)
    if section is None or not loc or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def config_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every key of ``model`` as a dotted path, sections and their keys."""
    for name in model.model_fields:
        path = f"{prefix}{name}"
        yield path
        section = _section(model, name)
        if section is not None:
            yield from config_keys(section, f"{path}.")
