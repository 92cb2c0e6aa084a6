"""Preemption of a real ``rollpoint run``: SIGTERM or SIGINT mid-job, then the rerun.

The policy is the scripted one behind a call counter in the test process (the source of
truth for policy calls: it sees every call whatever happens to the run's processes). A
fault-free job makes exactly the calls its trained rows record (``model_calls``), so the
calls beyond those are the ones re-done after the stop.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import yaml

from rollpoint.store.snapshot_store import SnapshotStore
from tests.support.counting_policy import PolicyCalls, counting_policy
from tests.support.processes import descendants_of, servers_of, wait_gone
from tests.support.run_process import RICH_ENV, RunProcess

pytestmark = pytest.mark.process

TASKS, GROUP = 12, 2
GRACE_S = 20.0


def _config(tmp_path: Path, policy_url: str, **more: object) -> Path:
    config: dict[str, object] = {
        "workdir": str(tmp_path / "run"),
        "environment": "workplace",
        "tasks": TASKS,
        "group_size": GROUP,
        "max_turns": 8,
        "replicas": 2,
        "concurrency": 8,
        "policy": {"base_url": policy_url},
        "train": {"batch_size": 4},
        "snapshot": {"every_seconds": 2.0},
        "preemption": {"grace_seconds": GRACE_S},
        **more,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rows(workdir: Path) -> list[dict[str, object]]:
    path = workdir / "train_data.jsonl"
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _rerun(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, **RICH_ENV},
    )


def _stop_mid_job(
    tmp_path: Path, calls: PolicyCalls, url: str, *, signum: int, group: bool
) -> tuple[int, float, str]:
    """Signal a run once it has trained and is mid-job; (calls in flight, when, stderr)."""
    config = _config(tmp_path, url)
    run = RunProcess(config)
    run.wait_until(
        lambda: len(_rows(tmp_path / "run")) >= 4 and calls.snapshot()[1] > 0,
        "a train step with calls in flight",
        timeout_s=120,
    )
    assert len(servers_of(run.proc.pid)) == 3 * 2  # the policy is the test's
    servers = descendants_of(run.proc.pid)  # and the zygote they were forked from
    _, in_flight = calls.snapshot()
    signalled_at = time.time()
    if group:
        os.killpg(run.proc.pid, signum)
    else:
        os.kill(run.proc.pid, signum)
    finished = run.finish(timeout_s=GRACE_S + 10)
    took = time.time() - signalled_at
    expected = 143 if signum == signal.SIGTERM else 130
    assert finished.returncode == expected, finished.stderr[-3000:]
    assert took <= GRACE_S, f"exit took {took:.1f}s, more than the {GRACE_S}s grace"
    assert "Traceback" not in finished.stderr
    assert wait_gone(servers, timeout_s=5) == [], "servers outlived the stopped run"
    return in_flight, signalled_at, finished.stderr


def _check_rerun(tmp_path: Path, config: Path, calls: PolicyCalls, in_flight: int) -> None:
    again = _rerun(config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from snapshot" in again.stderr
    rows = _rows(tmp_path / "run")
    seen = Counter((r["group_id"], r["row"]) for r in rows)
    assert len(seen) == TASKS * GROUP and set(seen.values()) == {1}, seen
    needed = sum(len(r["model_calls"]) for r in rows)  # type: ignore[arg-type]
    total, _ = calls.snapshot()
    redone = total - needed
    assert 0 <= redone <= in_flight, f"{redone} calls re-done, {in_flight} were in flight"


# SIGINT to the whole group (Ctrl-C, which the servers also get, and must outlive for the
# final snapshot). SIGTERM to the run alone (a scheduler's notice) takes the same final
# snapshot: test_a_second_signal_after_the_final_snapshot_says_the_one_line_naming_it
# sends it and checks the snapshot that holds the run; the rerun is the same either way.
@pytest.mark.parametrize(("signum", "group"), [(signal.SIGINT, True)], ids=["sigint-to-group"])
def test_a_signal_mid_job_saves_a_final_snapshot_and_the_rerun_redoes_only_calls_in_flight(
    tmp_path: Path, signum: int, group: bool
) -> None:
    with counting_policy(latency_ms=300) as (url, calls):
        in_flight, signalled_at, stderr = _stop_mid_job(
            tmp_path, calls, url, signum=signum, group=group
        )
        store = SnapshotStore(str(tmp_path / "run" / "snapshots"), clean_leftovers=False)
        latest = store.latest()
        assert latest is not None and latest.published_at is not None
        assert latest.published_at > signalled_at, "no snapshot was published after the signal"
        assert f"snapshot {latest.snapshot_id} holds the run" in stderr
        assert stderr.count("holds the run") == 1, "the stop's line is said once"
        # Every saved episode is said to be at a turn boundary or waiting on a policy call.
        split = re.search(
            r"(\d+) saved mid-episode \((\d+) at a turn boundary, (\d+) waiting on a policy "
            r"call\)",
            stderr,
        )
        assert split is not None, stderr[-2000:]
        saved, boundary, waiting = map(int, split.groups())
        assert saved == len(latest.episodes) > 0 and boundary + waiting == saved
        log = (tmp_path / "run" / "rollpoint.log").read_text()
        assert f"snapshot {latest.snapshot_id} holds the run" in log
        _check_rerun(tmp_path, _config(tmp_path, url), calls, in_flight)


def held_at_stop(marker: Path) -> tuple[str, ...]:
    """The launcher that holds the run as it is about to stop its servers."""
    return ("-m", "tests.support.held_run", "stop", str(marker))


def _started_mid_job(
    tmp_path: Path,
    url: str,
    calls: PolicyCalls,
    launcher: tuple[str, ...] = ("-m", "rollpoint"),
    **more: object,
) -> RunProcess:
    run = RunProcess(_config(tmp_path, url, **more), launcher=launcher)
    run.wait_until(
        lambda: len(_rows(tmp_path / "run")) >= 4 and calls.snapshot()[1] > 0,
        "a train step with calls in flight",
        timeout_s=120,
    )
    return run


def test_a_final_snapshot_out_of_time_keeps_the_previous_one(tmp_path: Path) -> None:
    with counting_policy(latency_ms=300) as (url, calls):
        # No time at all for the final snapshot: the one taken before the signal holds.
        run = _started_mid_job(
            tmp_path,
            url,
            calls,
            snapshot={"every_seconds": 0.5},
            preemption={"grace_seconds": 0.01},
        )
        store = SnapshotStore(str(tmp_path / "run" / "snapshots"), clean_leftovers=False)
        run.wait_until(lambda: store.latest() is not None, "a periodic snapshot")
        signalled_at = time.time()
        os.kill(run.proc.pid, signal.SIGTERM)
        finished = run.finish(timeout_s=30)
        assert finished.returncode == 143, finished.stderr[-3000:]
        assert "Traceback" not in finished.stderr
        latest = store.latest()
        assert latest is not None and latest.published_at is not None
        # Taken before the signal: a periodic one the signal caught while it was being
        # published finishes (published just after it), and the line names it.
        assert latest.created_at < signalled_at
        store.verify(latest.snapshot_id)
        assert "did not finish within the 0.01s grace" in finished.stderr
        assert f"snapshot {latest.snapshot_id} (taken before the signal) holds the run" in (
            finished.stderr
        )
        again = _rerun(_config(tmp_path, url))
        assert again.returncode == 0, again.stderr[-3000:]
        seen = Counter((r["group_id"], r["row"]) for r in _rows(tmp_path / "run"))
        assert len(seen) == TASKS * GROUP and set(seen.values()) == {1}


def test_a_second_signal_stops_at_once_without_a_traceback(tmp_path: Path) -> None:
    with counting_policy(latency_ms=300) as (url, calls):
        run = _started_mid_job(tmp_path, url, calls)
        servers = descendants_of(run.proc.pid)
        os.kill(run.proc.pid, signal.SIGTERM)
        # The second signal only once the first was taken: sent back to back, both can be
        # pending together, and the kernel then delivers the lower-numbered SIGINT first.
        run.wait_until(
            lambda: "SIGTERM received: taking a final snapshot" in run.stderr,
            "the first signal taken",
            timeout_s=10,
            poll_s=0.005,
        )
        os.kill(run.proc.pid, signal.SIGINT)
        finished = run.finish(timeout_s=30)
        assert finished.returncode == 143, finished.stderr[-3000:]
        assert "stopped at once by SIGTERM (a second signal" in finished.stderr
        assert "Traceback" not in finished.stderr
        assert wait_gone(servers, timeout_s=5) == []


def test_a_second_signal_after_the_final_snapshot_says_the_one_line_naming_it(
    tmp_path: Path,
) -> None:
    # The second signal comes while the servers stop, after the final snapshot published:
    # the console said "no final snapshot" although the log said which one held the run.
    # The run is held there (tests/support/held_run.py): polling the log for the final
    # line raced the servers' stop, a few hundred milliseconds.
    stopping = tmp_path / "stopping"
    with counting_policy(latency_ms=300) as (url, calls):
        run = _started_mid_job(tmp_path, url, calls, launcher=held_at_stop(stopping))
        os.kill(run.proc.pid, signal.SIGTERM)
        run.wait_until(stopping.exists, "the servers' stop", timeout_s=GRACE_S + 10)
        assert "holds the run" in (tmp_path / "run" / "rollpoint.log").read_text()
        os.kill(run.proc.pid, signal.SIGINT)
        finished = run.finish(timeout_s=30)
        assert "SIGINT received again" in finished.stderr, "the second signal came too late"
        assert finished.returncode == 143, finished.stderr[-3000:]
        latest = SnapshotStore(str(tmp_path / "run" / "snapshots"), clean_leftovers=False).latest()
        assert latest is not None
        stop_lines = [line for line in finished.stderr.splitlines() if "stopped" in line]
        assert len(stop_lines) == 1, stop_lines
        assert f"snapshot {latest.snapshot_id} holds the run" in stop_lines[0]
        assert "no final snapshot" not in finished.stderr
        assert "Traceback" not in finished.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_serve_stops_cleanly_on_a_signal_to_its_group(tmp_path: Path, signum: int) -> None:
    config = _config(tmp_path, "http://unused/v1", policy={})
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "serve", str(config), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **RICH_ENV},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline(), proc.communicate(timeout=30)[1]
    assert len(servers_of(proc.pid)) == 1 + 3 * 2
    servers = descendants_of(proc.pid)
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "stopped" in stderr
    assert wait_gone(servers, timeout_s=5) == []
