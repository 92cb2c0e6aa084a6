"""The trainer's metrics: Prometheus text on ``/metrics`` and one JSON line per event.

Owns the metric objects (one registry per trainer, so two trainers in one process — as in
tests — never share counters), the HTTP endpoint, ``<workdir>/metrics.jsonl`` and the
:class:`~rollpoint.trainer.run_events.RunEvents` writer of ``<workdir>/run_events.jsonl``. It does
not decide when anything is measured: the coordinator and trainer loop call the
``record_*`` methods, and the trainer loop hands :meth:`TrainerMetrics.watch` a function
that returns its counts (:class:`RunCounts`), read at each scrape, so the data plane pays
nothing per row. Every name starts with ``rollpoint_``; docs/guide.md lists them.

prometheus-client comes with the ``metrics`` extra: importing this module needs none (the
trainer imports :class:`RunCounts` from here); a :class:`TrainerMetrics` does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rollpoint.common.extras import need
from rollpoint.protocol.errors import ConfigError
from rollpoint.trainer.run_events import RunEvents

if TYPE_CHECKING:
    from prometheus_client.core import Metric

# Pauses are expected in the milliseconds-to-seconds range; buckets cover 1 ms .. 60 s.
_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True, slots=True)
class RunCounts:
    """The trainer loop's counts at one moment (what a scrape reads)."""

    episodes_finished: int
    """Rollouts sealed, since the run began (a resumed run counts the snapshot's too)."""
    episodes_trained: int
    """Rollouts written to train_data.jsonl: its line count."""
    train_steps: int
    """The last train step taken: the highest ``train_step`` in train_data.jsonl."""
    in_flight: int
    """Rows dispatched and not finished (the ledger's in-flight set)."""
    waiting: int
    """Rows waiting for the barrier, a replica or a row slot."""
    failed_groups: int
    replicas_up: int
    resent: Mapping[str, int] = field(default_factory=dict)
    """Rows sent again, by why: ``given_up`` (fresh, under a new rollout id) or ``refused``."""
    adopted_replies: int = 0
    """Given-up tries whose stored reply was fetched and sealed instead of rerun."""
    failed_rows: Mapping[str, int] = field(default_factory=dict)
    """Row failures by error code (transport ones are re-sent; the others fail a group)."""
    damaged_records_files: int = 0
    """The trainer's shared records files found damaged before a snapshot referenced them
    again, and so written again from memory (:mod:`rollpoint.store.record_packs`)."""


