"""The same record object again while what it is made of is unchanged: :class:`RecordMemo`.

Owns the memo a participant builds its exported records through when each record wraps a
value it keeps unchanged between checkpoints (a model call's dump, a state image entry) in
a new dict per export (``{"kind": ..., "episode": ..., "call": dump}``). A snapshot's writer
(:mod:`rollpoint.store.record_packs`) finds a record handed to its previous write by
identity, one dict look-up, and references where it was written; a new dict of equal
content it must encode and hash to find. Justified by ``snapshot_growth`` (``write``).

Entries hold their source and record, so an id is never reused while remembered; each
:meth:`RecordMemo.rotate` (once per build of a write's records) forgets what that build did
not ask for, so the memo holds at most one write's records. Not thread-safe: a participant
builds one write's records at a time (:mod:`rollpoint.participant.checkpoint_write` awaits
the previous write before it captures again).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["RecordMemo"]


class RecordMemo:
    """Records by the identity of what they are made of, and a key (the attempt saved for)."""

    __slots__ = ("_last", "_next")

    def __init__(self) -> None:
        self._last: dict[int, tuple[object, Hashable, dict[str, Any]]] = {}
        self._next: dict[int, tuple[object, Hashable, dict[str, Any]]] = {}

    def record(
        self, source: object, key: Hashable, make: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """The record made of ``source`` for ``key``: the one handed out last time if both
        are the same, else ``make()``."""
        found = self._last.get(id(source))
        if found is not None and found[0] is source and found[1] == key:
            record = found[2]
        else:
            record = make()
        self._next[id(source)] = (source, key, record)
        return record

    def rotate(self) -> None:
        """End a build: remember what it asked for, forget the rest."""
        self._last, self._next = self._next, {}
