"""Ledger look-ups and a snapshot's trainer-side work against finished rollouts in the run.

The in-flight count is fixed (1,000 rows over 2 replicas); only the number of finished
rollouts grows (10k, 100k, 1M). Every finished rollout goes the way a real one does,
through the public API: its group is added to the ledger and the finished queue, each row is dispatched,
finished and sealed in the ledger, put in the finished queue, taken for a train step and committed. One
prompt group per task, as the trainer builds them.

Measured in CPU time of the measuring thread, each as the best of a few repeats:

- look-ups: ``get`` (a finished rollout, an in-flight one), ``current(group, row)``;
- what :meth:`CutCalls.commit_all` does on the trainer while the barrier is
  closed (``capture``): ``in_flight`` of every replica, ``ledger.capture()``,
  ``finished_queue.capture()`` — references to immutable chunks and the live tries that moved;
- what the publish does after it reopens, from a worker thread (it holds the GIL, so the
  trainer's event loop runs slower meanwhile): writing both captures as records into
  shared records files with the index of the previous write, as a snapshot does, the first
  time after the run grew (``write_first``: every chunk filled since is encoded and
  written once) and again (``write``: full chunks are the same records, referenced), with
  the bytes each wrote; and encoding them as one JSON document (``encode_first``,
  ``encode``: how snapshots wrote them before session 13, and the size of the document);
- the capture again with ``queued`` more rows queued ahead and never started
  (``queued_capture``), at the largest size only: rows nothing has happened to are
  implied by their group, so they must not show either;
- restoring the ledger from its encoded document (``orjson.loads`` + ``from_document``),
  once: this one grows with the run by nature, it is here to be seen.

The ratio of each at the largest run to the smallest says whether it grows; ≈ 1 is the
target for everything inside the pause.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from bench.report import BenchResult
from rollpoint.envs import get_environment
from rollpoint.protocol.episode import RunReply, TaskRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.store.filesystem import LocalFilesystem
from rollpoint.store.record_packs import PackIndex, pack_records
from rollpoint.trainer.state.finished_queue import FinishedQueue, FinishedQueueCapture
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.state.ledger_document import LedgerCapture

GROUP_SIZE = 4
IN_FLIGHT = 1000
REPLICAS = ("replica-0", "replica-1")
LOOKUPS = 20_000
REPEATS = 3
QUEUED = 200_000


def _template() -> TaskRow:
    """A real workplace task: every task of the run has its size."""
    return get_environment("workplace").make_tasks(1, 0)[0]


class Run:
    """A ledger and the finished queue with ``IN_FLIGHT`` dispatched rollouts; :meth:`finish` adds finished ones."""

    def __init__(self) -> None:
        self.ledger = RecoveryLedger()
        self.finished_queue = FinishedQueue()
        self.finished_ids: list[str] = []
        self.in_flight_ids: list[str] = []
        self.groups: list[str] = []
        self._template = _template()
        self._step = 0
        self.indexes = {"ledger": PackIndex(), "tq": PackIndex()}
        """Where each file's previous write put its records, as the coordinator keeps them."""
        for _ in range(IN_FLIGHT // GROUP_SIZE):
            _, rollout_ids = self._add()
            replica = REPLICAS[len(self.groups) % len(REPLICAS)]
            for rid in rollout_ids:
                self.ledger.dispatch(rid, replica)
            self.in_flight_ids += rollout_ids

    def finish(self, rollouts: int) -> None:
        """Play ``rollouts`` more rollouts to the end: sealed, trained on, committed."""
        for _ in range(rollouts // GROUP_SIZE):
            gid, rollout_ids = self._add()
            replica = REPLICAS[len(self.groups) % len(REPLICAS)]
            for row, rid in enumerate(rollout_ids):
                self.ledger.dispatch(rid, replica)
                self.ledger.finish(rid)
                record = self.ledger.seal(rid)
                self.finished_queue.put(_reply(record.rollout_id, record.task_id, gid, row))
            self._step += 1
            self.finished_queue.take_groups(GROUP_SIZE, train_step=self._step)
            self.finished_queue.commit(self._step)
            self.finished_ids += rollout_ids

    def queue(self, rows: int) -> None:
        """Add groups for ``rows`` more rows, queued and never started."""
        for _ in range(rows // GROUP_SIZE):
            self._add()

    def _add(self) -> tuple[str, list[str]]:
        task = self._template.model_copy(update={"task_id": f"task-{len(self.groups):07d}"})
        gid = f"{task.task_id}-g0"
        records = self.ledger.add_group(task, gid, GROUP_SIZE)
        self.finished_queue.expect_group(gid, GROUP_SIZE)
        self.groups.append(gid)
        return gid, [r.rollout_id for r in records]

    def capture(self) -> tuple[LedgerCapture, FinishedQueueCapture]:
        """What the coordinator takes on the trainer while the barrier is closed."""
        for replica in REPLICAS:
            self.ledger.in_flight(replica)
        return self.ledger.capture(), self.finished_queue.capture()


def _reply(rollout_id: str, task_id: str, group_id: str, row: int) -> RunReply:
    # Built without validation: a million replies would otherwise dominate the set-up.
    return RunReply.model_construct(
        kind="finished",
        episode=EpisodeId(rollout_id=rollout_id, attempt=0),
        task_id=task_id,
        group_id=group_id,
        row=row,
        reward=1.0,
        messages=[],
        model_calls=[],
        turns=1,
        finish_reason="final",
    )


def _write(capture: LedgerCapture | FinishedQueueCapture, index: PackIndex, folder: str) -> int:
    """Write ``capture`` as a snapshot does (its records, packed against ``index``);
    return the bytes written."""
    packed = pack_records(LocalFilesystem(), folder, capture.as_records(), index, shared=True)
    index.replace(packed.index)
    return packed.written


def _best(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """CPU seconds of the fastest of ``repeats`` calls.

    CPU time of this thread, not wall time: the suite shares its cores with the servers of
    other items (and CI neighbours), which would otherwise show up as growth.
    """
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def _per_op_us(fn: Callable[[Any], object], args: Sequence[Any]) -> float:
    def loop() -> None:
        for a in args:
            fn(a)

    return _best(loop) / len(args) * 1e6


def measure(run: Run, folder: str) -> dict[str, float | int]:
    rng = random.Random(0)
    ledger = run.ledger
    done = rng.choices(run.finished_ids, k=LOOKUPS)
    live = rng.choices(run.in_flight_ids, k=LOOKUPS)
    rows = [(rng.choice(run.groups), rng.randrange(GROUP_SIZE)) for _ in range(LOOKUPS)]
    ledger_capture, tq_capture = run.capture()
    written: dict[str, int] = {}

    def write(name: str, capture: LedgerCapture | FinishedQueueCapture) -> None:
        written[name] = _write(capture, run.indexes[name], folder)

    write_first = _best(lambda: write("ledger", ledger_capture), repeats=1)
    written_first = written["ledger"]
    write_again = _best(lambda: write("ledger", ledger_capture))
    tq_write = _best(lambda: write("tq", tq_capture))
    encode_first = _best(ledger_capture.to_bytes, repeats=1)
    encoded = ledger_capture.to_bytes()
    return {
        "get_finished_us": _per_op_us(ledger.get, done),
        "get_in_flight_us": _per_op_us(ledger.get, live),
        "current_us": _per_op_us(lambda gr: ledger.current(*gr), rows),
        "in_flight_replica_ms": _best(lambda: ledger.in_flight(REPLICAS[0])) * 1e3,
        "ledger_capture_ms": _best(ledger.capture) * 1e3,
        "tq_capture_ms": _best(run.finished_queue.capture) * 1e3,
        "capture_ms": _best(run.capture) * 1e3,
        "ledger_write_first_ms": write_first * 1e3,
        "ledger_write_ms": write_again * 1e3,
        "ledger_written_first_mb": written_first / 1e6,
        "ledger_written_mb": written["ledger"] / 1e6,
        "tq_write_ms": tq_write * 1e3,
        "ledger_encode_first_ms": encode_first * 1e3,
        "ledger_encode_ms": _best(ledger_capture.to_bytes) * 1e3,
        "tq_encode_ms": _best(tq_capture.to_bytes) * 1e3,
        "ledger_mb": len(encoded) / 1e6,
        "tq_kb": len(tq_capture.to_bytes()) / 1e3,
        "ledger_doc_tasks": len(orjson.loads(encoded)["tasks"]),
        "ledger_restore_s": _best(lambda: RecoveryLedger.from_document(orjson.loads(encoded)), 1),
    }


def _measure_all(sizes: Sequence[int], queued: int) -> dict[int, dict[str, float | int]]:
    """One run grown to each size in turn (sizes ascending), measured at each; then the
    largest again with ``queued`` rows queued ahead."""
    run = Run()
    out: dict[int, dict[str, float | int]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for size in sorted(sizes):
            t0 = time.thread_time()
            run.finish(size - len(run.finished_ids))
            grow_s = time.thread_time() - t0
            out[size] = measure(run, folder) | {"grow_s": grow_s}
    run.queue(queued)
    out[max(sizes)]["queued_capture_ms"] = _best(run.capture) * 1e3
    return out


RATIO_KEYS = (
    "get_finished_us",
    "get_in_flight_us",
    "current_us",
    "in_flight_replica_ms",
    "ledger_capture_ms",
    "tq_capture_ms",
    "capture_ms",
    "ledger_write_ms",
    "ledger_encode_ms",
)


async def run(
    sizes: Sequence[int] = (10_000, 100_000, 1_000_000), *, queued: int = QUEUED
) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    # CPU-bound and synchronous: a worker thread keeps the suite's event loop free.
    by_size = await asyncio.to_thread(_measure_all, sizes, queued)
    for size, values in by_size.items():
        figures |= {f"f{_label(size)}_{k}": v for k, v in values.items()}
    lo, hi = min(sizes), max(sizes)
    figures[f"ratio_capture_ms_queued_vs_not_f{_label(hi)}"] = (
        by_size[hi]["queued_capture_ms"] / by_size[hi]["capture_ms"]
    )
    for key in RATIO_KEYS:
        small = by_size[lo][key]
        if small:
            figures[f"ratio_{key}_f{_label(hi)}_vs_f{_label(lo)}"] = by_size[hi][key] / small
    return BenchResult(
        key="ledger_scaling",
        title="ledger look-ups and the snapshot's trainer-side work vs finished rollouts",
        figures=figures,
        params={
            "finished": "/".join(_label(s) for s in sizes),
            "in_flight": IN_FLIGHT,
            "queued_ahead": f"{queued:,} rows, at {_label(max(sizes))} only",
            "group_size": GROUP_SIZE,
            "replicas": len(REPLICAS),
            "timing": f"thread CPU time, best of {REPEATS}",
        },
    )


def _label(size: int) -> str:
    return f"{size // 1_000_000}M" if size % 1_000_000 == 0 else f"{size // 1000}k"
