"""The CLI as an operator meets it: help, version, completion, progress in a pipe, tables
that keep ids and URLs whole, ``inspect``'s exit code, warnings on the console.

Every command runs as a child process with its output piped (not a terminal), at rich's
default width for that case: 80 columns.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from rollpoint import __version__
from tests.support.job_config import write_job_config
from tests.support.prometheus import Scrape

pytestmark = pytest.mark.process

# No COLUMNS: a pipe gets rich's 80 columns, where tables used to cut ids and URLs.
PIPE_ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {
    "NO_COLOR": "1"
}
COMMANDS = ("run", "serve", "inspect", "conformance", "chaos", "version")


def rollpoint(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=PIPE_ENV,
    )


def write_config(tmp_path: Path, **overrides: object) -> Path:
    return write_job_config(tmp_path, **{"snapshot": {"every_seconds": 0.3}, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_help_is_plain_words_for_every_command() -> None:
    for argv in ([], *([c] for c in COMMANDS)):
        result = rollpoint(*argv, "--help")
        assert result.returncode == 0, (argv, result.stderr)
        text = result.stdout
        # RST markup and references to documents a user of the package does not have.
        for bad in ("``", "DESIGN", "§", ":class:", ":mod:"):
            assert bad not in text, (argv, bad)
    top = rollpoint("--help").stdout
    assert all(c in top for c in COMMANDS)


def test_version_flag_and_shell_completion() -> None:
    assert rollpoint("--version").stdout.strip() == __version__
    assert rollpoint("version").stdout.strip() == __version__
    # --show-completion prints the script for the shell named, here bash. Without a name,
    # typer guesses the shell from the parent processes, which depends on how the suite
    # was started ("Shell not supported" under a runner with no shell above it); typer's
    # own switch turns the guess off, so the one shell named is the one printed.
    completion = subprocess.run(
        [sys.executable, "-m", "rollpoint", "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        stdin=subprocess.DEVNULL,
        env=PIPE_ENV | {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert completion.returncode == 0, completion.stdout + completion.stderr
    assert "complete" in completion.stdout and "COMP_WORDS" in completion.stdout


class Watched:
    """A ``rollpoint run`` with stderr piped, read line by line as it comes, with arrival times."""

    def __init__(self, config: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollpoint", "run", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=PIPE_ENV,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, within_s: float = 60) -> str:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}: {[t for _, t in self.lines]}")

    def finish(self) -> str:
        # Not communicate(): it would read stderr too, racing the reader for the last lines.
        assert self.proc.stdout is not None
        self.proc.wait(timeout=180)
        out = self.proc.stdout.read()
        self._reader.join(timeout=10)
        return out


def test_run_in_a_pipe_prints_plain_progress_lines_while_it_runs(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(
        tmp_path,
        tasks=16,
        # Long enough (about 6 s of policy time) for a periodic line before the final one.
        policy={"latency_ms": 300, "error_rate": 0.0},
        metrics={"port": port},
    )
    run = Watched(config)
    try:
        run.wait_for(rf"metrics at http://127\.0\.0\.1:{port}/metrics")
        first = run.wait_for(r"^episodes \d+/32 · in flight \d+")
        alive_at_first = run.proc.poll() is None
        # metrics.port is where the trainer serves; its counters move while the run goes.
        page = Scrape(f"http://127.0.0.1:{port}/metrics")
        assert page.has("rollpoint_episodes_finished_total")
        out = run.finish()
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.proc.returncode == 0, [t for _, t in run.lines]
    assert alive_at_first, f"the first progress line came only at the end: {first}"
    progress = [(t, line) for t, line in run.lines if line.startswith("episodes ")]
    assert len(progress) >= 2
    assert progress[-1][1].startswith("episodes 32/32")
    # Plain lines: no bar redrawn, no escape codes, nothing cut at 80 columns.
    text = "\n".join(line for _, line in run.lines)
    assert "\x1b[" not in text and "\r" not in text and "…" not in text
    assert "run finished" in out and "…" not in out


def test_inspect_prints_ids_whole_and_exits_1_when_nothing_is_usable(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    workdir = tmp_path / "run"
    workdir.mkdir()
    empty = rollpoint("inspect", str(workdir))
    assert empty.returncode == 1 and "no usable snapshot" in empty.stdout
    assert rollpoint("inspect", str(workdir), "--json").returncode == 1

    assert rollpoint("run", str(config)).returncode == 0
    listed = orjson.loads(rollpoint("inspect", str(workdir), "--json").stdout)
    table = rollpoint("inspect", str(workdir))
    assert table.returncode == 0, table.stderr
    ids = [s["id"] for s in listed["snapshots"]]
    assert len(ids) >= 2
    for sid in ids:  # each id in full, on one line
        assert sid in table.stdout, sid
    assert "…" not in table.stdout
    # Every snapshot damaged: nothing a rerun could restore.
    for manifest in (workdir / "snapshots").rglob("manifest.json"):
        if manifest.parent.name in ids:
            manifest.write_text("{not json")
    broken = rollpoint("inspect", str(workdir))
    assert broken.returncode == 1, broken.stdout
    assert "not usable" in broken.stdout and "no usable snapshot" in broken.stdout


def test_a_skipped_snapshot_is_a_warning_on_the_console(tmp_path: Path) -> None:
    config = write_config(tmp_path, tasks=8, policy={"latency_ms": 30, "error_rate": 0.0})
    workdir = tmp_path / "run"
    assert rollpoint("run", str(config)).returncode == 0
    latest = orjson.loads(rollpoint("inspect", str(workdir), "--json").stdout)["latest"]["id"]
    # Its ledger no longer matches the digest its manifest seals: restore must skip it.
    ledger = workdir / "snapshots" / "snapshots" / latest / "trainer" / "ledger.json"
    ledger.write_bytes(ledger.read_bytes() + b" ")
    rerun = rollpoint("run", str(config))
    assert rerun.returncode == 0, rerun.stderr
    warned = [line for line in rerun.stderr.splitlines() if line.startswith("warning:")]
    assert any(latest in line for line in warned), rerun.stderr


def test_serve_prints_urls_whole(tmp_path: Path) -> None:
    config = write_config(tmp_path, replicas=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "serve", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=PIPE_ENV,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("data token:"):
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    text = "\n".join(lines)
    urls = re.findall(r"http://127\.0\.0\.1:\d+", text)
    assert len(urls) >= 7, text  # 3 per replica, and the policy
    for url in urls:
        port = int(url.rsplit(":", 1)[1])
        assert 1024 <= port <= 65535, url  # a port cut short would read as another
    rows = [line for line in lines if "replica-" in line]
    assert len(rows) == 2 and all(len(re.findall("http://", r)) == 3 for r in rows), text
    assert "…" not in text
