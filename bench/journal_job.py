"""Journaling in a job at 10k sessions with ~1k-token turns: its cost, and a restore with a minute of it.

The job of ``snapshot_pause`` (real server processes, 2 replicas, a trainer keeping N rows
in flight, workplace episodes of 25 policy calls at a fixed offered load: 200 calls a second
at 10k) with token data as ``snapshot_growth`` runs it (``capture_tokens``, 1,000 stand-in
reasoning tokens before every tool call, so each turn's completion is ~1k tokens with ids and
logprobs), run with ``journal.enabled`` off and on, in the order off, on, on, off: whatever
the shared machine does over the item falls on both sides.

Each leg opens its sessions (a snapshot every 5 s meanwhile, as ``snapshot_pause``'s warm
ramp), runs :data:`SETTLE_S` more, takes one snapshot and then runs :data:`WINDOW_S` with no
snapshot, measuring over that window:

- ``turns_per_s``: policy calls the model servers answered (their ``calls_total``);
- ``cpu_ms_per_turn``: CPU time of every process of the job (the servers, the scripted
  engine, and this process, which runs the trainer), from ``/proc``, per turn. The offered
  load is fixed, so journaling's cost shows as CPU a turn, not as fewer turns while the two
  cores have room: a job limited by its CPU loses at most that share of its throughput;
- ``journal_mb``: bytes the journals' segments grew by, and per turn.

Then every process of the job is SIGKILLed (a crash a minute after the snapshot) and the job
restored as ``rollpoint run`` restores it: a new runtime on the same store (its servers open
their journals: ``up_s``; without the engine's start check, which the scripted engine, taking
N / rate = 50 s a call at 10k, answers only after its 30 s timeout, where a real engine
answers one token in milliseconds), the snapshot found and verified (``find_s``) and installed with
its episodes continued (``install_s``); ``journal_turns`` is what the agents' journals then
hold past the snapshot (each episode resumes from there as its row comes: the calls it
makes again are answered from the journals, not sampled or run). ``restore_s`` is the sum.
With the journal off the same restore has nothing past the snapshot: the minute is done
again (``crash_rework`` counts that work).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.latency import percentile
from bench.report import BenchResult
from bench.snapshot_growth import TOKENS_POLICY
from bench.snapshot_pause import (
    RAMP_SNAPSHOT_S,
    MeteredClient,
    _config,
    _ramp,
    bench_trainer,
    load,
    long_task,
)
from rollpoint.http.client import HttpClient
from rollpoint.job.journal_status import journal_pending
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.runtime import embedded
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.control.control_plane import participant_clients
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.record.workdir_record import WorkdirRecord
from rollpoint.trainer.restore.restorer import Restorer
from rollpoint.trainer.restore.resume_point import find_resume_point
from rollpoint.trainer.trainer import Trainer
from rollpoint.tuning import install as install_tuning
from tests.support.processes import descendants_of as descendants

SETTLE_S = 30.0
"""After the sessions opened: they are some turns in, as in a steady job."""
WINDOW_S = 60.0
"""Measured, with no snapshot: the journal a restore replays is this long."""
ORDER = ("off", "on", "on", "off")
_TICK_S = os.sysconf("SC_CLK_TCK")


@dataclass
class Leg:
    journal: bool
    turns: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    journal_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes each kind of participant's journals grew by in the window."""
    up_s: float = 0.0
    find_s: float = 0.0
    install_s: float = 0.0
    continued: int = 0
    journal_turns: int = 0
    failed_snapshots: int = 0


