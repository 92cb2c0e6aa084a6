"""Snapshot pause against sessions in flight, and against finished rollouts in the ledger.

Everything is real: the servers run as processes (embedded runtime, 2 replicas, control
routes on), a :class:`~rollpoint.trainer.trainer.Trainer` with ``concurrency = N``
keeps N rows dispatched, and its own snapshot coordinator takes the snapshots over the
control protocol. The bench adds only timers and a metered transport:

- the participant clients and the snapshot store are thin subclasses that note when each
  control call and store write starts and ends, so a pause splits into its parts;
- the trainer's data-plane client opens the first N rows at the offered rate, so sessions
  start gradually (10k at once overflow the servers' accept queues and 5 s connect timeout).

The offered load is fixed: a policy call takes ``N / rate`` seconds, so N sessions make
``rate`` calls a second (400; 200 at 10k sessions), which two cores sustain; what changes
with N is the number of sessions held and saved. Sessions are light and long: workplace
tasks of many events (25 policy calls each), so few finish while the snapshots run.

The parts of a pause:

- ``drain``: the model stage of prepare (the gate closes). With the generation cut it
  waits for no policy call (a reply landing during the cut is held by its agent and the
  session saved as before that call), so it is one control round trip; before the cut it
  waited for every admitted call, up to one policy latency (``N / rate``);
- ``park``: the agent and resources stages of prepare (sessions reach a boundary);
- ``commit``: every participant captures its records (a detached write: encoding and
  writing wait for ``confirm``); the trainer captures its ledger and the finished queue;
- ``resume``: the reverse stages reopen;
- ``mechanism`` = pause - drain: what the cut costs beyond the model stage;
- ``write`` (after the barrier reopened, not in the pause): every participant writes what
  it captured and confirms it, while the trainer writes its ledger, the finished queue and counters;
- ``publish`` (not in the pause): the trainer's file writes (inside ``write``), the
  manifest, ``latest`` and retention.

While the sessions open, a snapshot is taken every 5 s and not measured, as a job
checkpointing every 5 s would: each session's first export (its whole record; later ones
reuse what did not change) then falls in the snapshot after it started. The largest count
also runs *cold*, with no snapshot until every session is open, so its first measured cut
exports every session for the first time (``<n>_cold_first_pause_ms``).

Snapshots the trainer takes at its own train checkpoints count too, once the sessions are
open. Failed snapshots and rows re-sent fresh (a try lost on the data plane) are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import os
import secrets
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from bench.latency import percentile
from bench.report import BenchResult
from rollpoint.app.config import RunConfig, parse_config
from rollpoint.envs.workplace import ExpectedEmail, ExpectedEvent, WorkplaceParams, workplace_prompt
from rollpoint.http.client import HttpClient
from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.control import (
    CommitReply,
    ConfirmReply,
    PrepareReply,
    ResumeReply,
    StatusReply,
)
from rollpoint.protocol.deployment import Deployment
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import SnapshotError
from rollpoint.protocol.manifest import FileEntry, SnapshotManifest
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.store.participant_state import MANIFEST_NAME
from rollpoint.store.snapshot_store import PARTICIPANTS_DIR, SnapshotStore, Staging
from rollpoint.trainer.control.control_plane import ControlPlane, participant_clients
from rollpoint.trainer.control.participant_client import ParticipantAddress, ParticipantClient
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.snapshot.coordinator import SaveReport
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.trainer import Trainer
from rollpoint.tuning import install as install_tuning

T = TypeVar("T")

GROUP_SIZE = 4
"""Rows per prompt group, one ``/run`` stream each (16 at 100k, see :func:`load`)."""
EVENTS_PER_TASK = 10
EMAILS_PER_TASK = 4
TURNS_PER_EPISODE = 2 * EVENTS_PER_TASK + EMAILS_PER_TASK + 1
REPLICAS = 2
"""Two, so 10k sessions fit the open-file limit (one socket per call on each hop)."""
CALLS_PER_S = 400
"""Offered load below 10k (see :func:`load`): each policy call takes N / rate seconds and
sessions open at rate a second, so their calls are spread evenly over that time."""
CALLS_PER_S_AT_10K = 200
"""With 10k sockets on every hop, 400 calls/s overflow the engine's accept queue on 2 cores."""
STATUS_TIMEOUT_S = 5.0
GAP_S = 0.5
"""Between snapshots: the calls held at the gate go through and sessions run again."""
RAMP_SNAPSHOT_S = 5.0
LARGE = 50_000
"""From this many sessions on, :func:`load` caps connections and batches streams."""
UPSTREAM_CONNECTIONS = 2_000
"""Per agent and upstream, at :data:`LARGE` sessions and up."""
"""Snapshots while the sessions open (not measured), as a job checkpointing every 5 s takes
them: a session's first export (its full record) then lands in the snapshot after it
started, not all 10k in the first measured one. ``measure(..., warm=False)`` takes none,
for the cold figure: the first snapshot after every session opened unsaved. (Since the
servers keep their state images from the coordinator's first ``status``, a cold cut finds
most records made by the images' sweep; before, it built every one in its pause.)"""
KINDS = ("model", "agent", "resources")
PARTS = ("pause", "drain", "mechanism", "park", "commit", "resume", "write", "publish")


