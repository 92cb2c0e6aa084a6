"""One writer per workdir, across commands: ``serve`` holds it as ``run`` does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import yaml

from tests.support.job_config import write_job_config
from tests.support.serve_process import served

pytestmark = pytest.mark.process


def test_a_run_on_a_workdir_that_serve_holds_is_refused_before_touching_it(
    tmp_path: Path,
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {"workdir": str(tmp_path / "run"), "environment": "math", "tasks": 2, "replicas": 1}
        )
    )
    with served(config):
        holder = (tmp_path / "run" / ".rollpoint.lock").read_text().split()[0]
        token = (tmp_path / "run" / "control.token").read_bytes()
        refused = subprocess.run(
            [sys.executable, "-m", "rollpoint", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert (tmp_path / "run" / "control.token").read_bytes() == token

    assert refused.returncode == 1, refused.stderr
    assert f"is in use by process {holder} " in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "run" / "rollpoint.log").exists()


# --- a lock that cannot be sidestepped (issue 33, item 1) ------------------------------

HOLD_NEW_FILE = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, f"{os.getpid()} elsewhere\\n".encode())
print("locked", flush=True)
time.sleep(600)
"""


def _long_job(tmp_path: Path) -> Path:
    return write_job_config(
        tmp_path,
        tasks=12,
        replicas=1,
        concurrency=4,
        policy={"latency_ms": 150, "error_rate": 0.0},
    )


def _wait_until(check: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"never happened within {within_s}s: {what}"
        time.sleep(0.02)


def _holder_line(lock: Path) -> str:
    try:
        return lock.read_text()
    except OSError:
        return ""


def _start(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "run", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lock_file_deleted_or_replaced_under_a_live_run_lets_no_second_run_in(
    tmp_path: Path, how: str
) -> None:
    config = _long_job(tmp_path)
    lock = tmp_path / "run" / ".rollpoint.lock"
    first = _start(config)
    try:
        _wait_until(
            lambda: _holder_line(lock).startswith(f"{first.pid} "), "the run holds the lock"
        )
        if how == "deleted":
            lock.unlink()  # what an operator does to clear a "stale lock"
        else:
            stand_in = tmp_path / "run" / "new.lock"
            stand_in.write_text("")
            os.replace(stand_in, lock)
        second = subprocess.run(
            [sys.executable, "-m", "rollpoint", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 1, second.stderr  # on main it ran beside the first
        assert first.poll() is None, "the first run must still be live for this test"
        assert f"is in use by process {first.pid} " in second.stderr
        assert "Traceback" not in second.stderr
        # The first run took its lock file again, pid and all.
        _wait_until(lambda: _holder_line(lock).startswith(f"{first.pid} "), "the lock re-taken")
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert f"was {how} while this run held it: taken again" in stderr
    rows = [
        (line["group_id"], line["row"])
        for line in (
            orjson.loads(raw)
            for raw in (tmp_path / "run" / "train_data.jsonl").read_bytes().splitlines()
        )
    ]
    assert len(rows) == 24 and len(set(rows)) == 24  # every row trained once


def test_a_run_whose_new_lock_file_another_process_holds_stops_at_once_in_one_line(
    tmp_path: Path,
) -> None:
    """Where the folder cannot be locked (NFS), a second holder of a new lock file is
    possible: the live run then stops, naming both, rather than run beside it."""
    config = _long_job(tmp_path)
    lock = tmp_path / "run" / ".rollpoint.lock"
    first = _start(config)
    other: subprocess.Popen[str] | None = None
    try:
        _wait_until(
            lambda: _holder_line(lock).startswith(f"{first.pid} "), "the run holds the lock"
        )
        # Another process locks a file of its own, then puts it in the lock file's place.
        other = subprocess.Popen(
            [sys.executable, "-c", HOLD_NEW_FILE, str(tmp_path / "run" / "other.lock")],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert other.stdout is not None and other.stdout.readline().strip() == "locked"
        os.replace(tmp_path / "run" / "other.lock", lock)
        _, stderr = first.communicate(timeout=60)
    finally:
        for proc in (first, other):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if "was replaced while this run" in line]
    assert f"(process {first.pid}) held it, and process {other.pid} " in line
    assert "stopping this run" in line
