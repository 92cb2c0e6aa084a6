"""What a run left behind, read for the report: one :class:`RunRecord` per workdir.

Owns reading ``metrics.jsonl`` (one line per snapshot attempt), ``run_events.jsonl`` (the
versioned event log of :mod:`rollpoint.trainer.run_events`) and the snapshot store (what
``rollpoint inspect`` shows), and the few numbers derived from them: the run's segments
(a first run and each rerun), whether the last one ended or crashed, and per restore the
policy calls re-done. Read-only, like ``inspect``: a live run may be writing right now, and
a workdir from a crashed run, a resumed run, a chaos trial or a Ray run reads the same way.
Every file is optional: a run that never snapshotted (or an older rollpoint's workdir,
without ``run_events.jsonl``) reads as far as its files go. It draws nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.app.snapshot_report import build_report
from rollpoint.protocol.errors import ConfigError, RollpointError
from rollpoint.trainer.run_events import (
    EVENTS_FILE,
    InFlight,
    Preemption,
    ReplicaDown,
    ReplicaUp,
    Restore,
    RunEnd,
    RunEvent,
    RunStart,
    TrainStep,
    read_events,
)

METRICS_FILE = "metrics.jsonl"
CHAOS_EVENTS_FILE = "events.jsonl"
"""What ``rollpoint chaos`` keeps beside a trial's workdir (:mod:`rollpoint.app.chaos.command`):
its ``fault`` lines are drawn on the timeline."""


@dataclass(frozen=True)
class Fault:
    """A fault ``rollpoint chaos`` injected into the trial."""

    ts: float
    kind: str
    detail: str


@dataclass(frozen=True)
class SnapshotAttempt:
    """One line of ``metrics.jsonl``: a snapshot attempt, published or failed."""

    snapshot_id: str
    ts: float
    """When the attempt ended (its line was written)."""
    outcome: str
    pause_s: float
    prepare_s: float
    commit_s: float
    write_s: float
    parked: int
    restarts: int
    detail: str

    @property
    def published(self) -> bool:
        return self.outcome == "published"

    @property
    def in_flight(self) -> int:
        """Sessions in flight at the cut: saved plus those that had to start over."""
        return self.parked + self.restarts

    @property
    def cut_ts(self) -> float:
        """About when the pause ended (where the report draws it): the line is written after
        the detached writes."""
        return self.ts - self.write_s


@dataclass(frozen=True)
class RestoreOutcome:
    """A restore event with what the report derives for it."""

    event: Restore
    calls_redone: int | None
    """Policy calls answered between the snapshot's cut and the restore (lost with the
    crash, so asked again), summed from the in-flight samples; None when no sample shows
    the model servers' counters."""


@dataclass(frozen=True)
class Segment:
    """One process's run of the job: from its ``run_start`` to the next one."""

    start: RunStart
    end: RunEnd | None
    last_ts: float
    """Its last recorded event (the crash happened after it when ``end`` is None)."""


@dataclass
class RunRecord:
    workdir: Path
    store_root: str
    snapshots: list[SnapshotAttempt] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    restores: list[RestoreOutcome] = field(default_factory=list)
    train_steps: list[TrainStep] = field(default_factory=list)
    replica_events: list[ReplicaDown | ReplicaUp] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    samples: list[InFlight] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    inspect: dict[str, Any] = field(default_factory=dict)
    """What ``rollpoint inspect --json`` prints for the store."""
    inspect_error: str = ""
    config: dict[str, JsonValue] | None = None
    """The config of the latest segment (None without ``run_events.jsonl``)."""
    skipped_lines: int = 0
    newer_lines: int = 0

    @property
    def t0(self) -> float:
        """The time axis starts at the first thing recorded."""
        times = [s.ts for s in self.snapshots] + [s.start.ts for s in self.segments]
        times += [t.ts for t in self.train_steps] + [s.ts for s in self.samples]
        return min(times, default=0.0)

    @property
    def state(self) -> str:
        if not self.segments:
            return "unknown (no run_events.jsonl)"
        if self.segments[-1].end is not None:
            return "finished"
        stopped = self.stopped_by(len(self.segments) - 1)
        if stopped is not None:
            held = f"snapshot {stopped.snapshot_id}" if stopped.snapshot_id else "its last snapshot"
            return f"stopped by {stopped.signal} ({held} holds it; a rerun resumes)"
        return "crashed or still running"

    def stopped_by(self, index: int) -> Preemption | None:
        """The signal segment ``index`` stopped on (a preemption: not a crash), or None."""
        start = self.segments[index].start.ts
        until = (
            self.segments[index + 1].start.ts if index + 1 < len(self.segments) else float("inf")
        )
        found = [p for p in self.preemptions if start <= p.ts < until]
        return found[-1] if found else None

    @property
    def replicas(self) -> list[str]:
        names: set[str] = set()
        for segment in self.segments:
            names.update(segment.start.replicas)
        for sample in self.samples:
            names.update(sample.episodes)
        return sorted(names)


