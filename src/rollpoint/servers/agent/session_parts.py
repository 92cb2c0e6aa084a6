"""A saved session as a header and the full parts of its transcript: how an agent's records
grow with what changed, not with the whole transcript at every checkpoint.

Owns the split (made by :meth:`Session.export_records
<rollpoint.servers.agent.session.Session.export_records>`) and :func:`join_parts`, which the
book runs on records read back before validating them. A session's messages and model calls
are append-only; every :data:`PART_ITEMS` of them, once all there, make one
``session_part`` record that never changes again::

    {"kind": "session_part", "episode": {...}, "field": "messages", "index": 0, "items": [...]}

and the ``session`` record (the header) holds only the items after the last full part,
with ``message_parts`` and ``call_parts`` saying how many parts precede. A session that took
a turn since the last checkpoint hands out a new header (and a new part when one filled up)
and the same part records as before, which a snapshot's writer references instead of
writing again (:mod:`rollpoint.store.record_packs`). Measured by ``snapshot_growth``.

A record without ``message_parts`` and ``call_parts`` (written before the split) is a whole
session and loads as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollpoint.protocol.errors import InvalidCheckpointStateError

__all__ = ["PART_FIELDS", "PART_ITEMS", "grow_parts", "join_parts"]

PART_ITEMS = 8
"""Messages (or model calls) per part. Smaller parts write less per turn (a header holds
fewer than this many of each) but make more records to reference."""
PART_FIELDS = {"messages": "message_parts", "model_calls": "call_parts"}
"""A session field that is split, and the header key counting its parts."""


def grow_parts(
    parts: list[dict[str, Any]], field: str, items: list[Any], saved_for: dict[str, Any]
) -> None:
    """Append to ``parts`` a part record for every full run of :data:`PART_ITEMS` items
    of ``items`` not in a part yet (earlier parts are kept: the same objects)."""
    while (len(parts) + 1) * PART_ITEMS <= len(items):
        index = len(parts)
        parts.append(
            {
                "kind": "session_part",
                "episode": saved_for,
                "field": field,
                "index": index,
                "items": items[index * PART_ITEMS : (index + 1) * PART_ITEMS],
            }
        )


def join_parts(records: Iterable[Any]) -> list[Any]:
    """``records`` with every split session joined again into one whole ``session`` record
    (and the parts left out); anything else as it is, for validation to judge. A header
    naming a part that is not there, or a part no header names, is refused naming the
    session."""
    parts: dict[tuple[str, str], dict[int, Any]] = {}
    others: list[Any] = []
    for record in records:
        if isinstance(record, dict) and record.get("kind") == "session_part":
            key, field, index = _part_key(record)
            found = parts.setdefault((key, field), {})
            if index in found:
                raise InvalidCheckpointStateError(
                    f"agent record: session {key} saved {field} part {index} twice"
                )
            found[index] = record.get("items")
        else:
            others.append(record)
    joined: list[Any] = []
    used: set[tuple[str, str]] = set()
    for record in others:
        if (
            isinstance(record, dict)
            and record.get("kind") == "session"
            and any(name in record for name in PART_FIELDS.values())
        ):
            record = _joined(record, parts, used)
        joined.append(record)
    stray = sorted(set(parts) - used)
    if stray:
        key, field = stray[0]
        raise InvalidCheckpointStateError(
            f"agent record: {field} parts of session {key} saved without their session"
        )
    return joined


def _part_key(record: dict[str, Any]) -> tuple[str, str, int]:
    episode, field, index = record.get("episode"), record.get("field"), record.get("index")
    if (
        not isinstance(episode, dict)
        or field not in PART_FIELDS
        or not isinstance(index, int)
        or isinstance(index, bool)
        or not isinstance(record.get("items"), list)
    ):
        raise InvalidCheckpointStateError(
            "agent record: a session_part needs episode, field (messages or model_calls), "
            "an integer index and a list of items"
        )
    return f"{episode.get('rollout_id')}#{episode.get('attempt')}", field, index


def _joined(
    record: dict[str, Any], parts: dict[tuple[str, str], dict[int, Any]], used: set[tuple[str, str]]
) -> dict[str, Any]:
    episode = record.get("episode")
    key = (
        f"{episode.get('rollout_id')}#{episode.get('attempt')}"
        if isinstance(episode, dict)
        else "?"
    )
    whole = dict(record)
    for field, count_key in PART_FIELDS.items():
        count = whole.pop(count_key, 0)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidCheckpointStateError(
                f"agent record: session {key} has {count_key} {count!r}, not a count"
            )
        found = parts.get((key, field), {})
        used.add((key, field))
        if sorted(found) != list(range(count)):
            missing = sorted(set(range(count)) - set(found))
            what = f"part {missing[0]} is missing" if missing else "it has more parts"
            raise InvalidCheckpointStateError(
                f"agent record: session {key} names {count} {field} parts, but {what}"
            )
        tail = whole.get(field)
        if not isinstance(tail, list):
            continue  # validation names the field
        items: list[Any] = []
        for index in range(count):
            items.extend(found[index])
        whole[field] = [*items, *tail]
    return whole
