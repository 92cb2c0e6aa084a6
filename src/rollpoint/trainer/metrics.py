"""The trainer's metrics: Prometheus text on ``/metrics`` and one JSON line per event.

Owns the metric objects (one registry per trainer, so two trainers in one process — as in
tests — never share counters), the HTTP endpoint, ``<workdir>/metrics.jsonl`` and the
:class:`~rollpoint.trainer.run_events.RunEvents` writer of ``<workdir>/run_events.jsonl``. It does
not decide when anything is measured: the coordinator and trainer loop call the
``record_*`` methods.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rollpoint.trainer.run_events import RunEvents

# Pauses are expected in the milliseconds-to-seconds range; buckets cover 1 ms .. 60 s.
_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TrainerMetrics:
    def __init__(self, jsonl_path: Path | None = None, events_path: Path | None = None) -> None:
        self.run_events = RunEvents(events_path)
        """The run's event log (``run_events.jsonl``): restores, replicas, train steps, samples."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.snapshot_pause = Histogram(
            "snapshot_pause_seconds",
            "Dispatch barrier closed to reopened, per snapshot attempt",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.prepare_seconds = Histogram(
            "snapshot_prepare_seconds",
            "Staged prepare of every participant",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.commit_seconds = Histogram(
            "snapshot_commit_seconds",
            "Commit of every participant",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.write_seconds = Histogram(
            "snapshot_write_seconds",
            "After the pause: participants' detached writes confirmed and the trainer's files written",
            registry=r,
            buckets=_PAUSE_BUCKETS,
        )
        self.snapshots = Counter("snapshots_total", "Snapshots by outcome", ["outcome"], registry=r)
        self.parked_sessions = Gauge(
            "snapshot_parked_sessions", "Sessions saved by the last snapshot", registry=r
        )
        self.restarts = Counter(
            "snapshot_restarts_total", "In-flight episodes a snapshot could not capture", registry=r
        )
        self.episodes = Counter("episodes_finished_total", "Rollouts sealed", registry=r)
        self.train_steps = Counter("train_steps_total", "Train steps taken", registry=r)
        self.last_pause_s: float | None = None
        self._jsonl_path = jsonl_path
        self._lock = threading.Lock()
        self._server: Any = None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` in a background thread; return the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
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
