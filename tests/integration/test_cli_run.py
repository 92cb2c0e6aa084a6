"""``rollpoint run`` end to end: real server processes, the real trainer, and real kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import yaml

from tests.support.job_config import write_job_config
from tests.support.processes import children_of, descendants_of, kill_all, servers_of, wait_gone
from tests.support.serve_process import served, workplace_serve_config
from tests.support.train_schema import check_train_rows

pytestmark = pytest.mark.process


def write_config(tmp_path: Path, **overrides: object) -> Path:
    return write_job_config(
        tmp_path, **{"policy": {"latency_ms": 0, "error_rate": 0.1}, **overrides}
    )


def rollpoint(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollpoint", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kw,  # type: ignore[arg-type]
    )


def train_lines(workdir: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in (workdir / "train_data.jsonl").read_bytes().splitlines()]


# The math environment's run (single-turn, restart-only) is the built-in loop's in process:
# tests/integration/test_builtin_loop.py, test_rollouts_sync.py (every row trained once).
@pytest.mark.parametrize(("environment", "replicas"), [("workplace", 2), ("blackjack", 1)])
def test_run_trains_every_group_row_exactly_once(
    tmp_path: Path, environment: str, replicas: int
) -> None:
    config = write_config(
        tmp_path,
        environment=environment,
        replicas=replicas,
        max_turns=8 if environment != "math" else 1,
        snapshot={"allow_restart_only": environment == "math"},
    )
    result = rollpoint("run", str(config))
    assert result.returncode == 0, result.stderr
    lines = train_lines(tmp_path / "run")
    assert len(lines) == 4 * 2
    seen = Counter((line["group_id"], line["row"]) for line in lines)
    assert set(seen.values()) == {1}
    assert check_train_rows(lines) == 8  # the shipped schema, without token capture
    for line in lines:
        for key in ("task_id", "rollout_id", "attempt", "reward", "messages", "train_step"):
            assert key in line
    if environment == "workplace":
        # The scripted policy retries its wrong calls, so most rollouts earn full reward.
        assert sum(float(line["reward"]) for line in lines) / len(lines) > 0.5  # type: ignore[arg-type]


def test_rerun_of_a_finished_job_says_so_without_starting_servers(tmp_path: Path) -> None:
    config = write_config(tmp_path, replicas=1)
    assert rollpoint("run", str(config)).returncode == 0
    first = train_lines(tmp_path / "run")
    events = (tmp_path / "run" / "run_events.jsonl").read_bytes()
    again = rollpoint("run", str(config))
    assert again.returncode == 0, again.stderr
    assert "has finished already, at train step 2" in again.stderr
    assert "servers up" not in again.stderr and "resumed from snapshot" not in again.stderr
    # No server started: the event log has no new run_start (a job appends one once up).
    assert (tmp_path / "run" / "run_events.jsonl").read_bytes() == events
    assert train_lines(tmp_path / "run") == first


def test_fresh_needs_force_on_a_used_workdir(tmp_path: Path) -> None:
    config = write_config(tmp_path, replicas=1)
    assert rollpoint("run", str(config)).returncode == 0
    fresh = rollpoint("run", str(config), "--fresh")
    assert fresh.returncode == 2 and "needs --force" in fresh.stderr
    forced = rollpoint("run", str(config), "--fresh", "--force")
    assert forced.returncode == 0
    assert "resumed" not in forced.stderr
    assert len(train_lines(tmp_path / "run")) == 4 * 2


def test_bad_config_is_one_line_naming_the_key(tmp_path: Path) -> None:
    config = write_config(tmp_path, replica=3)
    result = rollpoint("run", str(config))
    assert result.returncode == 2
    assert "unknown key 'replica'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_unreachable_policy_url_fails_fast_naming_it(tmp_path: Path) -> None:
    config = write_config(tmp_path, policy={"base_url": "http://127.0.0.1:9/v1"})
    result = rollpoint("run", str(config))
    assert result.returncode == 1
    assert "http://127.0.0.1:9/v1 is not reachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_is_named_and_leaves_no_process(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = write_config(tmp_path, base_port=port)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollpoint", "run", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in stderr
    assert children_of(proc.pid) == []


def _start_long_run(tmp_path: Path) -> subprocess.Popen[str]:
    config = write_config(tmp_path, tasks=64, policy={"latency_ms": 200, "error_rate": 0})
    return subprocess.Popen(
        [sys.executable, "-m", "rollpoint", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_servers(proc: subprocess.Popen[str], count: int, timeout_s: float = 60) -> list[int]:
    """Every process below the run once ``count`` servers are up: the servers, and the
    zygote they were forked from (:mod:`rollpoint.runtime.warm_start`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(servers_of(proc.pid)) >= count:
            return descendants_of(proc.pid)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    raise AssertionError(f"only {len(servers_of(proc.pid))} of {count} servers started")


def test_servers_exit_on_their_own_when_run_is_sigkilled(tmp_path: Path) -> None:
    proc = _start_long_run(tmp_path)
    servers = _wait_for_servers(proc, count=1 + 3 * 2)
    try:
        time.sleep(1.0)  # episodes in flight
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        leftover = wait_gone(servers, timeout_s=10)
        assert leftover == [], f"servers outlived a SIGKILLed run: {leftover}"
    finally:
        kill_all(servers)


def test_inspect_shows_the_snapshots_of_a_run(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        tasks=8,
        policy={"latency_ms": 30, "error_rate": 0},
        snapshot={"every_seconds": 0.2},
    )
    assert rollpoint("run", str(config)).returncode == 0
    result = rollpoint("inspect", str(tmp_path / "run"), "--json")
    assert result.returncode == 0, result.stderr
    report = orjson.loads(result.stdout)
    assert report["snapshots"], "a run with snapshots on published none"
    for snap in report["snapshots"]:
        assert {"id", "published_at", "train_step", "pause_seconds"} <= set(snap)
    latest = report["latest"]
    assert latest["id"] == report["snapshots"][0]["id"]
    assert {"id", "train_step", "episodes", "restarts", "participants", "tq_size"} <= set(latest)
    assert {(p["kind"], p["replica"]) for p in latest["participants"]} == {
        (kind, f"replica-{i}") for kind in ("model", "agent", "resources") for i in (0, 1)
    }
    for episode in latest["episodes"]:
        assert {"rollout_id", "attempt", "replica", "turns_completed"} <= set(episode)
    table = rollpoint("inspect", str(tmp_path / "run"))
    assert table.returncode == 0 and latest["id"][:12] in table.stdout


def test_inspect_of_a_missing_workdir_is_one_line(tmp_path: Path) -> None:
    result = rollpoint("inspect", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_serve_prints_urls_and_a_private_control_token(tmp_path: Path) -> None:
    import httpx

    config = write_config(tmp_path, replicas=1)
    with served(config) as deployment:
        token_file = Path(deployment["control_token_file"])
        assert token_file == tmp_path / "run" / "control.token"
        assert token_file.stat().st_mode & 0o077 == 0
        (replica,) = deployment["replicas"]
        agent_url = replica["agent_url"]
        token = token_file.read_text().strip()
        status = httpx.get(
            f"{agent_url}/rollpoint/v1/checkpoint/status",
            headers={"authorization": f"Bearer {token}"},
        )
        assert status.status_code == 200
        refused = httpx.get(f"{agent_url}/rollpoint/v1/checkpoint/status")
        assert refused.status_code == 401


def test_run_attached_to_serve_trains_every_row_once_and_leaves_the_servers_running(
    tmp_path: Path,
) -> None:
    serve_config = write_config(tmp_path, workdir=str(tmp_path / "servers"), tasks=4)
    job = tmp_path / "job-run.yaml"
    with served(serve_config) as deployment:
        line = tmp_path / "served.json"
        line.write_bytes(orjson.dumps(deployment))
        raw = yaml.safe_load(serve_config.read_text()) | {"workdir": str(tmp_path / "first")}
        job.write_text(yaml.safe_dump(raw))
        for _ in range(2):  # the rerun finds the servers the first run left
            done = rollpoint("run", str(job), "--attach", str(line))
            assert done.returncode == 0, done.stderr[-3000:]
            rows = Counter((r["group_id"], r["row"]) for r in train_lines(tmp_path / "first"))
            assert len(rows) == 8 and set(rows.values()) == {1}
        # Another job on them would share their snapshot store: refused (issue 33, one job
        # per store; before, it started over and its retention pruned the first's snapshots).
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump(raw | {"workdir": str(tmp_path / "second")}))
        refused = rollpoint("run", str(other), "--attach", str(line))
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "belongs to job" in refused.stderr and "Traceback" not in refused.stderr
        # The snapshots are where the servers write theirs: the serve config's store.
        assert list((tmp_path / "servers" / "snapshots" / "snapshots").glob("*/manifest.json"))

    missing = rollpoint("run", str(job), "--attach", str(tmp_path / "nope.json"))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "nope.json: No such file or directory" in missing.stderr


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_bytes(b"workdir: run\nenvironment: \xff\xfeworkplace\n")
    result = rollpoint("run", str(config))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{config}: not UTF-8 text (byte 0xff at offset 26)" in result.stderr
    assert not (tmp_path / "run").exists()


def test_fresh_force_refuses_a_folder_that_is_not_a_rollpoint_workdir(tmp_path: Path) -> None:
    precious = tmp_path / "run"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    config = write_config(tmp_path, replicas=1)
    result = rollpoint("run", str(config), "--fresh", "--force")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"workdir {precious} is not a rollpoint workdir" in result.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_a_dataset_edited_in_place_before_the_rerun_is_refused_naming_it(tmp_path: Path) -> None:
    from rollpoint.envs.registry import get_environment

    dataset = tmp_path / "tasks.jsonl"
    rows = get_environment("workplace").make_tasks(4, 0)
    dataset.write_bytes(b"".join(row.model_dump_json().encode() + b"\n" for row in rows))
    config = write_config(tmp_path, replicas=1, tasks=None, dataset=str(dataset))
    assert rollpoint("run", str(config)).returncode == 0
    first = train_lines(tmp_path / "run")
    # Same path, same rows, one prompt changed.
    edited = [rows[0].model_copy(update={"prompt": rows[0].prompt + " Today."}), *rows[1:]]
    dataset.write_bytes(b"".join(row.model_dump_json().encode() + b"\n" for row in edited))

    again = rollpoint("run", str(config))

    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    assert f"dataset {dataset} is not the dataset snapshot" in again.stderr
    assert train_lines(tmp_path / "run") == first


def test_a_graceful_stop_on_served_servers_leaves_no_lease_for_the_rerun(tmp_path: Path) -> None:
    # The final snapshot holds the participants until it is published, then the trainer
    # exits: on servers that outlive it the rerun waited their lease out (8.8 s) first.
    from tests.support.run_process import RICH_ENV, RunProcess

    serve_config, _ = workplace_serve_config(tmp_path, tasks=40, group_size=2, latency_ms=300)
    with served(serve_config) as deployment:
        line = tmp_path / "served.json"
        line.write_bytes(orjson.dumps(deployment))
        raw = yaml.safe_load(serve_config.read_text())
        job = tmp_path / "job.yaml"
        job.write_text(
            yaml.safe_dump(
                raw | {"workdir": str(tmp_path / "run"), "snapshot": {"every_seconds": 1.0}}
            )
        )
        run = RunProcess(job, "--attach", str(line))
        run.wait_until(
            lambda: (tmp_path / "run" / "train_data.jsonl").exists(), "a train step", timeout_s=120
        )
        run.proc.send_signal(signal.SIGTERM)
        stopped = run.finish(timeout_s=60)
        assert stopped.returncode == 143, stopped.stderr[-3000:]
        assert "holds the run" in stopped.stderr

        again = rollpoint("run", str(job), "--attach", str(line), env={**os.environ, **RICH_ENV})

        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from snapshot" in again.stderr
        assert "restore waits for" not in again.stderr
        rows = Counter((r["group_id"], r["row"]) for r in train_lines(tmp_path / "run"))
        assert len(rows) == 80 and set(rows.values()) == {1}