# --- timers and the metered transport ------------------------------------------------


@dataclass
class StageClock:
    """When each control call and store write of each checkpoint started and ended."""

    spans: dict[str, list[tuple[str, float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def note(self, checkpoint_id: str, part: str, started: float) -> None:
        self.spans[checkpoint_id].append((part, started, time.monotonic()))

    def span(self, checkpoint_id: str, *parts: str) -> float:
        """From the first start to the last end of these parts (0 when none ran)."""
        hits = [(s, e) for p, s, e in self.spans.get(checkpoint_id, []) if p in parts]
        if not hits:
            return 0.0
        return max(e for _, e in hits) - min(s for s, _ in hits)


class TimedParticipant(ParticipantClient):
    """The real control client, noting how long prepare, commit and resume take."""

    def __init__(self, address: ParticipantAddress, http: HttpClient, clock: StageClock) -> None:
        super().__init__(address, http)
        self._clock = clock

    async def _timed(self, part: str, checkpoint_id: str, call: Awaitable[T]) -> T:
        t0 = time.monotonic()
        try:
            return await call
        finally:
            self._clock.note(checkpoint_id, part, t0)

    async def prepare(self, checkpoint_id: str, *args: Any, **kw: Any) -> PrepareReply:
        call = super().prepare(checkpoint_id, *args, **kw)
        return await self._timed(f"prepare:{self.address.kind}", checkpoint_id, call)

    async def commit(self, checkpoint_id: str, *args: Any, **kw: Any) -> CommitReply:
        call = super().commit(checkpoint_id, *args, **kw)
        return await self._timed(f"commit:{self.address.kind}", checkpoint_id, call)

    async def confirm(self, checkpoint_id: str, *args: Any, **kw: Any) -> ConfirmReply:
        call = super().confirm(checkpoint_id, *args, **kw)
        return await self._timed(f"confirm:{self.address.kind}", checkpoint_id, call)

    async def resume(self, checkpoint_id: str) -> ResumeReply:
        return await self._timed("resume", checkpoint_id, super().resume(checkpoint_id))


class TimedStore(SnapshotStore):
    """The real snapshot store, noting how long the trainer's writes and the publish take."""

    def __init__(self, root: str, keep: int, clock: StageClock) -> None:
        super().__init__(root, keep)
        self._clock = clock
        self.sizes: dict[str, dict[str, int]] = {}
        """Bytes of each snapshot when it was published: by participant kind, and trainer."""

    def write_file(self, staging: Staging, name: str, data: bytes | Iterable[bytes]) -> FileEntry:
        t0 = time.monotonic()
        try:
            return super().write_file(staging, name, data)
        finally:
            self._clock.note(staging.snapshot_id, "publish", t0)

    def publish(self, staging: Staging, manifest: SnapshotManifest) -> SnapshotManifest:
        # Sized before the publish (untimed): retention may prune it before we look again.
        self.sizes[staging.snapshot_id] = _bytes_by_part(staging.path)
        t0 = time.monotonic()
        try:
            return super().publish(staging, manifest)
        finally:
            self._clock.note(staging.snapshot_id, "publish", t0)


class MeteredClient(HttpClient):
    """The trainer's data-plane client; the first ``rows`` rows start at ``rows_per_s`` a second.

    Only the opening ramp is metered: re-sends after it go out at once, as they would.
    """

    def __init__(self, rows_per_s: float, rows: int) -> None:
        super().__init__()
        self._seconds_per_row = 1.0 / rows_per_s
        self._metered_left = rows
        self._next_start = 0.0

    async def stream_ndjson(self, url: str, body: Any, **kw: Any) -> AsyncIterator[Any]:
        if self._metered_left > 0:
            rows = len(body.get("rows", ())) if isinstance(body, dict) else 1
            self._metered_left -= rows
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + rows * self._seconds_per_row
            await asyncio.sleep(start - now)
        async for line in super().stream_ndjson(url, body, **kw):
            yield line


def _bytes_by_part(path: str) -> dict[str, int]:
    """Bytes a snapshot holds under ``participants/<kind>/`` by kind (each participant's
    manifest and the records it names, wherever they sit: records files are shared by
    snapshots); everything else counts as ``trainer``."""
    sizes: dict[str, int] = defaultdict(int)
    for folder, _, files in os.walk(path):
        parts = Path(folder).relative_to(path).parts
        if len(parts) > 1 and parts[0] == PARTICIPANTS_DIR:
            if MANIFEST_NAME in files:
                manifest = Path(folder) / MANIFEST_NAME
                held = orjson.loads(manifest.read_bytes())["bytes"]
                sizes[parts[1]] += manifest.stat().st_size + held
            continue
        sizes["trainer"] += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return dict(sizes)


# --- one measured cut ----------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """One published snapshot: its parts in seconds, what it held, and its size."""

    snapshot_id: str
    seconds: dict[str, float]
    """Every name of :data:`PARTS`, and ``commit_<kind>`` (the slowest of that kind)."""
    in_flight: int
    saved: int
    """Sessions exported at a boundary (in flight minus restarts and held replies)."""
    restarts: int
    turns: float
    """Mean turns completed by the saved sessions."""
    sizes: dict[str, int]
    """Bytes by participant kind, and ``trainer`` for the ledger, the finished queue and manifest."""


def _cut(report: SaveReport, clock: StageClock, sizes: dict[str, int]) -> Cut:
    sid = report.snapshot_id
    assert report.manifest is not None
    turns = [e.turns_completed for e in report.manifest.episodes]
    drain = clock.span(sid, "prepare:model")
    seconds = {
        "pause": report.pause_s,
        "drain": drain,
        "mechanism": report.pause_s - drain,
        "park": clock.span(sid, "prepare:agent", "prepare:resources"),
        "commit": report.commit_s,
        "resume": clock.span(sid, "resume"),
        "write": report.write_s,
        "publish": clock.span(sid, "publish"),
    }
    seconds |= {f"commit_{kind}": clock.span(sid, f"commit:{kind}") for kind in KINDS}
    return Cut(
        snapshot_id=sid,
        seconds=seconds,
        in_flight=report.saved + report.restarts + report.finished,
        saved=report.saved,
        restarts=report.restarts,
        turns=sum(turns) / len(turns) if turns else 0.0,
        sizes=sizes,
    )


# --- tasks and the pre-filled ledger -------------------------------------------------


def long_task(index: int, prefix: str = "long") -> TaskRow:
    """A workplace task of many events and emails: a long, light episode."""
    day = index % 365
    events = [
        ExpectedEvent(
            title=f"Block {k:02d} review",
            date=f"2025-{1 + (day + k) % 12:02d}-{1 + (day + 3 * k) % 28:02d}",
            start_time=f"{8 + k % 9:02d}:{30 * (k % 2):02d}",
            duration_minutes=30 + 15 * (k % 4),
        )
        for k in range(EVENTS_PER_TASK)
    ]
    emails = [
        ExpectedEmail(to=f"person{k}@example.com", subject=f"Block {k:02d} review scheduled")
        for k in range(EMAILS_PER_TASK)
    ]
    params = WorkplaceParams(events=events, emails=emails)
    return TaskRow(
        task_id=f"{prefix}-{index:07d}",
        environment="workplace",
        prompt=workplace_prompt(params),
        params=params.model_dump(mode="json"),
    )


def prefill_finished(ledger: RecoveryLedger, rollouts: int, replicas: Sequence[str]) -> None:
    """Add ``rollouts`` sealed rollouts through the ledger's own moves (dispatch, finish, seal).

    the finished queue needs nothing: a rollout consumed by a committed train step has left the finished queue for good
    (``ledger_scaling`` runs them through the finished queue to show it).
    """
    template = long_task(0)
    for g in range(math.ceil(rollouts / GROUP_SIZE)):
        task = template.model_copy(update={"task_id": f"done-{g:07d}"})
        for record in ledger.add_group(task, f"{task.task_id}-g0", GROUP_SIZE):
            ledger.dispatch(record.rollout_id, replicas[g % len(replicas)])
            ledger.finish(record.rollout_id)
            ledger.seal(record.rollout_id)


# --- one phase: N sessions in flight, k snapshots ------------------------------------


@dataclass
class Phase:
    sessions: int
    finished: int
    cuts: list[Cut]
    ramp_s: float
    failed: list[str]
    """Why each failed snapshot failed."""
    resent: int
    """Rows re-sent fresh (their try was lost) after the ramp."""


@dataclass(frozen=True)
class Load:
    """How ``sessions`` sessions are offered: the same real servers and protocol at every
    size; what changes is how many sockets they hold at once."""

    group_size: int
    calls_per_s: float
    """Policy calls a second across the run."""
    rows_per_s: float
    """Rows opened a second while the sessions open."""
    upstream_connections: int | None
    """Each agent's cap towards its model and resources servers (``upstream_connections``)."""
    policy_latency_s: float
    """The scripted engine's time per call: every session has one call outstanding, so
    N / rate uncapped; capped, calls wait in the agents and the engine holds the cap's."""
    ramp_snapshot_s: float


def load(sessions: int) -> Load:
    """Below 10k: 400 calls/s. At 10k: 200 (10k sockets on every hop overflow the engine's
    accept queue at 400). From :data:`LARGE`: every in-flight call held a socket on every
    hop, past the 20,000 open files a process may have, so agents cap their connections
    (calls queue in the agent, as they would in an engine's scheduler), rows go 16 to a
    ``/run`` stream (a GRPO group of 16) and open at 250 a second, and a warm ramp would
    snapshot every 60 s (each writes ~0.9 GB at 100k; 5 s apart they would queue).
    Measured at 100k: 400 rows/s with a snapshot every 30 s overloaded the agents (connect
    timeouts on ``/run``, then single-row re-sends past the open-file limit)."""
    if sessions < 10_000:
        return Load(GROUP_SIZE, CALLS_PER_S, CALLS_PER_S, None, sessions / CALLS_PER_S, 5.0)
    if sessions < LARGE:
        rate = CALLS_PER_S_AT_10K
        return Load(GROUP_SIZE, rate, rate, None, sessions / rate, RAMP_SNAPSHOT_S)
    rate, capped = CALLS_PER_S_AT_10K, REPLICAS * UPSTREAM_CONNECTIONS
    return Load(16, rate, 1.25 * rate, UPSTREAM_CONNECTIONS, capped / rate, 60.0)


def _config(
    workdir: Path,
    sessions: int,
    policy: dict[str, Any] | None = None,
    *,
    journal: bool = False,
    snapshot_mode: str = "cut",
) -> RunConfig:
    """``journal``: the servers journal (``journal.enabled``); ``snapshot_mode: journal``
    (needs it) takes pause-free snapshots."""
    offered = load(sessions)
    return parse_config(
        {
            "workdir": str(workdir),
            "environment": "workplace",
            "tasks": 1,
            "group_size": offered.group_size,
            "max_turns": 2 * TURNS_PER_EPISODE,
            "replicas": REPLICAS,
            "concurrency": sessions,
            "row_timeout_seconds": 3600,
            "upstream_connections": offered.upstream_connections,
            "policy": {
                "latency_ms": offered.policy_latency_s * 1e3,
                "error_rate": 0,
                **(policy or {}),
            },
            "snapshot": {"deadline_seconds": 120, "keep": 2, "mode": snapshot_mode},
            "journal": {"enabled": journal},
        }
    )


async def _status(client: ParticipantClient) -> StatusReply:
    async with asyncio.timeout(STATUS_TIMEOUT_S):
        return await client.status()


async def _session_counts(participants: Sequence[ParticipantClient]) -> dict[str, int]:
    """Sessions by state over every agent; an agent that does not answer counts nothing."""
    agents = [p for p in participants if p.address.kind == ParticipantKind.AGENT]
    replies = await asyncio.gather(*(_status(p) for p in agents), return_exceptions=True)
    total: dict[str, int] = defaultdict(int)
    for reply in replies:
        if not isinstance(reply, BaseException):
            for key, value in reply.counts.items():
                total[key] += value
    return total


async def _ramp(
    trainer: Trainer, participants: Sequence[ParticipantClient], n: int, *, warm: bool
) -> float:
    """Wait until (nearly) every dispatched row runs as a session past its start, or for
    twice the time opening them all should take; ``warm``: snapshot every
    :data:`RAMP_SNAPSHOT_S` meanwhile."""
    coordinator = trainer.coordinator
    assert coordinator is not None
    offered = load(n)
    t0 = last_snapshot = time.monotonic()
    while time.monotonic() - t0 < 2 * n / offered.rows_per_s + 10:
        await asyncio.sleep(0.5)
        if warm and time.monotonic() - last_snapshot >= offered.ramp_snapshot_s:
            with contextlib.suppress(SnapshotError):
                await coordinator.save()
            last_snapshot = time.monotonic()
        counts = await _session_counts(participants)
        started = counts.get("live", 0) - counts.get("starting", 0)
        if trainer.ledger.in_flight_count() >= 0.95 * n and started >= 0.95 * n:
            break
    return time.monotonic() - t0


async def measure(
    sessions: int,
    *,
    snapshots: int,
    finished: int = 0,
    warm: bool = True,
    keep_logs: Path | None = None,
    policy: dict[str, Any] | None = None,
    snapshot_mode: str | None = None,
    store_class: Callable[[str, int, StageClock], TimedStore] | None = None,
    after: Callable[[TimedStore], Awaitable[None]] | None = None,
    settle_s: float = 0.0,
    gap_s: float = GAP_S,
) -> Phase:
    """One runtime, one trainer with ``sessions`` rows in flight, ``snapshots`` cuts or more.

    ``warm``: snapshots run while the sessions open (:data:`RAMP_SNAPSHOT_S`); without, the
    first cut is the cold one. ``keep_logs`` names a folder to keep the run (server logs)
    in, for a run that went wrong. ``policy``: config keys merged into the policy section
    (token capture); ``snapshot_mode``: the servers journal and snapshots take this mode
    (``cut`` or ``journal``: pause-free); ``store_class``: a :class:`TimedStore` that measures more;
    ``after``: called with the store once the cuts are taken, servers still up;
    ``settle_s``: after the ramp, run this long (a snapshot every :data:`RAMP_SNAPSHOT_S`,
    not measured) so sessions are some turns in; ``gap_s``: between measured snapshots.
    """
    # The trainer runs in this process: install the tricks as ``run_job`` does, so the pause
    # measured is the one a run has (the servers' processes install their own).
    install_tuning()
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(
            keep_logs or Path(tmp) / "run",
            sessions,
            policy,
            journal=snapshot_mode is not None,
            snapshot_mode=snapshot_mode or "cut",
        )
        config.workdir.mkdir(parents=True, exist_ok=True)
        group_size = load(sessions).group_size
        tasks = [long_task(i) for i in range(3 * math.ceil(sessions / group_size) + 200)]
        clock = StageClock()
        token = secrets.token_urlsafe(32)
        root = config.snapshot_root()
        store = await asyncio.to_thread(
            store_class or TimedStore, root, config.snapshot.keep, clock
        )
        async with EmbeddedRuntime(
            config.runtime_settings(), control_token=token, snapshot_root=root
        ) as runtime:
            assert runtime.deployment is not None
            control_http = HttpClient(token=token, timeout_s=300)
            data_http = MeteredClient(load(sessions).rows_per_s, sessions)
            try:
                participants: list[ParticipantClient] = [
                    TimedParticipant(p.address, control_http, clock)
                    for p in participant_clients(runtime.deployment, control_http)
                ]
                trainer = bench_trainer(
                    config, runtime.deployment, tasks, participants, store, data_http
                )
                replicas = [r.name for r in runtime.deployment.replicas]
                prefill_finished(trainer.ledger, finished, replicas)
                phase = await _drive(
                    trainer, participants, snapshots, store, clock, warm, settle_s, gap_s
                )
                if after is not None:
                    await after(store)
            finally:
                await data_http.aclose()
                await control_http.aclose()
    phase.finished = finished
    return phase


def bench_trainer(
    config: RunConfig,
    deployment: Deployment,
    tasks: list[TaskRow],
    participants: Sequence[ParticipantClient],
    store: SnapshotStore,
    data_http: HttpClient,
) -> Trainer:
    """The real trainer of the bench jobs: the simulated loop, its own snapshot coordinator
    over ``participants``, rows opened through ``data_http``."""
    return Trainer(
        config.trainer_settings(),
        deployment,
        tasks,
        hooks=SimulatedTrainer(config.train.step_seconds),
        control=ControlPlane(list(participants), store, TrainerMetrics()),
        client=data_http,
    )


async def _drive(
    trainer: Trainer,
    participants: Sequence[ParticipantClient],
    snapshots: int,
    store: TimedStore,
    clock: StageClock,
    warm: bool,
    settle_s: float = 0.0,
    gap_s: float = GAP_S,
) -> Phase:
    coordinator = trainer.coordinator
    assert coordinator is not None
    n = trainer.config.concurrency
    run = asyncio.create_task(trainer.run())
    phase = Phase(sessions=n, finished=0, cuts=[], ramp_s=0.0, failed=[], resent=0)
    try:
        phase.ramp_s = await _ramp(trainer, participants, n, warm=warm)
        settled_at = time.monotonic() + settle_s
        while time.monotonic() < settled_at and not run.done():
            await asyncio.sleep(min(RAMP_SNAPSHOT_S, max(settled_at - time.monotonic(), 0.0)))
            with contextlib.suppress(SnapshotError):
                await coordinator.save()
        assert trainer.dispatcher is not None
        resent_before = trainer.dispatcher.resent_fresh
        seen = coordinator.saves
        while len(phase.cuts) < snapshots:
            if run.done():
                run.result()
                raise RuntimeError("the trainer stopped before the snapshots were taken")
            if len(phase.failed) > snapshots:
                raise RuntimeError(f"too many failed snapshots: {phase.failed}")
            await asyncio.sleep(gap_s)
            with contextlib.suppress(SnapshotError):  # three failures in a row: noted below
                await coordinator.save()
            for report in coordinator.reports_since(seen):
                if report.published:
                    sizes = store.sizes.get(report.snapshot_id, {})
                    phase.cuts.append(_cut(report, clock, sizes))
                else:
                    phase.failed.append(report.blocked_by)
            seen = coordinator.saves
        phase.resent = trainer.dispatcher.resent_fresh - resent_before
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    return phase


# --- the bench item --------------------------------------------------------------------


def _p50(cuts: list[Cut], part: str) -> float:
    return percentile([c.seconds[part] for c in cuts], 50)


def _stats(phase: Phase, label: str) -> dict[str, float | int | str]:
    cuts = phase.cuts
    out: dict[str, float | int | str] = {}
    for part in PARTS:
        values = [c.seconds[part] for c in cuts]
        out[f"{label}_{part}_p50_ms"] = percentile(values, 50) * 1e3
        out[f"{label}_{part}_p99_ms"] = percentile(values, 99) * 1e3
    for kind in KINDS:
        out[f"{label}_commit_{kind}_p50_ms"] = _p50(cuts, f"commit_{kind}") * 1e3
    out[f"{label}_first_pause_ms"] = cuts[0].seconds["pause"] * 1e3 if cuts else math.nan
    out[f"{label}_in_flight_at_cut"] = round(percentile([c.in_flight for c in cuts], 50))
    out[f"{label}_saved_at_cut"] = round(percentile([c.saved for c in cuts], 50))
    out[f"{label}_restarts_at_cut"] = round(percentile([c.restarts for c in cuts], 50))
    out[f"{label}_turns_per_saved_session"] = percentile([c.turns for c in cuts], 50)
    for part in (*KINDS, "trainer"):
        sizes = [float(c.sizes.get(part, 0)) for c in cuts]
        out[f"{label}_{part}_mb"] = percentile(sizes, 50) / 1e6
    out[f"{label}_snapshots"] = len(cuts)
    out[f"{label}_failed_snapshots"] = len(phase.failed)
    out[f"{label}_rows_resent_fresh"] = phase.resent
    out[f"{label}_ramp_s"] = phase.ramp_s
    return out


def _growth(a: Phase, b: Phase) -> dict[str, float | int | str]:
    """How the pause grows from phase ``a`` to the larger phase ``b``."""
    tag = f"n{b.sessions}_vs_n{a.sessions}"
    # Per saved session: restarts are not exported, so they cost the cut next to nothing.
    span = percentile([c.saved for c in b.cuts], 50) - percentile([c.saved for c in a.cuts], 50)
    out: dict[str, float | int | str] = {}
    for part in ("pause", "mechanism", "commit", "drain"):
        out[f"{part}_ratio_{tag}"] = _p50(b.cuts, part) / _p50(a.cuts, part)
        if span > 0:
            grown = _p50(b.cuts, part) - _p50(a.cuts, part)
            out[f"{part}_us_per_session_{tag}"] = grown / span * 1e6
    return out


async def run(
    sessions: Sequence[int] = (100, 1000, 10_000),
    *,
    snapshots: int = 6,
    finished: int = 50_000,
    finished_at: int = 100,
    cold: bool = True,
) -> BenchResult:
    """``cold``: also the largest count without snapshots while its sessions open."""
    figures: dict[str, float | int | str] = {}
    phases: list[Phase] = []
    for n in sessions:
        phases.append(await measure(n, snapshots=snapshots))
        figures |= _stats(phases[-1], f"n{n}")
    if cold and sessions:
        n = max(sessions)
        figures |= _stats(await measure(n, snapshots=snapshots, warm=False), f"n{n}_cold")
    for a, b in itertools.pairwise(phases):
        figures |= _growth(a, b)
    base = next((p for p in phases if p.sessions == finished_at), None)
    if base is None:
        base = await measure(finished_at, snapshots=snapshots)
    loaded = await measure(finished_at, snapshots=snapshots, finished=finished)
    tag = f"finished{finished // 1000}k"
    figures |= _stats(loaded, f"n{finished_at}_{tag}")
    for part in ("pause", "mechanism", "commit"):
        figures[f"{part}_ratio_{tag}_vs_0"] = _p50(loaded.cuts, part) / _p50(base.cuts, part)
    return BenchResult(
        key="snapshot_pause",
        title="snapshot pause (barrier closed → reopened) and its parts vs sessions in flight",
        figures=figures,
        params={
            "sessions": "/".join(str(n) for n in sessions),
            "snapshots_each": snapshots,
            "while_opening": f"a snapshot every {RAMP_SNAPSHOT_S:g} s (not measured); cold: none",
            "replicas": REPLICAS,
            "policy": f"scripted, N/rate s a call, rate {CALLS_PER_S}/s ({CALLS_PER_S_AT_10K} at 10k)",
            "episode": f"workplace, {TURNS_PER_EPISODE} turns",
            "finished_compare": f"{finished:,} sealed at n={finished_at}",
        },
    )


async def run_large(sessions: int = 100_000, *, snapshots: int = 4) -> BenchResult:
    """One point past :data:`LARGE`, cold: no snapshot while its sessions open (the first
    attempt, a snapshot every 30 s while opening 400 rows/s, overloaded the agents and
    rows lost their streams), so the first cut is the first that saves every session (the
    servers' state images were kept from the start, so it copies most of them) and is
    reported apart; the others are the pause a running job sees."""
    phase = await measure(sessions, snapshots=snapshots, warm=False)
    first, rest = phase.cuts[0], phase.cuts[1:]
    figures = _stats(dataclasses.replace(phase, cuts=rest), f"n{sessions}")
    figures[f"n{sessions}_cold_first_pause_ms"] = first.seconds["pause"] * 1e3
    figures[f"n{sessions}_cold_first_commit_ms"] = first.seconds["commit"] * 1e3
    offered = load(sessions)
    return BenchResult(
        key="snapshot_pause_100k",
        title=f"snapshot pause at {sessions:,} sessions in flight (after the cold first cut)",
        figures=figures,
        params={
            "sessions": sessions,
            "snapshots": f"{snapshots} (the first, cold, apart)",
            "replicas": REPLICAS,
            "group_size": offered.group_size,
            "upstream_connections": offered.upstream_connections or 0,
            "policy": f"scripted, {offered.policy_latency_s:g} s a call, "
            f"{offered.calls_per_s:g} calls/s",
            "rows_opened_per_s": offered.rows_per_s,
            "episode": f"workplace, {TURNS_PER_EPISODE} turns",
        },
    )
