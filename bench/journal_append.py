"""Journal appends of ~1k-token policy calls: throughput, latency, fsyncs; against DBOS's step table.

Each record is what the model server would journal for one finished policy call: the
assistant message (~4,000 characters of text, about 1k tokens) and its
:class:`~rollpoint.protocol.token_data.TokenTrace` (1,000 completion ids with their
logprobs and a 200-id prompt suffix, packed), encoded with orjson by the appender, keyed by
``model|<rollout>|a0|t<turn>|c0``. Stored tokens per record: 1,200 (completion + prompt suffix).

For 1, 100 and 10,000 concurrent appenders (asyncio tasks, each appending its records one
after the other, as an episode's calls come), on one :class:`~rollpoint.store.journal.Journal`
with its default window: records/s, bytes per stored token, fsyncs/s, records per fsync,
p50/p99 latency of one ``await append`` (encode, queue, group commit, fsync). The floor is
the disk itself: ``raw_fsync_p50_ms`` is one record written and fsynced by a plain loop (in
rounds alternated with the single appender's, the disk being shared), and
``c1_p50_over_raw_fsync`` the ratio of the journal's single-appender latency to it. The
journal's own fsyncs are timed too (``c*_fsync_p50_ms``, through its fsync seam), and
``c1_p50_over_own_fsync`` is what an append costs over the fsync it waits for.

Side by side, the same per-call journaling as a user would write it with DBOS on SQLite
(``dbos``, the ``bench-peers`` extra): a workflow per episode, one ``@DBOS.step`` per call
returning the same record, so DBOS checkpoints each result in its step table before the
workflow goes on (SQLite's defaults there: rollback journal, ``synchronous=FULL``: each step
is durable, as ours). 1 and 100 concurrent workflows; 10,000 are left out (SQLite takes one
writer at a time: it would run for many minutes). ``dbos_over_journal_c*`` is DBOS's cost
per step over ours per record at the same concurrency. Without the extra installed, the
DBOS figures say so and the journal's are still measured.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.report import BenchResult
from rollpoint.protocol.token_data import TokenTrace
from rollpoint.store.journal import Journal

COMPLETION_TOKENS = 1000
PROMPT_SUFFIX = 200
STORED_TOKENS = COMPLETION_TOKENS + PROMPT_SUFFIX
ROUNDS = 5
"""The single appender and the raw disk take turns this many times."""


def _record(rng: random.Random) -> dict[str, Any]:
    """One finished policy call as the model server keeps it, with token data."""
    words = ["sched", "ule", " the", " meeting", " for", " Tuesday", " at", " 10", ":00", "."]
    text = "".join(rng.choice(words) for _ in range(COMPLETION_TOKENS))[:4000]
    trace = TokenTrace.build(
        engine="vllm",
        completion_ids=[rng.randrange(150_000) for _ in range(COMPLETION_TOKENS)],
        completion_logprobs=[-rng.random() * 4 for _ in range(COMPLETION_TOKENS)],
        prompt_ids=[rng.randrange(150_000) for _ in range(PROMPT_SUFFIX)],
        context=None,
    )
    return {
        "response": {"role": "assistant", "content": text},
        "finish_reason": "stop",
        "policy_version": 3,
        "tokens": trace.model_dump(),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Runs:
    """Latencies and totals of one concurrency's runs, summed over rounds."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.wall = 0.0
        self.records = 0
        self.bytes = 0
        self.fsyncs = 0
        self.fsync_times: list[float] = []
        """How long each of the journal's own fsyncs took (timed through its seam)."""

    def fsync(self, fd: int) -> None:
        t0 = time.perf_counter()
        os.fsync(fd)
        self.fsync_times.append(time.perf_counter() - t0)

    def figures(self) -> dict[str, float]:
        return {
            "records_per_s": self.records / self.wall,
            "bytes_per_token": self.bytes / (self.records * STORED_TOKENS),
            "bytes_per_record": self.bytes / self.records,
            "fsyncs_per_s": self.fsyncs / self.wall,
            "records_per_fsync": self.records / self.fsyncs,
            "p50_ms": _percentile(self.latencies, 0.50) * 1e3,
            "p99_ms": _percentile(self.latencies, 0.99) * 1e3,
            "ms_per_record": self.wall / self.records * 1e3,
            "fsync_p50_ms": _percentile(self.fsync_times, 0.50) * 1e3,
        }


async def _journal(
    folder: Path, concurrency: int, each: int, record: dict[str, Any], into: _Runs
) -> None:
    journal = await asyncio.to_thread(partial(Journal.open, str(folder), fsync=into.fsync))

    async def appender(rollout: int) -> None:
        for turn in range(each):
            t0 = time.perf_counter()
            await journal.append_json(f"model|r{rollout:06d}|a0|t{turn}|c0", "policy_call", record)
            into.latencies.append(time.perf_counter() - t0)

    fsyncs_before = journal.metrics.fsyncs
    t0 = time.perf_counter()
    await asyncio.gather(*(appender(r) for r in range(concurrency)))
    into.wall += time.perf_counter() - t0
    m = journal.metrics
    await journal.close()
    into.fsyncs += m.fsyncs - fsyncs_before
    into.records += m.records
    into.bytes += m.bytes