@contextlib.contextmanager
def engine_check_timed() -> Iterator[list[float]]:
    """The runtime's engine start check, each one's seconds noted in the list yielded."""
    spent: list[float] = []
    check = embedded.check_engine

    async def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return await check(*args, **kw)
        finally:
            spent.append(time.monotonic() - t0)

    embedded.check_engine = timed  # type: ignore[assignment]
    try:
        yield spent
    finally:
        embedded.check_engine = check


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds of each process still there."""
    out: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / _TICK_S
    return out


def journal_bytes(root: str) -> dict[str, int]:
    """Segment bytes by participant kind (``journal/<kind>/<name>-<replica>/``)."""
    out = dict.fromkeys(("agent", "model", "resources"), 0)
    for path in Path(root, "journal").rglob("segment-*.rpj"):
        kind = path.parent.parent.name
        out[kind] = out.get(kind, 0) + path.stat().st_size
    return out


async def _model_calls(participants: Sequence[ParticipantClient]) -> int:
    models = [p for p in participants if p.address.kind is ParticipantKind.MODEL]
    replies = await asyncio.gather(*(p.status() for p in models))
    return sum(int(r.counts.get("calls_total", 0)) for r in replies)


async def run_leg(sessions: int, *, journal: bool, settle_s: float, window_s: float) -> Leg:
    """One job: open, settle, snapshot, the measured window, SIGKILL, restore."""
    install_tuning()
    leg = Leg(journal=journal)
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(Path(tmp) / "run", sessions, TOKENS_POLICY, journal=journal)
        config.workdir.mkdir(parents=True, exist_ok=True)
        group_size = load(sessions).group_size
        tasks = [long_task(i) for i in range(3 * math.ceil(sessions / group_size) + 200)]
        token = secrets.token_urlsafe(32)
        root = config.snapshot_root()
        control_http = HttpClient(token=token, timeout_s=300)
        try:
            await _run_job(leg, config, tasks, token, root, control_http, settle_s, window_s)
            await _restore(leg, config, token, root, control_http)
        finally:
            await control_http.aclose()
    return leg


@contextlib.asynccontextmanager
async def settled_job(
    config: Any,
    tasks: list[Any],
    token: str,
    root: str,
    control_http: HttpClient,
    settle_s: float,
) -> AsyncIterator[tuple[Trainer, list[ParticipantClient], asyncio.Task[Any]]]:
    """The job up, its sessions opened and ``settle_s`` run (a snapshot every
    :data:`RAMP_SNAPSHOT_S` meanwhile): its trainer, its participants and the trainer's run
    task, cancelled on the way out. ``snapshot_cost`` runs the same job."""
    sessions = config.concurrency
    store = await asyncio.to_thread(SnapshotStore, root, config.snapshot.keep)
    async with EmbeddedRuntime(
        config.runtime_settings(), control_token=token, snapshot_root=root
    ) as runtime:
        assert runtime.deployment is not None
        data_http = MeteredClient(load(sessions).rows_per_s, sessions)
        participants = participant_clients(runtime.deployment, control_http)
        trainer = bench_trainer(config, runtime.deployment, tasks, participants, store, data_http)
        coordinator = trainer.coordinator
        assert coordinator is not None
        run = asyncio.create_task(trainer.run())
        try:
            await _ramp(trainer, participants, sessions, warm=True)
            settled_at = time.monotonic() + settle_s
            while time.monotonic() < settled_at and not run.done():
                await asyncio.sleep(min(RAMP_SNAPSHOT_S, max(settled_at - time.monotonic(), 0)))
                with contextlib.suppress(Exception):
                    await coordinator.save()
            yield trainer, list(participants), run
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await data_http.aclose()


async def _run_job(
    leg: Leg,
    config: Any,
    tasks: list[Any],
    token: str,
    root: str,
    control_http: HttpClient,
    settle_s: float,
    window_s: float,
) -> None:
    async with settled_job(config, tasks, token, root, control_http, settle_s) as job:
        trainer, participants, run = job
        coordinator = trainer.coordinator
        assert coordinator is not None
        seen = coordinator.saves
        await coordinator.save()
        leg.failed_snapshots = sum(not r.published for r in coordinator.reports_since(seen))
        pids = [os.getpid(), *descendants(os.getpid())]
        calls0, cpu0 = await _model_calls(participants), cpu_seconds(pids)
        bytes0 = await asyncio.to_thread(journal_bytes, root)
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        if run.done():
            run.result()
            raise RuntimeError("the trainer stopped during the measured window")
        calls1, cpu1 = await _model_calls(participants), cpu_seconds(pids)
        leg.seconds = time.monotonic() - t0
        leg.turns = calls1 - calls0
        leg.cpu_s = sum(cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0)
        bytes1 = await asyncio.to_thread(journal_bytes, root)
        leg.journal_bytes = {k: bytes1[k] - bytes0.get(k, 0) for k in bytes1}
        # The crash: every process of the job at once, the trainer's task with them.
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _restore(leg: Leg, config: Any, token: str, root: str, control_http: HttpClient) -> None:
    """As ``rollpoint run`` restores: servers up, the snapshot found, installed."""
    with engine_check_timed() as checks:
        t0 = time.monotonic()
        async with EmbeddedRuntime(
            config.runtime_settings(), control_token=token, snapshot_root=root
        ) as runtime:
            assert runtime.deployment is not None
            leg.up_s = time.monotonic() - t0 - sum(checks)
            participants = participant_clients(runtime.deployment, control_http)
            t1 = time.monotonic()
            store = await asyncio.to_thread(SnapshotStore, root, config.snapshot.keep)
            record = WorkdirRecord(config.workdir)
            point, skipped = await asyncio.to_thread(find_resume_point, store, record)
            if point is None:
                raise RuntimeError(f"no snapshot to restore: {[s.line() for s in skipped]}")
            leg.find_s = time.monotonic() - t1
            t2 = time.monotonic()
            restored = await Restorer(participants).restore(
                point, step_record=record, deadline_s=600, continue_episodes=True
            )
            leg.install_s = time.monotonic() - t2
            leg.continued = len(restored.continued)
            pending = await journal_pending(participants)
            leg.journal_turns = 0 if pending is None else sum(pending[0].values())


def _figures(legs: list[Leg], tag: str) -> dict[str, float | int | str]:
    out: dict[str, float | int | str] = {}
    for side in ("off", "on"):
        mine = [g for g in legs if g.journal == (side == "on")]
        if not mine:
            continue
        turns = sum(g.turns for g in mine)
        out[f"{tag}_{side}_turns_per_s"] = turns / sum(g.seconds for g in mine)
        out[f"{tag}_{side}_cpu_ms_per_turn"] = sum(g.cpu_s for g in mine) / turns * 1e3
        out[f"{tag}_{side}_restore_s"] = percentile(
            [g.up_s + g.find_s + g.install_s for g in mine], 50
        )
        for part in ("up_s", "find_s", "install_s"):
            out[f"{tag}_{side}_restore_{part}"] = percentile([getattr(g, part) for g in mine], 50)
        out[f"{tag}_{side}_continued"] = percentile([g.continued for g in mine], 50)
        out[f"{tag}_{side}_failed_snapshots"] = sum(g.failed_snapshots for g in mine)
    on = [g for g in legs if g.journal]
    if not on:
        return out
    turns_on = sum(g.turns for g in on)
    out[f"{tag}_on_journal_mb"] = percentile([sum(g.journal_bytes.values()) / 1e6 for g in on], 50)
    out[f"{tag}_on_journal_kb_per_turn"] = (
        sum(sum(g.journal_bytes.values()) for g in on) / turns_on / 1e3
    )
    for kind in ("agent", "model", "resources"):
        out[f"{tag}_on_journal_{kind}_kb_per_turn"] = (
            sum(g.journal_bytes.get(kind, 0) for g in on) / turns_on / 1e3
        )
    out[f"{tag}_on_journal_turns_past_snapshot"] = percentile([g.journal_turns for g in on], 50)
    if len(on) == len(legs):
        return out
    out[f"{tag}_cpu_per_turn_on_over_off"] = float(out[f"{tag}_on_cpu_ms_per_turn"]) / float(
        out[f"{tag}_off_cpu_ms_per_turn"]
    )
    out[f"{tag}_turns_per_s_on_over_off"] = float(out[f"{tag}_on_turns_per_s"]) / float(
        out[f"{tag}_off_turns_per_s"]
    )
    out[f"{tag}_restore_on_minus_off_s"] = float(out[f"{tag}_on_restore_s"]) - float(
        out[f"{tag}_off_restore_s"]
    )
    return out


async def run(
    sessions: int = 10_000,
    *,
    settle_s: float = SETTLE_S,
    window_s: float = WINDOW_S,
    order: Sequence[str] = ORDER,
) -> BenchResult:
    legs = []
    for side in order:
        legs.append(
            await run_leg(sessions, journal=side == "on", settle_s=settle_s, window_s=window_s)
        )
    offered = load(sessions)
    return BenchResult(
        key="journal_job",
        title="journaling's cost in a job with ~1k-token turns, and a restore with a minute of it",
        figures=_figures(legs, f"n{sessions}"),
        params={
            "sessions": sessions,
            "order": ",".join(order),
            "settle_s": settle_s,
            "window_s": window_s,
            "policy": f"scripted, {offered.policy_latency_s:g} s a call, "
            f"{offered.calls_per_s:g} calls/s offered",
            "tokens": "capture_tokens, 1,000 reasoning tokens a tool call (vLLM shape)",
            "journal": "default group-commit window",
        },
    )
