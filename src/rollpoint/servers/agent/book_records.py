"""The session book's saved form as a checkpoint reads it.

Owns :data:`SessionEntry`, a session's entry in the book's state image (its record, or what
it is doing while away from a boundary), and :func:`select_records`, which picks a scope's
records out of a captured copy of that image, in the writer's thread. Building the entries,
capturing the image and installing records read back stay in
:mod:`rollpoint.servers.agent.session_book`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import JsonValue

from rollpoint.participant import episode_pairs
from rollpoint.protocol.errors import InvalidPhaseError
from rollpoint.protocol.ids import EpisodeId

__all__ = ["SessionEntry", "select_records"]

SessionEntry = tuple[int, tuple[dict[str, Any], ...] | str]
"""A session's entry in the book's state image: (attempt, its record), or, while the
session is away from a turn boundary (it cannot be saved then), (attempt, what it is doing)."""


def select_records(
    image: Mapping[str, SessionEntry],
    scope: Iterable[EpisodeId],
    finished: list[dict[str, JsonValue]],
) -> list[dict[str, JsonValue]]:
    """The records of the scoped sessions in ``image`` (a copy taken by a capture), then
    ``finished``. Runs in the writer's thread: it reads only the copy. A scoped session
    away from a boundary raises :class:`InvalidPhaseError` (readiness rules that out)."""
    records: list[dict[str, JsonValue]] = []
    for rollout_id, attempt in episode_pairs(scope):
        entry = image.get(rollout_id)
        if entry is None or entry[0] != attempt:
            continue
        saved = entry[1]
        if isinstance(saved, str):
            raise InvalidPhaseError(f"{saved}, not at a turn boundary")
        records.extend(saved)
    return [*records, *finished]
