"""examples/mcp.yaml as its user would run it, against the real ``mcp-server-sqlite`` from
PyPI: SIGKILLed mid-episode, rerun to the end, and checked from the server's own storage.
The kill comes once the resources servers' journals hold writes after the positions the
newest published snapshot recorded (read from the store's files), so the rerun has calls to
answer from the journal; a snapshot published between that check and the kill leaves none,
and then the rerun is killed again the same way (at most three kills).

Each call's SQL is bound by the spec (examples/mcp_sqlite.yaml): ``write_query`` inserts one
row holding the call's idempotency key, ``read_query`` counts the episode's rows. So the
SQLite file the server writes is a log of every call it applied. Each resources server
logs the exported state of every episode it verifies (``final_states_log``): the calls of
the episode with their keys, results, and whether the journal answered them after the
restore. Held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- every completed call happened once: a write the resources servers' journals held at
  the kill (read from a copy of the journal folders) has exactly one row in the server's
  file at the end (the restored episode's call was answered from the journal, not sent
  again); a key has two rows only when its call was in flight at the kill (not journaled;
  its first row is its episode's last row in the file as the kill left it), at most one
  per episode in flight at each kill; never three;
- nothing was lost: every row's key is a call of a trained episode, and every successful
  write of a trained episode has its row;
- every episode continued at its turn: each ``read_query`` result counts exactly the rows
  of the writes before it in its episode (a lost or repeated write would shift it), and
  episodes continued with calls from before the kill, some answered from the journal.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollpoint.envs import get_environment
from rollpoint.store.journal import Journal
from rollpoint.store.journal_format import HEADER, Damage, scan_frames, segment_number
from rollpoint.testing import invariants
from tests.support.crash_rerun import (
    CrashedRun,
    assert_episodes_continued,
    continued_from_before_the_kill,
    final_state_of,
    final_states,
    trained_once,
    write_example_config,
)
from tests.support.run_dir import published

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).parents[2] / "examples"
TASKS, GROUP_SIZE, CONCURRENCY, MAX_KILLS = 24, 2, 8, 3


def write_job(tmp_path: Path) -> Path:
    """The example's spec and config, the database and the run under ``tmp_path`` (the
    test's working directory: ``mcp:server.yaml`` is relative to it, as in the docs)."""
    spec: dict[str, Any] = yaml.safe_load((EXAMPLES / "mcp_sqlite.yaml").read_text())
    spec["server"]["command"] = ["mcp-server-sqlite", "--db-path", str(tmp_path / "notes.db")]
    (tmp_path / "server.yaml").write_text(yaml.safe_dump(spec))
    path = write_example_config(
        tmp_path,
        EXAMPLES / "mcp.yaml",
        environment="mcp:server.yaml",
        tasks=TASKS,
        group_size=GROUP_SIZE,
        concurrency=CONCURRENCY,
        # 150 ms a policy call, 6 tool calls an episode: an episode lives across 1 s
        # snapshots, and calls complete between them (the journal answers those).
        policy={"latency_ms": 150, "tool_turns": 6},
        snapshot={"every_seconds": 1},
        train={"batch_size": 4},
    )
    assert yaml.safe_load(path.read_text())["journal"] == {"enabled": True}
    return path


def rows(db: Path) -> list[tuple[str, str]]:
    """(key, rollout) of every row the server inserted, in insertion order."""
    with sqlite3.connect(db) as conn:
        return [(k, r) for k, r in conn.execute("SELECT key, rollout FROM calls ORDER BY rowid")]


def journaled_writes(store: Path, copy_to: Path) -> set[str]:
    """The idempotency keys of the ``write_query`` calls the resources servers' journals
    hold now (read from a copy: opening a journal starts a segment in its folder)."""
    shutil.copytree(store / "journal" / "resources", copy_to)
    keys: set[str] = set()

    async def read(folder: Path) -> None:
        journal = await asyncio.to_thread(Journal.open, str(folder))
        try:
            for record in journal.records_after():
                if record.kind == "tool_call" and record.value()["tool"] == "write_query":
                    _, rollout, _, turn, call = record.key.split("|")
                    keys.add(f"{rollout}/{turn[1:]}/{call[1:]}")
        finally:
            await journal.close()

    for folder in sorted(copy_to.iterdir()):
        asyncio.run(read(folder))
    return keys


def writes_after_newest(store: Path) -> int:
    """How many ``write_query`` calls the resources servers journaled after the positions the
    newest published snapshot recorded for them: the calls a restore from it answers from
    the journal (read from the segment files: nothing is opened for writing)."""
    fresh = sorted(published(store))
    if not fresh:
        return 0
    found = 0
    try:
        manifests = [
            orjson.loads(path.read_bytes())
            for path in (store / "snapshots" / fresh[-1] / "participants").glob("*/*/manifest.json")
        ]
        segments = {
            mark["folder"]: sorted((store / mark["folder"]).iterdir())
            for mark in (m.get("journal") for m in manifests)
            if mark is not None
        }
    except FileNotFoundError:  # retention removed that snapshot while it was read
        return 0
    for mark in (m["journal"] for m in manifests if m.get("journal") is not None):
        for segment in segments[mark["folder"]]:
            number = segment_number(segment.name)
            if number is None or number < mark["segment"]:
                continue
            try:
                data = segment.read_bytes()
            except FileNotFoundError:
                continue
            start = mark["offset"] if number == mark["segment"] else HEADER
            for frame in scan_frames(data, max(start, HEADER), len(data)):
                if isinstance(frame, Damage):
                    break
                if (
                    frame.kind == "tool_call"
                    and orjson.loads(frame.payload)["tool"] == "write_query"
                ):
                    found += 1
    return found


