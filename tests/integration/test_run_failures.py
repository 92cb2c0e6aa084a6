"""Failures a user can act on (issue 34), through ``rollpoint run`` end to end.

The environment at fault is a real plugin (``flaky_env:Flaky``, written to the test's own
folder and put on ``PYTHONPATH`` for the run and its server processes): the ``math``
environment whose ``verify`` raises while a marker file says so, and which appends every
verify it is asked for to a file of its own, so what the environment ran is counted from
its own log, not from rewards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import yaml

from rollpoint.app import exit_codes
from tests.support.hanging_engine import MODEL, hanging_engine
from tests.support.job_config import write_job_config
from tests.support.run_process import RICH_ENV, RunProcess
from tests.support.serve_process import served
from tests.support.train_schema import check_train_rows

pytestmark = pytest.mark.integration

FLAKY_ENV = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    from rollpoint.envs.math import MathEnvironment

    MARKER = Path(os.environ["FLAKY_MARKER"])
    CALLS = Path(os.environ["FLAKY_CALLS"])


    def broken(task_id):
        if not MARKER.exists():
            return False
        which = MARKER.read_text().strip()
        return which == "all" or (which == "even" and int(task_id[-4:]) % 2 == 0)


    class Flaky(MathEnvironment):
        def verify(self, state, task, final_message):
            with CALLS.open("a") as calls:
                calls.write(task.task_id + "\\n")
            if MARKER.exists() and MARKER.read_text().strip() == "hang":
                time.sleep(60)  # a verifier that hangs holds the server's event loop
            if broken(task.task_id):
                self._close_the_ledger()
            return super().verify(state, task, final_message)

        def _close_the_ledger(self):
            raise ValueError("the ledger is closed")
    """
)


@pytest.fixture
def flaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin's folder (on PYTHONPATH for every process the test starts)."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "flaky_env.py").write_text(FLAKY_ENV)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("FLAKY_MARKER", str(tmp_path / "broken"))
    monkeypatch.setenv("FLAKY_CALLS", str(tmp_path / "verify_calls.txt"))
    return folder


def break_env(tmp_path: Path, which: str | None) -> None:
    marker = tmp_path / "broken"
    if which is None:
        marker.unlink(missing_ok=True)
    else:
        marker.write_text(which)


def verify_calls(tmp_path: Path) -> Counter[str]:
    path = tmp_path / "verify_calls.txt"
    return Counter(path.read_text().split()) if path.exists() else Counter()


def write_config(tmp_path: Path, **overrides: object) -> Path:
    return write_job_config(
        tmp_path,
        **{
            "environment": "flaky_env:Flaky",
            "max_turns": 1,
            "replicas": 1,
            "concurrency": 4,
            "train": {"batch_size": 2},
            "snapshot": {"allow_restart_only": True},
            **overrides,
        },
    )


def rollpoint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, **RICH_ENV},
    )


def train_rows(workdir: Path) -> list[dict[str, object]]:
    path = workdir / "train_data.jsonl"
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_an_all_failed_run_exits_3_naming_how_many_failed_and_why(
    tmp_path: Path, flaky: Path
) -> None:
    break_env(tmp_path, "all")
    config = write_config(tmp_path, failure={"max_failed_fraction": 1.0})
    result = rollpoint("run", str(config))
    assert result.returncode == exit_codes.GROUPS_FAILED == 3, result.stderr
    assert train_rows(tmp_path / "run") == []
    assert "Traceback" not in result.stderr
    line = last_line(result.stderr)
    assert line.startswith("error: the run ended with failed groups: 4 groups failed;"), line
    assert "most common: " in line
    assert "environment_error" in line and "raised ValueError in verify" in line
    assert "(4 groups)" in line  # the one reason, counted once for all four


def test_max_failed_fraction_stops_early_with_a_snapshot_and_exit_3(
    tmp_path: Path, flaky: Path
) -> None:
    break_env(tmp_path, "all")
    config = write_config(tmp_path, tasks=12, failure={"min_groups": 2})
    result = rollpoint("run", str(config))
    assert result.returncode == exit_codes.GROUPS_FAILED, result.stderr
    line = last_line(result.stderr)
    assert line.startswith("error: stopped early: "), line
    assert "more than failure.max_failed_fraction (0.5)" in line
    assert "holds the run" in line and "the final snapshot failed" not in line
    settled = len(verify_calls(tmp_path))
    assert settled < 12, "it stopped early: not every task was tried"
    assert "Traceback" not in result.stderr


