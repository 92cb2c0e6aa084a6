"""The run's event log: ``<workdir>/run_events.jsonl``, one versioned JSON line per event.

Owns the line format (one pydantic model per ``kind``, every line ``{"v": 1, "ts": ...,
"kind": ...}``), the writer the run calls (:class:`RunEvents`) and the reader
(:func:`read_events`). It records what ``metrics.jsonl`` does not: when a run (or a rerun
of it) started and ended, each restore's outcome, train steps, replicas lost and back,
preemptions, and samples of the episodes in flight per replica. ``rollpoint report``
draws the run from it; nothing on the recovery path reads it.

Writing is best effort and cheap: one ``write`` of one line on a file opened for append,
no fsync (an event lost in a crash costs a mark on a plot, never progress), and a failing
disk is logged once, never raised into the run. Reading takes every line it can: a torn
last line (the writer was killed mid-write) is skipped, and so is a line of a newer
version (counted, so the report can say so). The format is documented in docs/guide.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final, Literal

import orjson
from pydantic import Field, JsonValue, NonNegativeInt, TypeAdapter, ValidationError

from rollpoint.protocol.model_base import StrictModel

log = logging.getLogger(__name__)

EVENTS_FILE = "run_events.jsonl"
EVENTS_VERSION: Final = 1
"""Bump it when a kind changes incompatibly; new kinds and new optional fields are additive."""


class _Event(StrictModel):
    v: Literal[1] = EVENTS_VERSION
    ts: float
    """Wall-clock Unix seconds when it happened."""


class RunStart(_Event):
    """The process started the job: a first run or a rerun that resumes it."""

    kind: Literal["run_start"] = "run_start"
    pid: NonNegativeInt
    runtime: str
    replicas: list[str]
    resume_from: str | None
    """The snapshot id it resumes from, None on a fresh start."""
    config: dict[str, JsonValue]
    """The run's config as loaded (paths as strings, secrets redacted)."""


class RunEnd(_Event):
    """The job finished (absent when the process died: the report calls that a crash)."""

    kind: Literal["run_end"] = "run_end"
    episodes: NonNegativeInt
    train_steps: NonNegativeInt
    failed_groups: NonNegativeInt
    elapsed_s: float


class Restore(_Event):
    """A rerun restored a snapshot: what became of the episodes the crash interrupted."""

    kind: Literal["restore"] = "restore"
    snapshot_id: str
    train_step: NonNegativeInt
    continued: NonNegativeInt
    """Saved episodes that continue from their last completed turn (attempt + 1)."""
    restarted: NonNegativeInt
    """Episodes that start over under new rollout ids."""
    adopted: NonNegativeInt
    """Finished replies the agents held at the cut, taken without a rerun."""
    requeued: NonNegativeInt
    """finished-queue items no durable train checkpoint consumed, back for training."""
    turns_kept: NonNegativeInt
    """Policy calls the continued episodes had completed at the cut: not asked again."""
    snapshot_pause_ended_at: float | None = None
    """When the snapshot's pause ended (its cut), from its manifest: the report draws the
    snapshot from it when the killed run wrote no metrics line for it."""
    snapshot_pause_s: float | None = None
    journal_turns: dict[str, NonNegativeInt] | None = None
    """Per agent journal (``agent/<name>-<replica>``, its folder under ``journal/``): the
    turns it held past the snapshot, which the continued and re-sent episodes resume
    through instead of playing again. None when no agent journals."""
    journal_replies: dict[str, NonNegativeInt] | None = None
    """Per agent journal: finished replies it held, to be adopted (not run again)."""
    journal_read_ms: dict[str, NonNegativeInt] | None = None
    """Per journal (model, resources and agent servers'): how long its server took to read
    it back when it started (``Journal.read_back_s``). None when no server journals."""


class TrainStep(_Event):
    kind: Literal["train_step"] = "train_step"
    step: NonNegativeInt
    rollouts: NonNegativeInt
    groups: NonNegativeInt


class ReplicaDown(_Event):
    """The runtime saw a replica's processes die."""

    kind: Literal["replica_down"] = "replica_down"
    replica: str
    held: NonNegativeInt
    """Its tries that wait to be restored from the latest snapshot when it is back."""


class ReplicaUp(_Event):
    """A lost replica is back (restarted, empty) and its held tries were restored."""

    kind: Literal["replica_up"] = "replica_up"
    replica: str
    restored: NonNegativeInt
    """Held tries re-sent to continue there."""


class Preemption(_Event):
    """The process was told to stop (SIGTERM from a scheduler, Ctrl-C)."""

    kind: Literal["preemption"] = "preemption"
    signal: str
    snapshot_id: str | None = None
    """The snapshot taken on the way out, None when there was none."""
    detail: str = ""


class InFlight(_Event):
    """A sample of the episodes in flight, taken every :data:`SAMPLE_EVERY_S`."""

    kind: Literal["in_flight"] = "in_flight"
    episodes: dict[str, NonNegativeInt]
    """Replica → episodes dispatched to it and not yet sealed (the ledger's count)."""
    policy_calls: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """Replica → policy calls its model server answered since it started (its counter),
    where its status answered in time."""


RunEvent = Annotated[
    RunStart | RunEnd | Restore | TrainStep | ReplicaDown | ReplicaUp | Preemption | InFlight,
    Field(discriminator="kind"),
]
_EVENT: TypeAdapter[RunEvent] = TypeAdapter(RunEvent)

SAMPLE_EVERY_S = 0.5
"""How often the trainer samples the episodes in flight (one short line per sample)."""


_SECRET_KEYS = frozenset({"api_key"})


def without_secrets(doc: dict[str, JsonValue]) -> dict[str, JsonValue]:
    """``doc`` with the value of every secret key (a policy's API key) replaced: the events
    file is for people to read and share."""
    return {k: _redacted(k, v) for k, v in doc.items()}


def _redacted(key: str, value: JsonValue) -> JsonValue:
    if key in _SECRET_KEYS and value is not None:
        return "<redacted>"
    if isinstance(value, dict):
        return without_secrets(value)
    if isinstance(value, list):
        return [_redacted("", v) for v in value]
    return value


class RunEvents:
    """Appends events to one file; a writer without a path records nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._broken = False

    def append(self, event: _Event) -> None:
        if self.path is None or self._broken:
            return
        line = orjson.dumps(event.model_dump(mode="json")) + b"\n"
        try:
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
        except OSError as exc:
            # The log is for people looking at the run afterwards: never stop the run for it.
            self._broken = True
            log.warning("not recording run events any more: %s: %s", self.path, exc)

    def preemption(self, signal: str, *, snapshot_id: str | None = None, detail: str = "") -> None:
        """Record that the run was told to stop (what the SIGTERM path calls)."""
        self.append(
            Preemption(ts=time.time(), signal=signal, snapshot_id=snapshot_id, detail=detail)
        )


@dataclass
class EventLog:
    """What :func:`read_events` found in a file."""

    events: list[RunEvent] = field(default_factory=list)
    skipped: int = 0
    """Lines that were torn, not JSON, or not this version's format."""
    newer: int = 0
    """Lines of a newer format version than this rollpoint reads."""


def read_events(path: Path) -> EventLog:
    """Every event of ``path`` in file order (none when the file is missing)."""
    found = EventLog()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return found
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError:
            found.skipped += 1
            continue
        if isinstance(doc, dict) and isinstance(doc.get("v"), int) and doc["v"] > EVENTS_VERSION:
            found.newer += 1
            continue
        try:
            found.events.append(_EVENT.validate_python(doc))
        except ValidationError:
            found.skipped += 1
    return found
