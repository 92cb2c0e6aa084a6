"""Work re-done after a stop, on a job shaped like agentic RL: three ways to die, side by side.

The job: workplace tasks of 8-15 events (and at most one email) to schedule and confirm, so
every episode takes 17-32 turns of the scripted policy (no mistakes, 300 ms a call), with
snapshots every 5 s. It runs once without a stop (the baseline), then three times stopped at
the same point (once a seeded random share of the baseline's policy calls were answered)
and resumed:

- ``sigterm``: a real SIGTERM to this process, handled as ``rollpoint run`` handles it (the
  preemption: a final snapshot within the grace, then the servers stop);
- ``sigkill``: every server process SIGKILLed at that moment and the trainer stopped where it
  is (``recovery: turn``: the rerun continues each saved episode from its last turn);
- ``restart``: the same SIGKILL with ``recovery: restart`` (every unfinished episode starts
  over from its prompt: the baseline that turn-level recovery is measured against);
- ``sigkill_journal``: the ``sigkill`` case with the durable-turns journal on (the model
  and resources servers journal every finished call; a call made again is answered from it).

Policy calls are counted by the model servers (``calls_total``) of each run: read just
before the servers stop (SIGTERM, and the end of every full run) or just before the kill.
Re-done work is what a stopped job needed beyond the baseline, in policy calls and in
seconds of rollout time (from the trainer's start to its end, both runs summed), each also
as a ratio to ``restart``'s. ``sigkill_journal``'s seconds are measured against a second
baseline run with the journal on (``baseline_journal``): every turn of a journaling job
waits for group commits (the model server's and the resources server's, before their
replies), so against the plain baseline its figure would count that cost on the whole job,
not work re-done; that cost is its own figure, ``journal_seconds_cost`` (the two
baselines' difference: noise on a loaded machine, see docs/log/journal-2026-12.md). For ``sigterm`` the policy calls in flight at the signal are
read from the model servers as it is sent: the goal is to re-do no more than those.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.report import BenchResult
from rollpoint.app.config import RunConfig, parse_config
from rollpoint.envs.workplace import ExpectedEmail, ExpectedEvent, WorkplaceParams, workplace_prompt
from rollpoint.http.client import HttpClient
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.preemption import StopRequest
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import RunPreemptedError
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import RunSummary, Trainer

LATENCY_MS = 300
SNAPSHOT_EVERY_S = 5.0
GROUP_SIZE = 4
CONCURRENCY = 32
EVENTS = (8, 15)
"""Events per task: 2 turns each (create, then search to confirm), plus an email turn (or
not) and the final answer: 17-32 turns."""
STOP_AT_SHARE = (0.3, 0.7)
"""The stop comes once the run's model servers answered a seeded random share (in this
range) of the baseline's policy calls: the same progress in every leg, whatever the load
does between legs (a share of the baseline's seconds came after a leg's end once the load
fell: "the job ended before the kill")."""
POLL_S = 0.05
CASES = ("sigterm", "sigkill", "restart", "sigkill_journal")
"""``sigkill_journal``: the ``sigkill`` case with ``journal.enabled`` (issue 35): the rerun's
calls that were finished before the kill are answered from the model servers' journals."""


class Killed(Exception):
    """The bench's crash: raised out of the first run after its servers were SIGKILLed."""


@dataclass
class Leg:
    calls: int = 0
    seconds: float = 0.0
    in_flight_at_stop: int = 0
    stopping_s: float = 0.0
    """Of ``seconds``: from the stop to the first run's end (the trainer cancelled, or the
    final snapshot taken)."""
    rerun_s: float = 0.0
    """Of ``seconds``: the rerun's (the full run after the stop)."""


# The model servers' /stats is a data route: the bench hands run_job the token it reads with.
DATA_TOKEN = secrets.token_urlsafe(16)


async def _stats(runtime: Runtime) -> list[dict[str, Any]]:
    assert runtime.deployment is not None
    async with HttpClient(token=DATA_TOKEN, timeout_s=10) as http:
        return list(
            await asyncio.gather(
                *(
                    http.get_json(f"{r.model_url}/rollpoint/v1/stats")
                    for r in runtime.deployment.replicas
                )
            )
        )


