"""What periodic snapshots cost a job's throughput: snapshots every 5 s against none.

The job of ``journal_job`` (``snapshot_pause``'s: real server processes, 2 replicas, 10k
sessions of workplace episodes at a fixed offered load of 200 calls a second, token data
with ~1k-token turns), with the servers journaling and ``snapshot.mode: journal`` (the
pause-free snapshots of issue 37), or the same job with ``snapshot.mode: cut``. Each leg
opens its sessions (a snapshot every 5 s meanwhile, as ``snapshot_pause``'s warm ramp),
settles :data:`SETTLE_S`, then measures :data:`WINDOW_S` either with a snapshot every
:data:`EVERY_S` (``every_5s``: the trainer's periodic snapshots, each started 5 s after the
previous one began, as ``snapshot.every_seconds`` does) or with none (``off``). Legs run in
the order off, every_5s, every_5s, off, so whatever the shared machine does over the item
falls on both sides.

Over the window:

- ``turns_per_s``: policy calls the model servers answered (their ``calls_total``), each
  leg's too (``legs_turns_per_s``), and ``spread``, how far the legs of one side lie apart
  (max - min over their mean): the job offers more calls than two cores answer (the
  scripted engine alone takes ~0.8 of one), so its rate is the machine's capacity and
  moves with whatever else the shared machine runs — one leg in six ran 14 % slow in the
  profile of 2026-12-07 (docs/log/journal-snapshots-2026-12.md);
- ``cpu_ms_per_turn``: CPU time of every process of the job per turn, from ``/proc``. The
  offered load is fixed, so a snapshot's cost shows as CPU a turn (and as fewer turns only
  where it stalls calls: the cut's pause does);
- ``snapshots``, ``failed``: what the window published and what failed;
- ``closed_ms_p99``: time admission was closed per snapshot (0 in journal mode);
- ``save_ms_p50``: a snapshot from its start to its publication (or its failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.journal_job import _model_calls, cpu_seconds, descendants, settled_job
from bench.latency import percentile
from bench.report import BenchResult
from bench.snapshot_growth import TOKENS_POLICY
from bench.snapshot_pause import (
    _config,
    load,
    long_task,
)
from rollpoint.http.client import HttpClient
from rollpoint.protocol.errors import SnapshotError
from rollpoint.tuning import install as install_tuning

SETTLE_S = 30.0
WINDOW_S = 60.0
EVERY_S = 5.0
ORDER = ("off", "every_5s", "every_5s", "off")


@dataclass
class Leg:
    snapshots_on: bool
    turns: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    published: int = 0
    failed: int = 0
    closed_ms: list[float] = field(default_factory=list)
    save_ms: list[float] = field(default_factory=list)


async def run_leg(
    sessions: int,
    *,
    mode: str,
    snapshots_on: bool,
    settle_s: float,
    window_s: float,
    tokens: bool = True,
) -> Leg:
    install_tuning()
    leg = Leg(snapshots_on=snapshots_on)
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(
            Path(tmp) / "run",
            sessions,
            TOKENS_POLICY if tokens else None,
            journal=True,
            snapshot_mode=mode,
        )
        config.workdir.mkdir(parents=True, exist_ok=True)
        group_size = load(sessions).group_size
        tasks = [long_task(i) for i in range(3 * math.ceil(sessions / group_size) + 200)]
        token = secrets.token_urlsafe(32)
        root = config.snapshot_root()
        control_http = HttpClient(token=token, timeout_s=300)
        try:
            await _run_job(leg, config, tasks, token, root, control_http, settle_s, window_s)
        finally:
            await control_http.aclose()
    return leg


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
        pids = [os.getpid(), *descendants(os.getpid())]
        calls0, cpu0 = await _model_calls(participants), cpu_seconds(pids)
        t0 = time.monotonic()
        ends = t0 + window_s
        while leg.snapshots_on and time.monotonic() + EVERY_S <= ends:
            started = time.monotonic()
            with contextlib.suppress(SnapshotError):
                await coordinator.save()
            leg.save_ms.append((time.monotonic() - started) * 1e3)
            await asyncio.sleep(max(started + EVERY_S - time.monotonic(), 0))
        await asyncio.sleep(max(ends - time.monotonic(), 0))
        if run.done():
            run.result()
            raise RuntimeError("the trainer stopped during the measured window")
        calls1, cpu1 = await _model_calls(participants), cpu_seconds(pids)
        leg.seconds = time.monotonic() - t0
        leg.turns = calls1 - calls0
        leg.cpu_s = sum(cpu1[p] - cpu0[p] for p in cpu1 if p in cpu0)
        for report in coordinator.reports_since(seen):
            if report.published:
                leg.published += 1
                leg.closed_ms.append(report.pause_s * 1e3)
            else:
                leg.failed += 1


def _figures(legs: list[Leg], tag: str) -> dict[str, float | int | str]:
    out: dict[str, float | int | str] = {}
    for side, on in (("off", False), ("every_5s", True)):
        mine = [g for g in legs if g.snapshots_on == on]
        if not mine:
            continue
        turns = sum(g.turns for g in mine)
        out[f"{tag}_{side}_turns_per_s"] = turns / sum(g.seconds for g in mine)
        rates = [g.turns / g.seconds for g in mine]
        out[f"{tag}_{side}_legs_turns_per_s"] = ", ".join(f"{r:.1f}" for r in rates)
        if len(rates) > 1:
            # Two legs of one side differ by what the shared machine did meanwhile: the
            # noise floor the ratio below is read against.
            out[f"{tag}_{side}_spread"] = (max(rates) - min(rates)) / (sum(rates) / len(rates))
        out[f"{tag}_{side}_cpu_ms_per_turn"] = sum(g.cpu_s for g in mine) / turns * 1e3
        out[f"{tag}_{side}_snapshots"] = sum(g.published for g in mine)
        out[f"{tag}_{side}_failed"] = sum(g.failed for g in mine)
        closed = [ms for g in mine for ms in g.closed_ms]
        saves = [ms for g in mine for ms in g.save_ms]
        if closed:
            out[f"{tag}_{side}_closed_ms_p99"] = percentile(closed, 99)
            out[f"{tag}_{side}_save_ms_p50"] = percentile(saves, 50)
    if f"{tag}_off_turns_per_s" in out and f"{tag}_every_5s_turns_per_s" in out:
        out[f"{tag}_turns_per_s_every_5s_over_off"] = float(
            out[f"{tag}_every_5s_turns_per_s"]
        ) / float(out[f"{tag}_off_turns_per_s"])
        out[f"{tag}_cpu_per_turn_every_5s_over_off"] = float(
            out[f"{tag}_every_5s_cpu_ms_per_turn"]
        ) / float(out[f"{tag}_off_cpu_ms_per_turn"])
    return out


async def run(
    sessions: int = 10_000,
    *,
    mode: str = "journal",
    settle_s: float = SETTLE_S,
    window_s: float = WINDOW_S,
    order: Sequence[str] = ORDER,
    tokens: bool = True,
) -> BenchResult:
    """``tokens``: ~1k-token turns with their ids and logprobs captured (off at 100k:
    the servers would need far more memory than the machine has)."""
    legs = []
    for side in order:
        legs.append(
            await run_leg(
                sessions,
                mode=mode,
                snapshots_on=side != "off",
                settle_s=settle_s,
                window_s=window_s,
                tokens=tokens,
            )
        )
    offered = load(sessions)
    return BenchResult(
        key="snapshot_cost",
        title="what snapshots every 5 s cost a job's throughput, against none",
        figures=_figures(legs, f"n{sessions}_{mode}"),
        params={
            "sessions": sessions,
            "snapshot_mode": mode,
            "order": ",".join(order),
            "settle_s": settle_s,
            "window_s": window_s,
            "every_s": EVERY_S,
            "policy": f"scripted, {offered.policy_latency_s:g} s a call, "
            f"{offered.calls_per_s:g} calls/s offered",
            "tokens": "capture_tokens, 1,000 reasoning tokens a tool call (vLLM shape)"
            if tokens
            else "none",
        },
    )
