"""Memory against rows trained over a long job: what each process grows by per 10k rows.

The workplace job (real server processes, 2 replicas, the real trainer and its simulated
train step, the scripted policy at 20 ms) with a snapshot every 2 s, run for a fixed wall
time (default 21 minutes; ``--quick`` 3; ``ROLLPOINT_SOAK_SECONDS`` overrides both). Its
dataset is larger than the job can train in that time, so rows go on being trained until the
end. Every ``SAMPLE_EVERY_S`` the item reads the resident set (``VmRSS`` in
``/proc/<pid>/status``) of the trainer (this process) and of every server process (the
policy, and each replica's resources, model and agent servers) beside the rows trained so
far (``episodes_trained``: lines in ``train_data.jsonl``).

After warm-up (the first ``WARMUP_SHARE`` of the run, at least ``WARMUP_MIN_S``: the
servers' pools, the first snapshots' buffers, the allocator's arenas fill then) each
process's growth is the least-squares slope of its RSS over rows trained, given per 10k rows
(MiB) and per row (KiB). The goal is ≈ 0: memory bounded by what is in flight and held for
training, not by rows trained (issue 33, item 7). The samples are saved beside
``latest.json`` as ``soak_timeline.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench.report import RESULTS, BenchResult
from rollpoint.app.config import parse_config
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.control import StatusReply
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer

FULL_S = 21 * 60.0
QUICK_S = 3 * 60.0
SAMPLE_EVERY_S = 5.0
STATUS_TIMEOUT_S = 5.0
WARMUP_SHARE = 0.2
WARMUP_MIN_S = 60.0
SNAPSHOT_EVERY_S = 2.0
GROUP_SIZE = 4
ROWS_PER_S_CEILING = 160
"""The dataset holds this many rows a second of the run: more than it trains here (60 until
2026-12-06, when the machine to itself trained 130 to 140 rows a second and the 21-minute
run ran out of rows after ten)."""
TRAINER = "trainer"
HELD_COUNTS = ("recorded_calls", "episodes", "live", "finished_unacked")
"""The status counts of what a server keeps per rollout (model: call records; resources:
episodes; agent: sessions and finished replies not acked), plus its retire marks: counted,
unlike RSS, they show a structure that grows with rows trained whatever the allocator does."""


def duration(quick: bool) -> float:
    """The run's wall time: ``ROLLPOINT_SOAK_SECONDS`` when set, else 21 min (quick: 3)."""
    env = os.environ.get("ROLLPOINT_SOAK_SECONDS")
    if env:
        return float(env)
    return QUICK_S if quick else FULL_S


def rss_mib(pid: int) -> float | None:
    """The resident set of ``pid`` in MiB (None: the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


@dataclass
class Sample:
    t: float
    rows: int
    snapshots: int
    held: int
    """Finished rollouts the trainer holds: waiting for training, or trained and not durable."""
    in_flight: int
    archived: int
    """Final tries the trainer's ledger keeps (one a row sealed: the ledger's own growth)."""
    rss: dict[str, float]
    entries: dict[str, int] = field(default_factory=dict)
    """Per server: the per-rollout entries its status counts (see :data:`HELD_COUNTS`)."""


@dataclass
class Timeline:
    samples: list[Sample] = field(default_factory=list)
    summary: RunSummary | None = None


class SoakDone(Exception):
    """Raised out of the job's drive when the run's wall time is up (nothing failed)."""


def _processes(runtime: Runtime) -> dict[str, int]:
    pids = {TRAINER: os.getpid()}
    if isinstance(runtime, EmbeddedRuntime):
        for child in runtime.group.children:
            if child.alive:
                pids[child.spec.name] = child.process.pid
    return pids


async def _entries(trainer: Trainer) -> dict[str, int]:
    if trainer.coordinator is None:
        return {}
    clients = trainer.coordinator.participants
    replies = await asyncio.gather(
        *(asyncio.wait_for(c.status(), STATUS_TIMEOUT_S) for c in clients),
        return_exceptions=True,
    )
    out = {}
    for client, reply in zip(clients, replies, strict=True):
        if isinstance(reply, StatusReply):
            held = sum(reply.counts.get(key, 0) for key in HELD_COUNTS)
            out[client.label.replace("@", "-")] = held + reply.retired_rollouts
    return out


async def _sample(trainer: Trainer, runtime: Runtime, t0: float) -> Sample:
    rss = {}
    for name, pid in _processes(runtime).items():
        value = rss_mib(pid)
        if value is not None:
            rss[name] = value
    queue = trainer.finished_queue
    return Sample(
        t=time.monotonic() - t0,
        rows=trainer.run_counts().episodes_trained,
        snapshots=0 if trainer.coordinator is None else trainer.coordinator.published_total,
        held=queue.ready_rollouts + queue.counts()["consumed_rollouts"],
        in_flight=trainer.ledger.in_flight_count(),
        archived=trainer.ledger.archived_count,
        rss=rss,
        entries=await _entries(trainer),
    )


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def growth(samples: list[Sample], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per process: RSS at the end of warm-up, at the end, the peak, and the slope over rows."""
    after = [s for s in samples if s.t >= warmup_s]
    out: dict[str, dict[str, float]] = {}
    names = sorted({name for s in samples for name in s.rss}, key=lambda n: (n != TRAINER, n))
    for name in names:
        points = [(float(s.rows), s.rss[name]) for s in after if name in s.rss]
        if not points:
            continue
        per_row = slope([p[0] for p in points], [p[1] for p in points])
        counted = [(float(s.rows), float(s.entries[name])) for s in after if name in s.entries]
        entries: dict[str, float] = {}
        if counted:
            entries = {
                "entries_max": max(c[1] for c in counted),
                "entries_per_10k_rows": slope([c[0] for c in counted], [c[1] for c in counted])
                * 10_000,
            }
        out[name] = {
            "rss_warm_mib": points[0][1],
            "rss_end_mib": points[-1][1],
            "rss_peak_mib": max(s.rss.get(name, 0.0) for s in samples),
            "mib_per_10k_rows": per_row * 10_000,
            "kib_per_row": per_row * 1024,
            **entries,
        }
    return out