def read_run(workdir: Path, store: str | None = None) -> RunRecord:
    """Everything the report shows about ``workdir``; ``store`` overrides where the
    snapshots are (default: the config's ``snapshot.store``, else WORKDIR/snapshots)."""
    if not workdir.is_dir():
        raise ConfigError(f"workdir {workdir} does not exist")
    log = read_events(workdir / EVENTS_FILE)
    starts = [e for e in log.events if isinstance(e, RunStart)]
    config = starts[-1].config if starts else None
    root = store or _store_from(config) or str(workdir / "snapshots")
    record = RunRecord(
        workdir=workdir,
        store_root=root,
        snapshots=_read_snapshots(workdir / METRICS_FILE),
        faults=_read_faults(workdir / CHAOS_EVENTS_FILE),
        config=config,
        skipped_lines=log.skipped,
        newer_lines=log.newer,
    )
    try:
        record.inspect = build_report(root, workdir=workdir)
    except (RollpointError, OSError, orjson.JSONDecodeError) as exc:
        # A torn store still gets a page: the timeline does not need it.
        record.inspect = {"snapshots": [], "invalid": [], "latest": None}
        record.inspect_error = exc.message if isinstance(exc, RollpointError) else str(exc)
    record.snapshots += _published_without_a_line(record, log.events)
    record.snapshots.sort(key=lambda s: s.ts)
    for event in log.events:
        if isinstance(event, RunStart):
            record.segments.append(Segment(event, None, event.ts))
        elif record.segments:
            seg = record.segments[-1]
            end = event if isinstance(event, RunEnd) else seg.end
            record.segments[-1] = Segment(seg.start, end, max(seg.last_ts, event.ts))
        if isinstance(event, TrainStep):
            record.train_steps.append(event)
        elif isinstance(event, ReplicaDown | ReplicaUp):
            record.replica_events.append(event)
        elif isinstance(event, Preemption):
            record.preemptions.append(event)
        elif isinstance(event, InFlight):
            record.samples.append(event)
    for i, segment in enumerate(record.segments):
        # A killed run's last snapshot line may come after its last event.
        until = record.segments[i + 1].start.ts if i + 1 < len(record.segments) else float("inf")
        last = max(
            (s.ts for s in record.snapshots if segment.start.ts <= s.ts < until),
            default=segment.last_ts,
        )
        record.segments[i] = Segment(segment.start, segment.end, max(last, segment.last_ts))
    record.restores = [
        RestoreOutcome(e, _calls_redone(e, record)) for e in log.events if isinstance(e, Restore)
    ]
    return record


def _store_from(config: dict[str, JsonValue] | None) -> str | None:
    snapshot = config.get("snapshot") if config else None
    store = snapshot.get("store") if isinstance(snapshot, dict) else None
    return store if isinstance(store, str) else None


def _read_snapshots(path: Path) -> list[SnapshotAttempt]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    found = []
    for line in raw.splitlines():
        try:
            doc = orjson.loads(line)
            if doc.get("event") != "snapshot":
                continue
            found.append(
                SnapshotAttempt(
                    snapshot_id=str(doc["snapshot_id"]),
                    ts=float(doc["ts"]),
                    outcome=str(doc["outcome"]),
                    pause_s=float(doc["pause_seconds"]),
                    prepare_s=float(doc.get("prepare_seconds", 0.0)),
                    commit_s=float(doc.get("commit_seconds", 0.0)),
                    write_s=float(doc.get("write_seconds", 0.0)),
                    parked=int(doc.get("parked_sessions", 0)),
                    restarts=int(doc.get("restarts", 0)),
                    detail=str(doc.get("detail", "")),
                )
            )
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
            continue  # a torn last line of a killed run
    return found


NO_LINE = "published; its metrics line was never written (the run was killed first)"


def _published_without_a_line(record: RunRecord, events: list[RunEvent]) -> list[SnapshotAttempt]:
    """Snapshots ``metrics.jsonl`` does not list: a run killed right after a publish never
    wrote the line, and that snapshot is often the one its rerun restores. Taken from the
    restore that used it (where its pause ended) or else from the store (at its publish
    time, a little after)."""
    listed = {s.snapshot_id for s in record.snapshots}
    found = []
    for e in events:
        if (
            isinstance(e, Restore)
            and e.snapshot_id not in listed
            and e.snapshot_pause_ended_at is not None
        ):
            listed.add(e.snapshot_id)
            found.append(
                SnapshotAttempt(
                    snapshot_id=e.snapshot_id,
                    ts=e.snapshot_pause_ended_at,
                    outcome="published",
                    pause_s=e.snapshot_pause_s or 0.0,
                    prepare_s=0.0,
                    commit_s=0.0,
                    write_s=0.0,
                    parked=e.continued,
                    restarts=e.restarted,
                    detail=NO_LINE,
                )
            )
    return found + [
        SnapshotAttempt(
            snapshot_id=str(s["id"]),
            ts=float(s["published_at"]),
            outcome="published",
            pause_s=float(s["pause_seconds"]),
            prepare_s=0.0,
            commit_s=0.0,
            write_s=0.0,
            parked=int(s["episodes"]),
            restarts=int(s["restarts"]),
            detail=NO_LINE,
        )
        for s in record.inspect.get("snapshots", [])
        if s["id"] not in listed
    ]


def _read_faults(path: Path) -> list[Fault]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    found = []
    for line in raw.splitlines():
        try:
            doc = orjson.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "fault":
                found.append(Fault(float(doc["ts"]), str(doc["kind"]), str(doc.get("detail", ""))))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return found


def _calls_redone(restore: Restore, record: RunRecord) -> int | None:
    """Model-server calls answered after the snapshot's cut and before the restore: the
    crash lost them. Counters restart at 0 with their process, so a drop between two
    samples counts the new value. A lower bound: calls after the last sample are unseen."""
    cut = next((s.cut_ts for s in record.snapshots if s.snapshot_id == restore.snapshot_id), None)
    if cut is None:
        return None
    before = [s for s in record.samples if s.ts <= cut and s.policy_calls]
    after = [s for s in record.samples if cut < s.ts < restore.ts and s.policy_calls]
    if not after:
        return None
    last: dict[str, int] = dict(before[-1].policy_calls) if before else {}
    total = 0
    for sample in after:
        for replica, calls in sample.policy_calls.items():
            seen = last.get(replica, 0)
            total += calls - seen if calls >= seen else calls
            last[replica] = calls
    return total
