"""Snapshot bytes written per second against the disk's own sequential write speed, and
restore (read + verify + decode) time against snapshot size, measured in one run.

The disk figure is a plain sequential write of the same number of bytes in 8 MiB blocks
with one fsync at the end — the physical limit a snapshot writer can approach. The
snapshot figure is :func:`write_participant_state` on the records real agent sessions
export (three turns each; :meth:`Session.export_json`, as the agent's state image hands
them to a write), fsync included, so the ratio is rollpoint's serialisation + hashing +
write path against the raw disk. The sessions' first export (where each transcript is
encoded, once in its life) is reported apart as ``first_export_s``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import BenchResult
from rollpoint.protocol.episode import ModelCall, RunRow, TaskRow
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.session import Session
from rollpoint.store.participant_state import read_participant_state, write_participant_state
from rollpoint.tuning.collector_pause import collector_paused

_BLOCK = 8 << 20
INSTANCE = "agent-replica-0"
REPEATS = 2


def _sessions(n: int) -> list[Session]:
    """``n`` sessions three turns in, played the way the episode runner plays them."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "calendar_create_event",
                    "arguments": '{"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}',
                },
            }
        ],
    }
    tool = {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": '{"status": "created", "event": {"id": 1}}',
    }
    task = TaskRow(task_id="t0", environment="workplace", prompt="Schedule these events…" * 4)
    sessions = []
    for i in range(n):
        episode = EpisodeId(rollout_id=f"r{i:015x}", attempt=0)
        session = Session(RunRow(task=task, group_id=f"g{i // 4}", row=i % 4, episode=episode))
        for turn in range(3):
            message = dict(assistant)
            session.add_model_call(ModelCall(turn=turn, attempt=0, response=message))
            session.add_message(message)
            session.turn += 1
            session.add_message(dict(tool))
        sessions.append(session)
    return sessions


def _disk_write(path: Path, size: int) -> float:
    block = os.urandom(_BLOCK)
    t0 = time.perf_counter()
    with path.open("wb") as out:
        left = size
        while left > 0:
            out.write(block[: min(left, _BLOCK)])
            left -= _BLOCK
        out.flush()
        os.fsync(out.fileno())
    return time.perf_counter() - t0


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def _measure(tmp: Path, n: int, repeats: int) -> dict[str, float]:
    sessions = _sessions(n)
    # What the agent's state image hands a write: each session's export, made between
    # checkpoints (its transcript encoded once in the session's life, not once per write).
    t0 = time.perf_counter()
    records = [session.export_json() for session in sessions]
    first_export_s = time.perf_counter() - t0
    manifest = None
    folders: list[Path] = []

    def write() -> float:
        nonlocal manifest
        folder = tmp / f"s{n}-{len(folders)}"
        folders.append(folder)
        t0 = time.perf_counter()
        manifest = write_participant_state(
            str(folder),
            kind="agent",
            instance=INSTANCE,
            checkpoint_id=f"bench-{n}",
            records=records,
        )
        return time.perf_counter() - t0

    # Alternated, best of each: the two see the same disk and the same neighbours.
    write_s = disk_s = float("inf")
    for _ in range(repeats):
        write_s = min(write_s, write())
        assert manifest is not None
        disk_s = min(disk_s, _disk_write(tmp / f"raw{n}", manifest.bytes))
        (tmp / f"raw{n}").unlink()
    assert manifest is not None
    folder = folders[-1]

    def restore() -> float:
        t0 = time.perf_counter()
        with collector_paused():  # as the fence's restore reads it
            _, back = read_participant_state(
                str(folder), kind="agent", instance=INSTANCE, checkpoint_id=f"bench-{n}"
            )
        took = time.perf_counter() - t0
        assert len(back) == n
        return took

    read_s = _best(restore, repeats)
    mib = manifest.bytes / (1 << 20)
    return {
        f"n{n}_mib": mib,
        f"n{n}_first_export_s": first_export_s,
        f"n{n}_snapshot_write_mib_per_s": mib / write_s,
        f"n{n}_disk_write_mib_per_s": mib / disk_s,
        f"n{n}_write_ratio_to_disk": disk_s / write_s,
        f"n{n}_restore_read_verify_s": read_s,
        f"n{n}_restore_mib_per_s": mib / read_s,
        f"n{n}_restore_s_per_gib": read_s / (manifest.bytes / (1 << 30)),
    }


def run(sizes: tuple[int, ...] = (10_000, 100_000), repeats: int = REPEATS) -> BenchResult:
    figures: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("ROLLPOINT_BENCH_DIR")) as tmp:
        for n in sizes:
            figures |= _measure(Path(tmp), n, repeats)
            for folder in Path(tmp).iterdir():
                shutil.rmtree(folder)
    return BenchResult(
        key="snapshot_io",
        title="snapshot write speed vs raw disk, restore time vs size",
        figures=figures,
        params={
            "records": ", ".join(str(n) for n in sizes),
            "record": "one agent session's export, 3 turns",
            "timing": f"wall time, best of {repeats}, snapshot and raw writes alternated",
            "restore": "read + sha256 + count + decode, page cache warm (just written)",
        },
    )