async def run(duration_s: float = FULL_S, sample_every_s: float = SAMPLE_EVERY_S) -> BenchResult:
    timeline = Timeline()
    groups = max(64, int(duration_s * ROWS_PER_S_CEILING / GROUP_SIZE))
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(
            {
                "workdir": str(Path(tmp) / "run"),
                "environment": "workplace",
                "tasks": groups,
                "group_size": GROUP_SIZE,
                "max_turns": 8,
                "replicas": 2,
                "concurrency": 32,
                "policy": {"latency_ms": 20, "error_rate": 0.0},
                "train": {"batch_size": 16},
                "snapshot": {"every_seconds": SNAPSHOT_EVERY_S},
            }
        )
        config.workdir.mkdir(parents=True, exist_ok=True)

        async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
            job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
            t0 = time.monotonic()
            try:
                while not job.done() and time.monotonic() - t0 < duration_s:
                    timeline.samples.append(await _sample(trainer, runtime, t0))
                    await asyncio.wait({job}, timeout=sample_every_s)
                timeline.samples.append(await _sample(trainer, runtime, t0))
                if job.done():
                    return job.result()  # the dataset ran out (or the run failed: raise)
            finally:
                if not job.done():
                    job.cancel()
                    await asyncio.gather(job, return_exceptions=True)
            stats = trainer.stats
            timeline.summary = RunSummary(
                episodes=stats.episodes_finished,
                turns=stats.turns,
                train_steps=stats.train_steps,
                failed_groups={},
                mean_reward=stats.reward_mean,
                elapsed_s=time.monotonic() - t0,
            )
            raise SoakDone

        with contextlib.suppress(SoakDone):
            timeline.summary = await run_job(
                config.job_settings(),
                fresh=True,
                hooks=SimulatedTrainer(config.train.step_seconds),
                say=lambda _: None,
                drive=drive,
            )
    samples = timeline.samples
    wall = samples[-1].t if samples else 0.0
    warmup_s = max(WARMUP_MIN_S, wall * WARMUP_SHARE)
    per_process = growth(samples, warmup_s)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak_timeline.json").write_bytes(
        orjson.dumps(
            {"warmup_s": warmup_s, "samples": [s.__dict__ for s in samples]},
            option=orjson.OPT_INDENT_2,
        )
    )
    warm_rows = next((s.rows for s in samples if s.t >= warmup_s), 0)
    rows = samples[-1].rows if samples else 0
    figures: dict[str, float | int | str] = {
        "seconds": wall,
        "rows_trained": rows,
        "rows_after_warmup": rows - warm_rows,
        "rows_per_s": rows / wall if wall else 0.0,
        "snapshots_published": samples[-1].snapshots if samples else 0,
        "samples": len(samples),
        "held_for_training_max": max((s.held for s in samples), default=0),
        "held_for_training_end": samples[-1].held if samples else 0,
        "ledger_final_tries_end": samples[-1].archived if samples else 0,
    }
    for name, g in per_process.items():
        for key, value in g.items():
            figures[f"{name}_{key}"] = value
    servers = [g["mib_per_10k_rows"] for n, g in per_process.items() if n != TRAINER]
    if servers:
        figures["servers_max_mib_per_10k_rows"] = max(servers)
    return BenchResult(
        key="soak",
        title="RSS growth per 10k rows trained after warm-up, trainer and every server (goal ≈ 0)",
        figures=figures,
        params={
            "duration_s": duration_s,
            "sample_every_s": sample_every_s,
            "warmup_s": round(warmup_s, 1),
            "snapshot_every_s": SNAPSHOT_EVERY_S,
            "dataset_groups": groups,
            "group_size": GROUP_SIZE,
            "replicas": 2,
            "concurrency": 32,
            "policy_latency_ms": 20,
            "load_avg_at_end": "/".join(f"{x:.1f}" for x in os.getloadavg()),
        },
    )