class _RunCollector:
    """Reads :class:`RunCounts` at scrape time (a prometheus-client ``Collector``: that is a
    protocol, so this class needs no import of it)."""

    def __init__(self) -> None:
        self.source: Callable[[], RunCounts] | None = None

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if self.source is None:
            return
        c = self.source()
        for name, doc, value in (
            ("rollpoint_episodes_finished", "Rollouts sealed", c.episodes_finished),
            (
                "rollpoint_episodes_trained",
                "Rollouts written to train_data.jsonl",
                c.episodes_trained,
            ),
            ("rollpoint_train_steps", "Train steps taken", c.train_steps),
            ("rollpoint_groups_failed", "Prompt groups that failed", c.failed_groups),
            (
                "rollpoint_replies_adopted",
                "Given-up tries whose stored reply was sealed",
                c.adopted_replies,
            ),
            (
                "rollpoint_records_files_damaged",
                "Trainer records files found damaged and written again from memory",
                c.damaged_records_files,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        resent = CounterMetricFamily(
            "rollpoint_rows_resent", "Rows sent again, by reason", labels=["reason"]
        )
        for reason in ("given_up", "refused"):
            resent.add_metric([reason], c.resent.get(reason, 0))
        yield resent
        failed = CounterMetricFamily(
            "rollpoint_rows_failed", "Row failures by error code", labels=["code"]
        )
        for code, n in sorted(c.failed_rows.items()):
            failed.add_metric([code], n)
        yield failed
        for name, doc, value in (
            ("rollpoint_episodes_in_flight", "Rows dispatched and not finished", c.in_flight),
            ("rollpoint_episodes_waiting", "Rows waiting to be sent", c.waiting),
            ("rollpoint_replicas_up", "Replicas the trainer sends to", c.replicas_up),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class TrainerMetrics:
    def __init__(self, jsonl_path: Path | None = None, events_path: Path | None = None) -> None:
        need("metrics", "the trainer's metrics (a job's /metrics and snapshot timings)")
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.run_events = RunEvents(events_path)
        """The run's event log (``run_events.jsonl``): restores, replicas, train steps, samples."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._run = _RunCollector()
        r.register(self._run)
        self.snapshot_pause = Histogram(
            "rollpoint_snapshot_pause_seconds",
            "Dispatch barrier closed to reopened, per snapshot attempt",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.prepare_seconds = Histogram(
            "rollpoint_snapshot_prepare_seconds",
            "Staged prepare of every participant",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.commit_seconds = Histogram(
            "rollpoint_snapshot_commit_seconds",
            "Commit of every participant",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.write_seconds = Histogram(
            "rollpoint_snapshot_write_seconds",
            "After the pause: participants' detached writes confirmed and the trainer's files written",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.snapshots = Counter(
            "rollpoint_snapshots", "Snapshots by outcome", ["outcome"], registry=r
        )
        for outcome in ("published", "failed"):
            self.snapshots.labels(outcome=outcome)  # both series exist from the start
        self.parked_sessions = Gauge(
            "rollpoint_episodes_parked",
            "Episodes parked at a turn boundary and saved by the last published snapshot",
            registry=r,
        )
        self.restarts = Counter(
            "rollpoint_snapshot_restarts",
            "In-flight episodes a snapshot could not capture (they start over after a restore)",
            registry=r,
        )
        self.restores = Counter(
            "rollpoint_restores",
            "Restores: 'start' (a run resumed from a snapshot) or 'replica' (a lost replica's"
            " tries put back on it)",
            ["kind"],
            registry=r,
        )
        self.restored_episodes = Counter(
            "rollpoint_restored_episodes",
            "What restores did with the episodes of their snapshot, by outcome",
            ["outcome"],
            registry=r,
        )
        for kind in ("start", "replica"):
            self.restores.labels(kind=kind)
        for outcome in ("continued", "restarted", "adopted", "requeued"):
            self.restored_episodes.labels(outcome=outcome)
        self.last_pause_s: float | None = None
        self._jsonl_path = jsonl_path
        self._lock = threading.Lock()
        self._server: Any = None

    def watch(self, source: Callable[[], RunCounts]) -> None:
        """Read the run's counts from ``source`` at every scrape (the trainer loop's)."""
        self._run.source = source

    def record_restore(
        self,
        kind: str,
        *,
        continued: int,
        restarted: int = 0,
        adopted: int = 0,
        requeued: int = 0,
    ) -> None:
        self.restores.labels(kind=kind).inc()
        for outcome, n in (
            ("continued", continued),
            ("restarted", restarted),
            ("adopted", adopted),
            ("requeued", requeued),
        ):
            self.restored_episodes.labels(outcome=outcome).inc(n)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` in a background thread; return the bound port.

        A port that cannot be bound is a :class:`ConfigError` naming ``metrics.port``."""
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"metrics: cannot listen on {host}:{port} (metrics.host, metrics.port):"
                f" {exc.strerror or exc}"
            ) from None
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event to metrics.jsonl (no-op without a path)."""
        if self._jsonl_path is None:
            return
        line = orjson.dumps({"ts": time.time(), "event": kind, **fields}) + b"\n"
        with self._lock, self._jsonl_path.open("ab") as out:
            out.write(line)

    def record_snapshot(
        self,
        *,
        outcome: str,
        pause_s: float,
        prepare_s: float,
        commit_s: float,
        parked: int,
        write_s: float = 0.0,
        restarts: int,
        snapshot_id: str,
        detail: str = "",
    ) -> None:
        self.snapshot_pause.observe(pause_s)
        self.prepare_seconds.observe(prepare_s)
        if outcome == "published":
            self.commit_seconds.observe(commit_s)
            self.write_seconds.observe(write_s)
            self.parked_sessions.set(parked)
        self.snapshots.labels(outcome=outcome).inc()
        self.restarts.inc(restarts)
        self.last_pause_s = pause_s
        self.event(
            "snapshot",
            snapshot_id=snapshot_id,
            outcome=outcome,
            pause_seconds=pause_s,
            prepare_seconds=prepare_s,
            commit_seconds=commit_s,
            write_seconds=write_s,
            parked_sessions=parked,
            restarts=restarts,
            detail=detail,
        )