async def _calls(runtime: Runtime) -> int:
    return sum(int(s["calls_total"]) for s in await _stats(runtime))


def write_dataset(path: Path, tasks: int, seed: int) -> None:
    """Workplace tasks long enough for 17-32 turns an episode."""
    rng = random.Random(seed)
    lines = []
    for i in range(tasks):
        events = [
            ExpectedEvent(
                title=f"Meeting {i}-{k}",
                date=f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                start_time=f"{rng.randint(8, 17):02d}:{rng.choice((0, 30)):02d}",
                duration_minutes=rng.choice((15, 30, 45, 60)),
            )
            for k in range(rng.randint(*EVENTS))
        ]
        emails = [
            ExpectedEmail(to="ana@example.com", subject=f"Agenda for {events[0].title}")
            for _ in range(rng.randint(0, 1))
        ]
        params = WorkplaceParams(events=events, emails=emails)
        row = TaskRow(
            task_id=f"long-{i:04d}",
            environment="workplace",
            prompt=workplace_prompt(params),
            params=params.model_dump(mode="json"),
        )
        lines.append(orjson.dumps(row.model_dump(mode="json")))
    path.write_bytes(b"\n".join(lines) + b"\n")


def _config(workdir: Path, dataset: Path, recovery: str, *, journal: bool = False) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(workdir),
            "environment": "workplace",
            "dataset": str(dataset),
            "tasks": None,
            "group_size": GROUP_SIZE,
            "max_turns": 40,
            "replicas": 2,
            "concurrency": CONCURRENCY,
            "policy": {"latency_ms": LATENCY_MS, "error_rate": 0.0},
            "train": {"batch_size": 16},
            "snapshot": {"every_seconds": SNAPSHOT_EVERY_S},
            "recovery": recovery,
            "preemption": {"grace_seconds": 25},
            "journal": {"enabled": journal},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


def _say(_: str) -> None:
    pass


async def _full_run(config: RunConfig, leg: Leg) -> RunSummary:
    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        t0 = time.monotonic()
        summary = await drive_quietly(trainer, runtime, metrics)
        leg.rerun_s = time.monotonic() - t0
        leg.seconds += leg.rerun_s
        leg.calls += await _calls(runtime)
        return summary

    return await run_job(
        config.job_settings(),
        fresh=False,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=_say,
        drive=drive,
        data_token=DATA_TOKEN,
    )


async def _until_calls(job: asyncio.Task[Any], runtime: Runtime, calls: int) -> None:
    """Return once the run's model servers answered ``calls`` policy calls (or it ended)."""
    while not job.done() and await _calls(runtime) < calls:
        await asyncio.wait({job}, timeout=POLL_S)


async def _killed_run(config: RunConfig, leg: Leg, stop_calls: int) -> None:
    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> Any:
        assert isinstance(runtime, EmbeddedRuntime), "the kill needs local server processes"
        t0 = time.monotonic()
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        await _until_calls(job, runtime, stop_calls)
        if job.done():
            raise RuntimeError(f"the job ended before the kill at {stop_calls} calls")
        stats = await _stats(runtime)
        leg.calls += sum(int(s["calls_total"]) for s in stats)
        leg.in_flight_at_stop = sum(int(s["in_flight"]) for s in stats)
        stopped = time.monotonic()
        for child in runtime.group.children:
            if child.alive:
                os.kill(child.process.pid, signal.SIGKILL)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        leg.stopping_s = time.monotonic() - stopped
        leg.seconds += time.monotonic() - t0
        raise Killed

    with contextlib.suppress(Killed):
        await run_job(
            config.job_settings(),
            fresh=False,
            hooks=SimulatedTrainer(config.train.step_seconds),
            say=_say,
            drive=drive,
            data_token=DATA_TOKEN,
        )


