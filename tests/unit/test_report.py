"""The report read from hand-made workdirs: what each part of the page shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.report import read_run, render_page, run_record, write_report
from rollpoint.trainer.run_events import (
    EVENTS_FILE,
    InFlight,
    Restore,
    RunEnd,
    RunEvents,
    RunStart,
    TrainStep,
)


def _snapshot_line(sid: str, ts: float, outcome: str = "published", **kw: Any) -> bytes:
    doc = {
        "ts": ts,
        "event": "snapshot",
        "snapshot_id": sid,
        "outcome": outcome,
        "pause_seconds": kw.get("pause", 0.05),
        "prepare_seconds": 0.02,
        "commit_seconds": 0.01,
        "write_seconds": kw.get("write", 0.0),
        "parked_sessions": kw.get("parked", 10),
        "restarts": 0,
        "detail": kw.get("detail", ""),
    }
    return orjson.dumps(doc) + b"\n"


def _start(ts: float, resume_from: str | None = None) -> RunStart:
    return RunStart(
        ts=ts,
        pid=1,
        runtime="embedded",
        replicas=["replica-0", "replica-1"],
        resume_from=resume_from,
        config={"workdir": "w", "snapshot": {"store": None}, "policy": {"api_key": None}},
    )


def test_a_workdir_without_snapshots_gets_a_page_that_says_so(tmp_path: Path) -> None:
    RunEvents(tmp_path / EVENTS_FILE).append(_start(100.0))
    page = render_page(read_run(tmp_path))
    assert 'id="no-snapshots"' in page
    assert "no snapshots yet" in page
    assert "<svg" not in page.split("Episodes in flight")[0]
    assert "crashed or still running" in page


def test_failed_snapshots_show_their_reason_in_the_table_and_on_hover(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(
        _snapshot_line("snap-1-0001", 101.0)
        + _snapshot_line("snap-2-0002", 102.0, "failed", detail="agent@replica-1 <not ready>")
        + b'{"ts": 103.0, "event": "snap'  # a torn last line of a killed run
    )
    page = render_page(read_run(tmp_path))
    # The failed mark carries its id and its reason, escaped, as the browser's hover text.
    title = re.search(r'<g id="snap-2-0002"><title>([^<]*)</title>', page)
    assert title is not None
    assert "failed" in title.group(1)
    assert "agent@replica-1 &lt;not ready&gt;" in title.group(1)
    assert re.search(r'<g id="snap-1-0001"><title>[^<]*published', page)
    # The table lists failed attempts first, with why.
    rows = page.split("Snapshot attempts")[1]
    assert rows.index("snap-2-0002") < rows.index("snap-1-0001")
    assert "agent@replica-1 &lt;not ready&gt;" in rows
    assert "<not ready>" not in page


def test_histogram_names_p50_and_p99(tmp_path: Path) -> None:
    lines = b"".join(
        _snapshot_line(f"snap-{i}-{i:04d}", 100.0 + i, pause=i / 1000) for i in range(1, 101)
    )
    (tmp_path / "metrics.jsonl").write_bytes(lines)
    page = render_page(read_run(tmp_path))
    histogram = page.split('id="pause-histogram"')[1].split("</svg>")[0]
    assert "p50 50.5 ms" in histogram
    assert "p99 99.0 ms" in histogram


def test_a_restore_shows_its_outcome_and_the_calls_the_crash_lost(tmp_path: Path) -> None:
    # The snapshot's pause ended at 104.0 (its line at 104.5 after 0.5 s of writes).
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 104.5, write=0.5))
    events = RunEvents(tmp_path / EVENTS_FILE)
    events.append(_start(100.0))
    for ts, calls in [
        (103.0, {"replica-0": 50, "replica-1": 40}),
        (105.0, {"replica-0": 70, "replica-1": 45}),
        # replica-1 restarted: its counter began again at 0
        (106.0, {"replica-0": 80, "replica-1": 3}),
    ]:
        events.append(
            InFlight(ts=ts, episodes={"replica-0": 4, "replica-1": 4}, policy_calls=calls)
        )
    events.append(_start(110.0, resume_from="snap-1-0001"))
    events.append(
        Restore(
            ts=111.0,
            snapshot_id="snap-1-0001",
            train_step=2,
            continued=6,
            restarted=1,
            adopted=2,
            requeued=3,
            turns_kept=17,
        )
    )
    events.append(InFlight(ts=112.0, episodes={"replica-0": 2}, policy_calls={"replica-0": 9}))
    events.append(TrainStep(ts=113.0, step=3, rollouts=4, groups=2))
    events.append(RunEnd(ts=114.0, episodes=8, train_steps=3, failed_groups=0, elapsed_s=4.0))
    record = read_run(tmp_path)
    assert record.state == "finished"
    assert [s.end is None for s in record.segments] == [True, False]
    (restore,) = record.restores
    # after the cut: replica-0 50 -> 70 -> 80 (30), replica-1 40 -> 45 then 3 after a reset (8)
    assert restore.calls_redone == 38
    page = render_page(record)
    restores = page.split("<h2>Restores</h2>")[1].split("</table>")[0]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", restores)
    assert cells[1:] == ["snap-1-0001", "2", "6", "1", "2", "3", "17", "&mdash;", "&ge; 38"]
    assert "<h2>Journals</h2>" not in page  # the run did not journal
    assert "restore snap-1-0001" in page.split('id="timeline"')[1]
    assert 'id="in-flight"' in page


def test_a_graceful_stop_is_drawn_as_a_preemption_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0002", 104.5))
    events = RunEvents(tmp_path / EVENTS_FILE)
    events.append(_start(100.0))
    events.append(TrainStep(ts=101.0, step=1, rollouts=4, groups=2))
    events.preemption("SIGTERM", snapshot_id="snap-1-0002", detail="stopped by SIGTERM")
    record = read_run(tmp_path)
    assert record.state.startswith("stopped by SIGTERM (snapshot snap-1-0002 holds it")
    events.append(_start(record.preemptions[0].ts + 1, resume_from="snap-1-0002"))
    record = read_run(tmp_path)
    assert record.stopped_by(0) is not None and record.stopped_by(1) is None
    timeline = render_page(record).split('id="timeline"')[1]
    assert "preempted (SIGTERM)" in timeline and "last sign of life" not in timeline


def test_write_report_writes_the_page_whole(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 101.0))
    target = write_report(read_run(tmp_path))
    assert target == tmp_path / "report.html"
    assert target.read_text().endswith("</html>\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_chaos_trials_faults_are_marked_on_the_timeline(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 101.0))
    (tmp_path / "events.jsonl").write_bytes(
        b'{"run":0,"event":"up","ts":100.0}\n'
        b'{"run":0,"event":"fault","ts":102.0,"kind":"replica_kill",'
        b'"detail":"replica_kill of replica-0 (resources) at 1.21s of run 0"}\n'
    )
    page = render_page(read_run(tmp_path))
    assert "replica_kill" in page.split('id="timeline"')[1].split("</svg>")[0]
    assert "replica_kill of replica-0 (resources)" in page.split("faults</h2>")[1]


def test_the_command_writes_the_page_and_a_missing_workdir_is_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rollpoint.app.cli import app

    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 101.0))
    out = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["report", str(tmp_path), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = orjson.loads(result.stdout)
    assert doc == {
        "report": str(out),
        "state": "unknown (no run_events.jsonl)",
        "snapshots": 1,
        "restores": 0,
        "runs": 0,
    }
    assert "snap-1-0001" in out.read_text()
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert "does not exist" in missing.output
    assert "Traceback" not in missing.output


def test_a_published_snapshot_missing_from_metrics_is_still_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run killed right after a publish never wrote that snapshot's metrics line.
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 101.0))
    store = {
        "snapshots": [
            {"id": "snap-2-0002", "published_at": 102.0, "train_step": 1},
            {"id": "snap-1-0001", "published_at": 101.0, "train_step": 1},
        ],
        "invalid": [],
        "latest": None,
    }
    for entry in store["snapshots"]:
        entry |= {"pause_seconds": 0.04, "episodes": 3, "restarts": 1}
    monkeypatch.setattr(run_record, "build_report", lambda root, workdir: store)
    record = read_run(tmp_path)
    assert [s.snapshot_id for s in record.snapshots] == ["snap-1-0001", "snap-2-0002"]
    added = record.snapshots[1]
    assert (added.published, added.pause_s, added.in_flight) == (True, 0.04, 4)
    page = render_page(record)
    assert re.search(r'<g id="snap-2-0002"><title>[^<]*never written', page)


def test_a_restored_snapshot_gone_from_metrics_and_store_is_drawn_from_the_restore(
    tmp_path: Path,
) -> None:
    # Killed before its metrics line, then pruned from the store by the rerun's retention.
    events = RunEvents(tmp_path / EVENTS_FILE)
    events.append(_start(100.0))
    events.append(InFlight(ts=101.0, episodes={"replica-0": 3}, policy_calls={"replica-0": 10}))
    events.append(InFlight(ts=102.0, episodes={"replica-0": 3}, policy_calls={"replica-0": 25}))
    events.append(_start(105.0, resume_from="snap-9-0009"))
    events.append(
        Restore(
            ts=106.0,
            snapshot_id="snap-9-0009",
            train_step=1,
            continued=3,
            restarted=0,
            adopted=0,
            requeued=0,
            turns_kept=5,
            snapshot_pause_ended_at=101.5,
            snapshot_pause_s=0.03,
        )
    )
    record = read_run(tmp_path)
    (snap,) = record.snapshots
    assert (snap.snapshot_id, snap.cut_ts, snap.pause_s) == ("snap-9-0009", 101.5, 0.03)
    assert record.restores[0].calls_redone == 15
    assert re.search(r'<g id="snap-9-0009"><title>', render_page(record))


def test_each_journal_shows_its_size_the_kept_marks_and_what_the_last_restore_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(_snapshot_line("snap-1-0001", 101.0))
    events = RunEvents(tmp_path / EVENTS_FILE)
    events.append(_start(100.0))
    read = {"agent/agent-replica-0": 12, "model/model-replica-0": 3}
    for ts, turns in [(103.0, {"agent/agent-replica-0": 9}), (107.0, {"agent/agent-replica-0": 4})]:
        events.append(_start(ts - 1, resume_from="snap-1-0001"))
        events.append(
            Restore(
                ts=ts,
                snapshot_id="snap-1-0001",
                train_step=0,
                continued=2,
                restarted=0,
                adopted=0,
                requeued=0,
                turns_kept=3,
                journal_turns=turns,
                journal_replies={"agent/agent-replica-0": 1},
                journal_read_ms=read if ts > 105 else None,
            )
        )
    journals = [
        {
            "kind": "agent",
            "instance": "agent-replica-0",
            "records": 41,
            "bytes": 52_311,
            "segments": 2,
            "last_key": "reply|r7|a1|t5",
            "last_kind": "reply",
            "last_position": [3, 9_000],
            "damage": None,
            "marks": [
                {"snapshot": "snap-1-0001", "segment": 2, "offset": 4_100},
                {"snapshot": "snap-2-0002", "segment": 3, "offset": 28},
            ],
        },
        {
            "kind": "model",
            "instance": "model-replica-0",
            "records": 12,
            "bytes": 8_000,
            "segments": 1,
            "last_key": "model|r7|a1|t4|c0",
            "last_kind": "policy_call",
            "last_position": [1, 8_028],
            "damage": "segment-0000000001.rpj at offset 8028: <checksum mismatch>",
            "marks": [],
        },
    ]
    store = {"snapshots": [], "invalid": [], "latest": None, "journals": journals}
    monkeypatch.setattr(run_record, "build_report", lambda root, workdir: store)
    page = render_page(read_run(tmp_path))
    restores = page.split("<h2>Restores</h2>")[1].split("</table>")[0]
    assert [re.findall(r"<td[^>]*>([^<]*)</td>", row)[8] for row in restores.split("<tr>")[2:]] == [
        "9",
        "4",
    ]
    table = page.split("<h2>Journals</h2>")[1].split("</table>")[0]
    agent, model = table.split("<tbody>")[1].split("</tr>")[:2]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", agent)
    assert "agent/agent-replica-0" in cells[0]
    assert cells[1:4] == ["41", "52311", "2"]
    assert cells[4] == "reply reply|r7|a1|t5 (segment 3, offset 9000)"
    assert cells[5] == ("snap-1-0001: segment 2, offset 4100; snap-2-0002: segment 3, offset 28")
    # The last restore's, not the first's; and how long the agent read its journal back.
    assert cells[6] == "4 turns, 1 finished replies; read back in 12 ms"
    cells = re.findall(r"<td[^>]*>(.*?)</td>", model)
    assert "damaged: segment-0000000001.rpj at offset 8028: &lt;checksum mismatch&gt;" in cells[4]
    assert cells[5] == "none (no kept snapshot marks it)"
    assert cells[6] == "read back in 3 ms"  # a model journal holds no turns