def _raw_fsync(folder: Path, data: bytes, n: int) -> list[float]:
    """``n`` times one write + fsync of ``data`` appended to a plain file: the disk's floor."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "raw", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, data)
            os.fsync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return times


async def _dbos(
    folder: Path, runs: list[tuple[int, int]], record: dict[str, Any]
) -> dict[str, float]:
    from dbos import DBOS  # the bench-peers extra

    await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
    DBOS(
        config={
            "name": "journal-bench",
            "system_database_url": f"sqlite:///{folder}/dbos.sqlite",
            "run_admin_server": False,
            "log_level": "WARNING",
        }
    )
    latencies: list[float] = []

    @DBOS.step()
    async def policy_call(rollout: int, turn: int) -> dict[str, Any]:
        return record

    @DBOS.workflow()
    async def episode(rollout: int, turns: int) -> int:
        for turn in range(turns):
            t0 = time.perf_counter()
            await policy_call(rollout, turn)
            latencies.append(time.perf_counter() - t0)
        return turns

    figures: dict[str, float] = {}
    DBOS.launch()
    try:
        for concurrency, each in runs:
            latencies.clear()
            t0 = time.perf_counter()
            await asyncio.gather(*(episode(r, each) for r in range(concurrency)))
            wall = time.perf_counter() - t0
            steps = concurrency * each
            figures |= {
                f"dbos_c{concurrency}_steps_per_s": steps / wall,
                f"dbos_c{concurrency}_ms_per_step": wall / steps * 1e3,
                f"dbos_c{concurrency}_p50_ms": _percentile(latencies, 0.50) * 1e3,
                f"dbos_c{concurrency}_p99_ms": _percentile(latencies, 0.99) * 1e3,
            }
        db_bytes = await asyncio.to_thread(os.path.getsize, folder / "dbos.sqlite")
        figures["dbos_bytes_per_token"] = db_bytes / (sum(c * e for c, e in runs) * STORED_TOKENS)
    finally:
        DBOS.destroy()
    return figures


async def run(quick: bool = False) -> BenchResult:
    rng = random.Random(35)
    record = _record(rng)
    encoded = orjson.dumps(record)
    runs = [(1, 50), (100, 5), (10_000, 1)] if quick else [(1, 300), (100, 30), (10_000, 3)]
    dbos_runs = [(1, 20), (100, 2)] if quick else [(1, 100), (100, 5)]
    figures: dict[str, float | int | str] = {"record_bytes": len(encoded)}
    with tempfile.TemporaryDirectory(dir=os.environ.get("ROLLPOINT_BENCH_DIR")) as tmp:
        root = Path(tmp)
        # One appender against the raw disk, alternated in rounds: the disk is shared, and
        # its fsync latency moves with other work (a few ms to tens of ms).
        raw: list[float] = []
        for concurrency, each in runs:
            measured = _Runs()
            rounds = ROUNDS if concurrency == 1 else 1
            for i in range(rounds):
                if concurrency == 1:
                    raw += await asyncio.to_thread(
                        _raw_fsync, root / "raw", encoded, each // rounds
                    )
                folder = root / f"journal-c{concurrency}-{i}"
                await _journal(folder, concurrency, each // rounds, record, measured)
            figures |= {
                f"c{concurrency}_{name}": value for name, value in measured.figures().items()
            }
        figures["raw_fsync_p50_ms"] = statistics.median(raw) * 1e3
        figures["c1_p50_over_raw_fsync"] = float(figures["c1_p50_ms"]) / float(
            figures["raw_fsync_p50_ms"]
        )
        # What an append costs beyond the fsync it waits for: encoding, queueing, the thread hop.
        figures["c1_p50_over_own_fsync"] = float(figures["c1_p50_ms"]) / float(
            figures["c1_fsync_p50_ms"]
        )
        # What the format adds to the encoded record: frame, key, kind.
        figures["frame_bytes_per_record"] = float(figures["c1_bytes_per_record"]) - len(encoded)
        try:
            import dbos  # noqa: F401
        except ImportError:
            figures["dbos"] = "not installed: pip install -e '.[bench-peers]'"
        else:
            figures |= await _dbos(root / "dbos", dbos_runs, record)
            for concurrency, _ in dbos_runs:
                figures[f"dbos_over_journal_c{concurrency}"] = float(
                    figures[f"dbos_c{concurrency}_ms_per_step"]
                ) / float(figures[f"c{concurrency}_ms_per_record"])
    return BenchResult(
        key="journal_append",
        title="journal appends of 1k-token policy calls, against DBOS steps on SQLite",
        figures=figures,
        params={
            "record": f"{COMPLETION_TOKENS} completion ids + logprobs, {PROMPT_SUFFIX} prompt ids, ~4 KB text",
            "runs": ", ".join(f"{c} appenders x {e}" for c, e in runs),
            "dbos_runs": ", ".join(f"{c} workflows x {e} steps" for c, e in dbos_runs),
            "window_s": 0.002,
        },
    )
