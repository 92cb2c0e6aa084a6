"""The shell sandbox (``sandbox_env.shell``, ``external`` mode) SIGKILLed at random moments
(issue 36's done-when): real ``rollpoint run`` processes, real signals, real ``bash``
process trees per command, folders per episode that outlive the servers, and an audit log
outside every process, written through ``ctx.effect``.

Two kills: the whole process group (trainer and servers; then the same command is rerun
until it exits 0), and servers alone (one replica's model, agent and resources servers; the
trainer restarts them, restores their episodes and finishes on its own).
Counted from the audit log itself, never from rollpoint:

- every effect is in it exactly once (no key twice);
- every trained rollout's tool calls are each in it once (its transcript's tool messages
  against its lines: a continued episode's journaled calls were not made again, its calls
  after the crash were made);
- every row is trained once (I1), train_data intact, no regenerated turn (I3), snapshots
  commit after the fault (I4).

CI runs two trials (one of each kill). ``ROLLPOINT_SANDBOX_TRIALS=N`` runs N of each, with
the moments drawn from seeds 0..N-1; ``ROLLPOINT_SANDBOX_TRIAL_LOG=<file>`` appends one
JSON line per trial (kill, moment, effects, episodes continued and restarted) for the
figures in a report.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.config import load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import Start, crash, rerun_until_ok, start, write_config
from tests.support.processes import replica_servers, wait_gone

pytestmark = pytest.mark.chaos
__all__ = ["start"]  # the fixture, shared with the crash tests

TRIALS = int(os.environ.get("ROLLPOINT_SANDBOX_TRIALS", "1"))
TASKS = 10
REPLICAS = 2
_CONTINUED = re.compile(r"(\d+)\s+episodes\s+continued,\s+(\d+)\s+restarted")
_LOST = re.compile(r"(\d+) episodes of an external environment restart")
_REPLICA = re.compile(r"restored from snapshot \S+: (\d+) tries continue there")


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The sandbox folders and the audit log, outside the run (its servers inherit these)."""
    monkeypatch.setenv("SHELL_SANDBOX_ROOT", str(tmp_path / "sandboxes"))
    monkeypatch.setenv("SHELL_SANDBOX_LOG", str(tmp_path / "audit.jsonl"))
    monkeypatch.setenv("SHELL_SANDBOX_STEP_S", "0.3")
    return tmp_path / "audit.jsonl"


def job(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        environment="sandbox_env.shell:ShellSandbox",
        tasks=TASKS,
        replicas=REPLICAS,
        policy={"latency_ms": 40, "error_rate": 0, "tool_turns": 4, "sampling": {"seed": "turn"}},
        journal={"enabled": True},
        snapshot={"every_seconds": 0.5},
        final_states_log=None,
    )


def audit(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def kill_servers(workdir: Path) -> None:
    """SIGKILL one replica's servers (model, agent, resources) at once; the trainer and the
    other replica live on, and the trainer restarts and restores the killed one."""
    pids = replica_servers(workdir, "replica-0")
    assert pids, "no server processes found"
    killed = 0
    for pid in pids:
        # A process listed a moment ago may have ended since (a trial of the 100-trial
        # campaign met one: ProcessLookupError); the ones alive are the replica's servers.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    assert killed, f"none of replica-0's servers {pids} was alive to kill"
    assert wait_gone(pids, timeout_s=10) == []


def check(config: Path, log: Path, finished_at: float) -> dict[str, int]:
    lines = audit(log)
    keys = Counter(line["key"] for line in lines)
    twice = {k: n for k, n in keys.items() if n > 1}
    assert not twice, f"effects made more than once: {twice}"

    loaded = load_config(config)
    rollouts, unreadable = invariants.read_train_data(loaded.workdir)
    per_rollout = Counter(line["rollout"] for line in lines)
    for r in rollouts:
        calls = sum(1 for m in r.messages if m.get("role") == "tool")
        assert per_rollout[r.rollout_id] == calls, (
            f"{r.subject}: {calls} tool calls in its transcript,"
            f" {per_rollout[r.rollout_id]} audit lines"
        )
    found = invariants.check_workdir(
        loaded.workdir,
        load_tasks_for(loaded.job_settings()),
        loaded.group_size,
        resumed_since=finished_at,
        full_reward="none",
    )
    assert unreadable == [] and found == [], invariants.report([*unreadable, *found])
    trained = {r.rollout_id for r in rollouts}
    return {
        "effects": len(keys),
        "effects_of_untrained_rollouts": sum(n for r, n in per_rollout.items() if r not in trained),
        "trained": len(rollouts),
    }


def note(**fields: Any) -> None:
    path = os.environ.get("ROLLPOINT_SANDBOX_TRIAL_LOG")
    if path:
        with open(path, "ab") as f:
            f.write(orjson.dumps(fields) + b"\n")


@pytest.mark.parametrize("seed", range(TRIALS))
@pytest.mark.parametrize("kill", ["everything", "servers"])
def test_a_killed_sandbox_run_makes_every_effect_exactly_once(
    tmp_path: Path, start: Start, sandbox: Path, kill: str, seed: int
) -> None:
    config = job(tmp_path)
    workdir = tmp_path / "run"
    moment = random.Random(f"{kill}/{seed}").uniform(0.5, 4.0)
    run = start(config)
    run.wait_until(lambda: "servers up" in run.stderr, "the servers")
    # A moment after the first effects: episodes are mid-way (tools take 0.3 s each).
    run.wait_until(lambda: len(audit(sandbox)) >= 2, "the first effects")
    time.sleep(moment)
    at_kill = len(audit(sandbox))
    if kill == "everything":
        crash(run)
        finished = rerun_until_ok(start, config)
        stderr = "\n".join(f.stderr for f in finished)
        last = finished[-1]
    else:
        kill_servers(workdir)
        last = run.finish(timeout_s=180)
        assert last.returncode == 0, last.stderr[-3000:]
        stderr = last.stderr
    figures = check(config, sandbox, last.started_at)
    resumed = _CONTINUED.search(stderr)
    lost = sum(int(n) for n in _LOST.findall(stderr))
    replica_continued = sum(int(n) for n in _REPLICA.findall(stderr))
    note(
        kill=kill,
        seed=seed,
        moment_s=round(moment, 2),
        effects_at_kill=at_kill,
        continued=int(resumed.group(1)) if resumed else None,
        restarted=int(resumed.group(2)) if resumed else None,
        external_restarts=lost,
        replica_tries_continued=replica_continued,
        **figures,
    )