async def _preempted_run(config: RunConfig, leg: Leg, stop_calls: int) -> str:
    """SIGTERM to this very process, through the handler ``rollpoint run`` installs."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    stop = StopRequest(cancel=main.cancel)
    loop.add_signal_handler(signal.SIGTERM, stop.signal, signal.SIGTERM)

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> RunSummary:
        t0 = time.monotonic()
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        try:
            await _until_calls(job, runtime, stop_calls)
            if job.done():
                raise RuntimeError(f"the job ended before the signal at {stop_calls} calls")
            leg.in_flight_at_stop = sum(int(s["in_flight"]) for s in await _stats(runtime))
            stopped = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            return await job
        except asyncio.CancelledError:
            # The final snapshot is published: the servers stop once this returns.
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            leg.stopping_s = time.monotonic() - stopped
            leg.seconds += time.monotonic() - t0
            leg.calls += await _calls(runtime)
            raise

    try:
        await run_job(
            config.job_settings(),
            fresh=False,
            hooks=SimulatedTrainer(config.train.step_seconds),
            say=_say,
            drive=drive,
            data_token=DATA_TOKEN,
            stop=stop,
        )
    except RunPreemptedError as exc:
        return exc.message
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    raise RuntimeError("the job was not preempted")


async def run(tasks: int = 16, seed: int = 0) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "tasks.jsonl"
        write_dataset(dataset, tasks, seed)
        base = Leg()
        await _full_run(_config(Path(tmp) / "baseline", dataset, "turn"), base)
        figures["baseline_policy_calls"] = base.calls
        figures["baseline_seconds"] = base.seconds
        base_journal = Leg()
        await _full_run(
            _config(Path(tmp) / "baseline_journal", dataset, "turn", journal=True), base_journal
        )
        figures["baseline_journal_seconds"] = base_journal.seconds
        figures["journal_seconds_cost"] = base_journal.seconds - base.seconds
        share = random.Random(seed).uniform(*STOP_AT_SHARE)
        stop_calls = round(share * base.calls)
        figures["stop_at_calls"] = stop_calls
        legs: dict[str, Leg] = {}
        for case in CASES:
            leg = legs[case] = Leg()
            config = _config(
                Path(tmp) / case,
                dataset,
                "restart" if case == "restart" else "turn",
                journal=case == "sigkill_journal",
            )
            if case == "sigterm":
                figures["sigterm_line"] = await _preempted_run(config, leg, stop_calls)
            else:
                await _killed_run(config, leg, stop_calls)
            await _full_run(config, leg)
        restart_calls = legs["restart"].calls - base.calls
        restart_s = legs["restart"].seconds - base.seconds
        for case in CASES:
            leg = legs[case]
            baseline = base_journal if case == "sigkill_journal" else base
            calls, seconds = leg.calls - base.calls, leg.seconds - baseline.seconds
            figures[f"{case}_calls_in_flight_at_stop"] = leg.in_flight_at_stop
            figures[f"{case}_policy_calls_redone"] = calls
            figures[f"{case}_seconds_redone"] = seconds
            # Where the seconds went: the stop itself, and the rerun (whose own part is
            # the work left after the stop plus what was re-done).
            figures[f"{case}_stopping_seconds"] = leg.stopping_s
            figures[f"{case}_rerun_seconds"] = leg.rerun_s
            figures[f"{case}_calls_ratio_to_restart"] = (
                calls / restart_calls if restart_calls else float("nan")
            )
            figures[f"{case}_seconds_ratio_to_restart"] = (
                seconds / restart_s if restart_s else float("nan")
            )
        sigterm = legs["sigterm"]
        figures["goal_sigterm_redone_le_in_flight"] = str(
            sigterm.calls - base.calls <= sigterm.in_flight_at_stop
        )
        ratio = figures["sigkill_calls_ratio_to_restart"]
        assert isinstance(ratio, float)
        figures["goal_sigkill_le_0.15_of_restart"] = str(ratio <= 0.15)
        journaled = legs["sigkill_journal"]
        figures["goal_sigkill_journal_redone_le_in_flight"] = str(
            journaled.calls - base.calls <= journaled.in_flight_at_stop
        )
    return BenchResult(
        key="crash_rework",
        title="work re-done after a stop: SIGTERM with grace, SIGKILL, recovery: restart",
        figures=figures,
        params={
            "tasks": tasks,
            "group_size": GROUP_SIZE,
            "replicas": 2,
            "concurrency": CONCURRENCY,
            "turns_per_episode": "17-32",
            "policy_latency_ms": LATENCY_MS,
            "snapshot_every_s": SNAPSHOT_EVERY_S,
            "stop": f"at {stop_calls} policy calls (a seeded share {STOP_AT_SHARE} of the baseline's)",
        },
    )