def servers_of(db: Path) -> list[int]:
    """The pids of mcp-server-sqlite processes serving ``db`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(db).encode() in cmdline and any(b"mcp-server-sqlite" in a for a in cmdline):
            found.append(int(entry.name))
    return found


def wait_servers_gone(db: Path, timeout_s: float = 30) -> None:
    """The stdio servers exit when their resources server's pipe closes: wait for it, so
    the file holds all they will ever write for the killed run."""
    deadline = time.monotonic() + timeout_s
    while servers_of(db):
        assert time.monotonic() < deadline, f"MCP servers outlived their run: {servers_of(db)}"
        time.sleep(0.05)


def test_sigkill_mid_episode_then_rerun_applies_every_completed_mcp_call_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_job(tmp_path)
    db = tmp_path / "notes.db"
    workdir = tmp_path / "run"
    store = workdir / invariants.SNAPSHOT_STORE_DIR
    in_flight_at_kills: set[str] = set()
    with CrashedRun(config, workdir) as crash:
        run = crash.start()
        crash.wait_for_depth(run, 2, most=5)
        for kills in range(1, MAX_KILLS + 1):
            # Calls completed after the newest snapshot, before the kill: the journal
            # answers them. A snapshot published between this check and the kill leaves
            # none after it: then the rerun is killed again, once it has some (the
            # invariants hold across any number of kills).
            run.wait_until(
                lambda: writes_after_newest(store) >= 3,
                "3 writes journaled after the newest snapshot",
            )
            crash.kill(run)
            wait_servers_gone(db)
            # Each episode's last row as this kill left it: the call it had in flight.
            in_flight_at_kills.update({rollout: key for key, rollout in rows(db)}.values())
            if writes_after_newest(store) > 0 or kills == MAX_KILLS:
                break
            run = crash.start()
        completed = journaled_writes(store, tmp_path / "journal-at-kill")
        reruns = crash.rerun_until_ok(timeout_s=240)
    wait_servers_gone(db)

    assert_episodes_continued(reruns[0])
    tasks = get_environment("mcp:server.yaml").make_tasks(TASKS, 0)
    rollouts = trained_once(workdir, tasks, GROUP_SIZE)

    states = final_states(tmp_path / "final")
    written = rows(db)
    per_key = Counter(key for key, _ in written)
    twice = {key for key, n in per_key.items() if n > 1}
    assert completed, "the journals held no write at the kill"
    assert not twice & completed, (
        f"calls completed (journaled) before the kill were applied again: {sorted(twice & completed)}"
    )
    assert all(per_key[key] == 2 for key in twice), {k: per_key[k] for k in twice}
    assert len(twice) <= CONCURRENCY * kills, f"{len(twice)} calls applied twice: {sorted(twice)}"
    assert twice <= in_flight_at_kills, (
        f"a call finished well before the kill was applied again: {sorted(twice)}"
    )

    calls_seen: set[str] = set()
    from_journal = continued = 0
    for r in rollouts:
        calls = final_state_of(states, r)["calls"]
        writes_before = 0
        for call in calls:
            assert not call["is_error"], f"{r.subject}: {call}"
            key = call["key"]
            assert key.startswith(f"{r.rollout_id}/")
            if call["tool"] == "write_query":
                calls_seen.add(key)
                assert per_key[key] >= 1, f"{r.subject}: write {key} is not in the server's file"
                if call["journal"]:
                    assert per_key[key] == 1, (
                        f"{r.subject}: {key} answered from the journal, yet sent again"
                    )
                writes_before += per_key[key]
            else:
                (answer,) = orjson.loads(call["result"].replace("'", '"'))
                assert answer["n"] == writes_before, (
                    f"{r.subject}: read {key} counted {answer['n']} rows, the episode had"
                    f" written {writes_before} before it"
                )
            from_journal += call["journal"]
        if continued_from_before_the_kill(r) and calls:
            continued += 1
    # Nothing was lost or made by a call no trained episode holds.
    assert set(per_key) == calls_seen, set(per_key) ^ calls_seen
    record_property("calls_from_journal", from_journal)
    record_property("calls_applied_twice", len(twice))
    print(
        f"mcp: {len(written)} rows, {len(per_key)} write calls, {continued} continued episodes,"
        f" {from_journal} calls answered from the journal, {len(twice)} in flight at the kill"
        " and sent again"
    )
    assert continued > 0, "no episode continued with calls from before the kill"
    assert from_journal > 0, "no call was answered from the journal"