def test_environment_error_text_reaches_the_console_and_is_not_retried(
    tmp_path: Path, flaky: Path
) -> None:
    break_env(tmp_path, "even")
    config = write_config(tmp_path, failure={"max_failed_fraction": 1.0})
    result = rollpoint("run", str(config))
    assert result.returncode == exit_codes.GROUPS_FAILED, result.stderr
    # One line per failed group on the console: the exception's type, its text and the
    # environment's own frame, with no traceback.
    failed_lines = [ln for ln in result.stderr.splitlines() if "group math-000" in ln]
    assert len(failed_lines) == 2, result.stderr
    for ln in failed_lines:
        assert "environment_error" in ln
        assert "environment 'math' raised ValueError in verify: the ledger is closed" in ln
        assert "(at flaky_env.py:" in ln and "in _close_the_ledger)" in ln
        assert "transport" not in ln and "HTTP 500" not in ln
    assert "Traceback" not in result.stderr
    # The traceback is in the resources server's log.
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("resources-*.log"))
    assert "Traceback" in logs and "ValueError: the ledger is closed" in logs
    # Not retried as a network fault: each broken task's rows were verified at most once
    # each (the environment's own count), and the good tasks trained.
    calls = verify_calls(tmp_path)
    assert calls["math-0000"] <= 2 and calls["math-0002"] <= 2, calls
    trained = Counter(str(r["task_id"]) for r in train_rows(tmp_path / "run"))
    assert trained == {"math-0001": 2, "math-0003": 2}


def test_retry_failed_trains_the_fixed_groups_once_and_nothing_twice(
    tmp_path: Path, flaky: Path
) -> None:
    break_env(tmp_path, "even")
    config = write_config(tmp_path, tasks=6, failure={"max_failed_fraction": 1.0})
    first = rollpoint("run", str(config))
    assert first.returncode == exit_codes.GROUPS_FAILED, first.stderr
    assert "3 groups failed" in last_line(first.stderr)
    workdir = tmp_path / "run"
    rows_before = (workdir / "train_data.jsonl").read_bytes()
    # inspect lists the failed groups with their reasons.
    shown = rollpoint("inspect", str(workdir))
    assert shown.returncode == 0, shown.stderr
    for gid in ("math-0000-g0", "math-0002-g0", "math-0004-g0"):
        assert gid in shown.stdout
    assert "raised ValueError in verify" in shown.stdout

    break_env(tmp_path, None)  # the bug is fixed
    calls_before = verify_calls(tmp_path)
    again = rollpoint("run", str(config), "--retry-failed")
    assert again.returncode == exit_codes.OK, again.stderr
    assert "retrying 3 failed groups under new ids" in again.stderr
    rows = train_rows(workdir)
    # What the first run trained is kept as it was; the retry only appended.
    assert (workdir / "train_data.jsonl").read_bytes().startswith(rows_before)
    seen = Counter((str(r["group_id"]), r["row"]) for r in rows)
    assert set(seen.values()) == {1}, "no row trained twice"
    assert check_train_rows(rows) == 12  # retried groups' rows too (group ids -g1)
    by_task = Counter(str(r["task_id"]) for r in rows)
    assert by_task == {f"math-{i:04d}": 2 for i in range(6)}, "every task trained, once"
    assert {str(r["group_id"]) for r in rows if r["task_id"] == "math-0002"} == {"math-0002-g1"}
    # The environment's own count: the retry verified the fixed tasks' rows once each
    # and ran nothing of the groups trained before.
    calls_retry = verify_calls(tmp_path) - calls_before
    assert calls_retry == {"math-0000": 2, "math-0002": 2, "math-0004": 2}, calls_retry

    done = rollpoint("run", str(config))
    assert done.returncode == exit_codes.OK, done.stderr
    assert "has finished already" in done.stderr
    assert train_rows(workdir) == rows


def test_a_key_typo_gets_did_you_mean(tmp_path: Path) -> None:
    config = write_config(tmp_path, environment="math", policy={"latency_ms": 0, "eror_rate": 0})
    result = rollpoint("run", str(config))
    assert result.returncode == exit_codes.REFUSED
    assert "unknown key 'policy.eror_rate' (did you mean 'error_rate'?)" in result.stderr


