"""One episode of a resources server as a checkpoint saves it, and the packing of its state.

Owns :class:`EpisodeRecord` (the task, the environment's export, the idempotency table:
enough to continue the episode exactly, with no tool side effect applied twice), the
fingerprint of a tool call that the table keeps per key (:func:`call_fingerprint`), the packed
form of an export (:func:`pack_state`: JSON, zlib, base64) and the records of a checkpoint's
scope from a captured state image (:func:`episode_records`).

Does not own the episodes themselves nor when they are saved
(:mod:`rollpoint.servers.resources.episode_service`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import zlib
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, JsonValue, StringConstraints, model_validator

from rollpoint.participant import RecordMemo, latest_attempts
from rollpoint.protocol.episode import EnvironmentName, TaskRow, ToolResult
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId, Identifier
from rollpoint.protocol.model_base import StrictModel


class ToolResultRecord(StrictModel):
    turn: Annotated[int, Field(ge=0)]
    call_index: Annotated[int, Field(ge=0)]
    result: ToolResult
    fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    """:func:`call_fingerprint` of the call that made ``result``; a replay of the key with
    another fingerprint is refused. None in records saved before fingerprints: any call
    under such a key replays its result, as it did then."""


def call_fingerprint(tool_name: str, raw_arguments: str) -> str:
    """sha256 (hex) of the tool's name and the canonical JSON of the call's arguments.

    Arguments that parse as JSON are compared by value (key order and spacing do not
    count; "" is ``{}``, as the tool sees it); malformed ones by their exact text.
    """
    arguments: bytes
    if not raw_arguments.strip():
        arguments = b"{}"
    else:
        try:
            arguments = orjson.dumps(orjson.loads(raw_arguments), option=orjson.OPT_SORT_KEYS)
        except orjson.JSONDecodeError:
            arguments = b"raw:" + raw_arguments.encode("utf-8", "surrogatepass")
    hasher = hashlib.sha256(tool_name.encode("utf-8", "surrogatepass"))
    hasher.update(b"\x00")
    hasher.update(arguments)
    return hasher.hexdigest()


class EpisodeRecord(StrictModel):
    """One episode as a checkpoint saves it: enough to continue it exactly."""

    kind: Literal["episode_state"] = "episode_state"
    episode: EpisodeId | None = None
    """The scoped attempt it was saved for (a checkpoint sets it); the state belongs to the
    rollout, whatever the attempt."""
    rollout_id: Identifier
    environment: EnvironmentName
    task: TaskRow
    state: dict[str, JsonValue] | None = None
    """The environment's own export (``Environment.export_state``), as is. Checkpoints
    write ``packed_state`` instead; records with ``state`` (older snapshots, the export
    route) are read as before."""
    packed_state: str | None = None
    """The same export as base64 of zlib-compressed JSON: a workplace SQLite export shrinks
    about 30 times, and compressing costs less than writing the bytes saved."""
    fresh_start: bool = False
    """No tool call had touched the episode and its environment starts reproducibly
    (``Environment.reproducible_start``): its state is ``start(task)``, carried by neither
    ``state`` nor ``packed_state``."""
    tool_results: list[ToolResultRecord]
    """The idempotency table, so a restored episode never repeats a side effect."""

    @model_validator(mode="after")
    def _one_state(self) -> EpisodeRecord:
        forms = (self.state is not None) + (self.packed_state is not None) + self.fresh_start
        if forms != 1:
            raise ValueError(
                "a record carries exactly one of 'state', 'packed_state' and 'fresh_start'"
            )
        return self

    def exported_state(self) -> dict[str, JsonValue]:
        """The environment's export, unpacked if packed; InvalidCheckpointStateError if the
        packed form does not decode to a JSON object."""
        if self.state is not None:
            return self.state
        assert self.packed_state is not None
        try:
            state = orjson.loads(
                zlib.decompress(base64.b64decode(self.packed_state, validate=True))
            )
        except (binascii.Error, zlib.error, orjson.JSONDecodeError) as exc:
            raise InvalidCheckpointStateError(
                f"packed_state does not decode ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(state, dict):
            raise InvalidCheckpointStateError("packed_state is not a JSON object")
        return state


def pack_state(state: Mapping[str, Any]) -> str:
    """An environment export as :attr:`EpisodeRecord.packed_state`. Level 1: a snapshot's
    writer pays for it (:meth:`ResourcesService.capture`), and the higher
    levels save little more on SQLite pages."""
    return base64.b64encode(zlib.compress(orjson.dumps(state), 1)).decode("ascii")


def episode_records(
    image: Mapping[str, dict[str, Any]],
    scope: Iterable[EpisodeId],
    memo: RecordMemo | None = None,
) -> list[dict[str, Any]]:
    """``EpisodeRecord`` JSON data of each scoped rollout in a captured image, saved for
    the rollout's highest scoped attempt (runs in the writer's thread, on the copy). With
    ``memo``, an entry unchanged since the last build gives the same record object (and
    the memo is rotated: one build per write)."""
    records: list[dict[str, Any]] = []
    for rollout_id, attempt in latest_attempts(scope).items():
        entry = image.get(rollout_id)
        if entry is not None:
            make = partial(_episode_record, rollout_id, attempt, entry)
            records.append(make() if memo is None else memo.record(entry, attempt, make))
    if memo is not None:
        memo.rotate()
    return records


def _episode_record(rollout_id: str, attempt: int, entry: dict[str, Any]) -> dict[str, Any]:
    saved_for = {"rollout_id": rollout_id, "attempt": attempt}
    return {"kind": "episode_state", "episode": saved_for, **entry}
