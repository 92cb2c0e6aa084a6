"""Decode re-done after a crash, with the generation cut against without it.

The same seeded job runs twice in one go, ``policy.generation_cut`` on and off, both with
token capture: long generations (reasoning before every tool call) from the scripted
policy at a fixed decode pace, snapshots at a fixed interval, and a real crash (every
server of the run SIGKILLed, the trainer stopped) at a random point after a snapshot, the
same point in both legs, then a rerun to the end. The engine runs outside the job, as a
real engine does, so it survives the crash and its ``decode_log`` says how many tokens
each generation really decoded, cut off or not.

Re-done decode = every token the engine decoded in the leg (the killed run and the rerun)
minus the completion tokens of the trained rows (each needed once): a cut-off generation
decoded again from scratch, a reply held at the crash's snapshot and then superseded, a
continued call's tokens between the snapshot and the kill. The pause figures come from
every snapshot of the leg (``metrics.jsonl``).

Time is scaled down ten times from the issue's setting (2,000 tokens at 50 tokens/s,
snapshots every 5 s): 2,000 tokens at 500 tokens/s, snapshots every 0.5 s, the same 250
tokens decoded between two snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.crash_rework import DATA_TOKEN, Killed, _say
from bench.latency import percentile
from bench.report import BenchResult
from rollpoint.app.config import RunConfig, parse_config
from rollpoint.job.run import drive_quietly, run_job
from rollpoint.loop import SimulatedTrainer
from rollpoint.runtime.contract import Runtime
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.runtime.process_group import ProcessGroup
from rollpoint.runtime.server_spec import ServerSpec
from rollpoint.store.snapshot_store import SnapshotStore
from rollpoint.trainer.metrics import TrainerMetrics
from rollpoint.trainer.trainer import Trainer

TOKENS = 2000
TOKENS_PER_S = 500
SNAPSHOT_EVERY_S = 0.5


def _config(workdir: Path, engine_url: str, *, cut: bool, seed: int) -> RunConfig:
    config = parse_config(
        {
            "workdir": str(workdir),
            "environment": "workplace",
            "tasks": 4,
            "group_size": 2,
            "max_turns": 3,
            "replicas": 2,
            "concurrency": 8,
            "seed": seed,
            "policy": {
                "base_url": engine_url,
                "capture_tokens": "required",
                "generation_cut": cut,
                "sampling": {"logprobs": True},
            },
            "train": {"batch_size": 4},
            "snapshot": {"every_seconds": SNAPSHOT_EVERY_S, "keep": 1000},
        }
    )
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config


async def _killed_run(config: RunConfig, after_s: float, into_s: float) -> float:
    """Run until ``after_s``, then kill at ``into_s`` after the next published snapshot."""
    store_root = config.snapshot_root()
    killed_at = 0.0

    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> Any:
        nonlocal killed_at
        assert isinstance(runtime, EmbeddedRuntime), "the kill needs local server processes"
        job = asyncio.create_task(drive_quietly(trainer, runtime, metrics))
        await asyncio.sleep(after_s)
        store = SnapshotStore(store_root, clean_leftovers=False)
        seen = {s.snapshot_id for s in store.list_snapshots()}
        while {s.snapshot_id for s in store.list_snapshots()} <= seen and not job.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if job.done():
            raise RuntimeError(f"the job ended before a snapshot published after {after_s}s")
        await asyncio.sleep(into_s)
        for child in runtime.group.children:
            if child.alive:
                os.kill(child.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
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
    return killed_at


async def _finish(config: RunConfig) -> None:
    async def drive(trainer: Trainer, runtime: Runtime, metrics: TrainerMetrics) -> Any:
        return await drive_quietly(trainer, runtime, metrics)

    await run_job(
        config.job_settings(),
        fresh=False,
        hooks=SimulatedTrainer(config.train.step_seconds),
        say=_say,
        drive=drive,
        data_token=DATA_TOKEN,
    )


def _decoded(log: Path) -> int:
    """Tokens the engine decoded, but for the start-up probes (``max_tokens: 1``)."""
    lines = [orjson.loads(raw) for raw in log.read_bytes().splitlines()] if log.exists() else []
    return sum(line["decoded"] for line in lines if line.get("max_tokens") != 1)


def _used(workdir: Path) -> int:
    used = 0
    for raw in (workdir / "train_data.jsonl").read_bytes().splitlines():
        for turn in orjson.loads(raw)["turns"]:
            used += len(turn["completion_token_ids"] or ())
    return used


def _pauses(workdir: Path) -> list[float]:
    lines = (workdir / "metrics.jsonl").read_bytes().splitlines()
    events = (orjson.loads(raw) for raw in lines)
    return [e["pause_seconds"] for e in events if e.get("event") == "snapshot"]


def _continued(workdir: Path) -> int:
    n = 0
    for raw in (workdir / "train_data.jsonl").read_bytes().splitlines():
        n += sum(1 for t in orjson.loads(raw)["turns"] if t.get("segments"))
    return n


async def run(seed: int = 3) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    rng = random.Random(seed)
    after_s = rng.uniform(6.0, 9.0)
    into_s = rng.uniform(0.0, SNAPSHOT_EVERY_S)
    with tempfile.TemporaryDirectory() as tmp:
        for cut in (True, False):
            leg = "cut" if cut else "no_cut"
            folder = Path(tmp) / leg
            folder.mkdir()
            decode_log = folder / "decoded.jsonl"
            group = ProcessGroup(folder)
            try:
                (engine,) = await group.start(
                    [
                        ServerSpec(
                            kind="policy",
                            name="policy",
                            settings={
                                "seed": seed,
                                "latency_ms": 0,
                                "error_rate": 0,
                                "token_latency_ms": 1000 / TOKENS_PER_S,
                                "reasoning_tokens": TOKENS,
                                "decode_log": str(decode_log),
                            },
                        )
                    ]
                )
                config = _config(folder / "run", f"{engine.url}/v1", cut=cut, seed=seed)
                await _killed_run(config, after_s, into_s)
                # The engine finishes the streams its dead callers left (it notices them
                # gone) before the rerun starts.
                await asyncio.sleep(0.5)
                await _finish(config)
            finally:
                await group.stop()
            decoded, used = _decoded(decode_log), _used(config.workdir)
            pauses = _pauses(config.workdir)
            figures[f"{leg}_tokens_decoded"] = decoded
            figures[f"{leg}_tokens_trained"] = used
            figures[f"{leg}_tokens_redone"] = decoded - used
            figures[f"{leg}_calls_continued"] = _continued(config.workdir)
            figures[f"{leg}_pause_p50_ms"] = percentile(pauses, 50) * 1e3
            figures[f"{leg}_pause_p99_ms"] = percentile(pauses, 99) * 1e3
            figures[f"{leg}_snapshots"] = len(pauses)
    redone_cut, redone = figures["cut_tokens_redone"], figures["no_cut_tokens_redone"]
    assert isinstance(redone_cut, int) and isinstance(redone, int)
    figures["redone_ratio_cut_over_no_cut"] = redone_cut / redone if redone else float("nan")
    p99_cut, p99 = figures["cut_pause_p99_ms"], figures["no_cut_pause_p99_ms"]
    assert isinstance(p99_cut, float) and isinstance(p99, float)
    figures["pause_p99_ratio_cut_over_no_cut"] = p99_cut / p99 if p99 else float("nan")
    return BenchResult(
        key="generation_cut",
        title="decode re-done after a crash: generation cut vs none",
        figures=figures,
        params={
            "generation": f"{TOKENS} reasoning tokens + a tool call, at {TOKENS_PER_S} tokens/s",
            "snapshot_every_s": SNAPSHOT_EVERY_S,
            "job": "workplace, 8 episodes (4 tasks x 2), 3 turns at most, 2 replicas",
            "kill": f"SIGKILL of every server {into_s:.2f}s after the first snapshot "
            f"published after {after_s:.1f}s (seed {seed}, the same in both legs)",
        },
    )