def test_an_api_key_for_the_builtin_policy_is_refused_at_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, environment="math", policy={"api_key": "sk-123"})
    result = rollpoint("run", str(config))
    assert result.returncode == exit_codes.REFUSED
    assert "the built-in scripted policy takes no API key" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_watchdog_warns_within_its_window_then_stops_with_a_snapshot(tmp_path: Path) -> None:
    with hanging_engine() as (url, engine):
        config = write_config(
            tmp_path,
            environment="math",
            policy={"base_url": f"{url}/v1", "model": MODEL},
            watchdog={"warn_seconds": 2, "stop_seconds": 6},
        )
        run = RunProcess(config)
        run.wait_until(lambda: "servers up" in run.stderr, "the servers")
        up = time.monotonic()
        warning = f"warning: the policy engine at {url}/v1 has answered none of the "
        run.wait_until(lambda: warning in run.stderr, "the watchdog's warning", timeout_s=60)
        warned_after = time.monotonic() - up
        finished = run.finish(timeout_s=90)
    # Not before its 2 s of calls waiting; a few seconds late at most (it looks every 0.5 s).
    assert 2 <= warned_after <= 2 + 8, warned_after
    assert engine.chat_calls >= 1
    assert finished.returncode == exit_codes.ERROR, finished.stderr
    said = re.search(
        r"has answered none of the (\d+) calls? waiting on it for (\d+)s", finished.stderr
    )
    assert said is not None and int(said.group(1)) >= 1 and int(said.group(2)) >= 2
    assert finished.stderr.count(warning) == 1, "one warning, not one per look"
    line = last_line(finished.stderr)
    assert line.startswith("error: the policy engine at "), line
    assert "stopped by the watchdog after 6s (watchdog.stop_seconds)" in line
    assert "holds the run" in line
    assert "Traceback" not in finished.stderr


def test_the_watchdog_stops_a_run_whose_resources_server_stops_answering(
    tmp_path: Path, flaky: Path
) -> None:
    break_env(tmp_path, "hang")
    config = write_config(tmp_path, watchdog={"warn_seconds": 2, "stop_seconds": 5})
    run = RunProcess(config)
    warning = "warning: replica-0's resources server at http://127.0.0.1:"
    run.wait_until(lambda: warning in run.stderr, "the watchdog's warning", timeout_s=60)
    finished = run.finish(timeout_s=90)
    assert finished.returncode == exit_codes.ERROR, finished.stderr
    said = re.search(
        r"has not answered for (\d+)s with (\d+) episodes in flight on replica-0", finished.stderr
    )
    assert said is not None and int(said.group(1)) >= 2 and int(said.group(2)) >= 1, finished.stderr
    line = last_line(finished.stderr)
    assert line.startswith("error: replica-0's resources server at "), line
    assert "stopped by the watchdog after 5s (watchdog.stop_seconds)" in line
    assert "holds the run" in line
    assert "Traceback" not in finished.stderr


def test_a_run_attached_to_servers_of_another_environment_is_refused_at_open(
    tmp_path: Path,
) -> None:
    serve_config = write_config(tmp_path, environment="math", workdir=str(tmp_path / "servers"))
    with served(serve_config) as deployment:
        line = tmp_path / "served.json"
        line.write_bytes(orjson.dumps(deployment))
        job = tmp_path / "job-run.yaml"
        raw = yaml.safe_load(serve_config.read_text()) | {
            "workdir": str(tmp_path / "run"),
            "environment": "workplace",
            "max_turns": 8,
        }
        job.write_text(yaml.safe_dump(raw))
        result = rollpoint("run", str(job), "--attach", str(line))
    assert result.returncode == exit_codes.REFUSED, result.stderr
    (replica,) = deployment["replicas"]
    assert last_line(result.stderr) == (
        f"error: environment: this config names 'workplace' but replica-0's resources server "
        f"at {replica['resources_url']} serves 'math'; run on servers of 'workplace', or set "
        "environment to the one they serve"
    )
    assert "failed" not in result.stderr and "Traceback" not in result.stderr
    assert train_rows(tmp_path / "run") == []
