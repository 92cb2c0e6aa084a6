"""Pause-free snapshots across a SIGKILL (issue 37 items 2 and 3).

The durable-turns crash job (``tests/chaos/test_durable_turns_crash.py``, whose helpers
this reuses) with ``snapshot.mode: journal``: snapshots every 0.5 s that close no
admission and save no episode; the rerun sends every try the snapshot held in flight again
under its own id, and each goes on from its replica's journals. Counted from the outside,
as there: policy calls done twice from the engine's own log (at most those in flight at
the kill), each trained turn's tokens and logprobs against that log, each effect from the
environment's own log (a journaled one exactly once), and I1 to I4.

Then item 3's fault: the servers of one replica SIGKILLed between their checkpoint
and the snapshot's publication (the trainer in the test process, at the coordinator's
capture point, with every participant's checkpoint written): the snapshot is still
published, the runtime restarts the replica, the trainer restores it from that snapshot
plus its journals, and the same counts hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.chaos.command import ChaosRunner
from rollpoint.app.chaos.plan import ChaosFault, PlannedFault, TrialPlan
from rollpoint.app.config import load_config
from rollpoint.job.tasks import load_tasks_for
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.testing import invariants
from tests.chaos.test_crash_recovery import Start, rerun_until_ok, start
from tests.chaos.test_durable_turns_crash import (
    CONCURRENCY,
    TASKS,
    check_after_the_kill,
    effects,
    episode_calls,
    job,
    kill_mid_run,
    lines,
    logged_policy,
    redone,
)
from tests.support.effect_log_env import EffectLogEnvironment
from tests.support.embedded_job import embedded_job
from tests.support.job_config import job_config, write_job_config
from tests.support.processes import kill_all, replica_servers, wait_gone

pytestmark = pytest.mark.chaos
__all__ = ["effects", "start"]  # the fixtures, shared with the crash tests

JOURNAL_SNAPSHOTS: dict[str, Any] = {
    "snapshot": {"every_seconds": 0.5, "mode": "journal"},
    "train": {"batch_size": 4},
}
_RESENT = re.compile(r"(\d+) sent again to continue from their journals")


def snapshot_events(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / invariants.METRICS_FILE
    return [
        e
        for e in (orjson.loads(line) for line in path.read_bytes().splitlines())
        if e.get("event") == "snapshot" and e.get("outcome") == "published"
    ]


@pytest.mark.parametrize("seed", [17])  # one moment: the campaigns draw hundreds
def test_a_job_with_journal_snapshots_killed_at_a_random_moment(
    tmp_path: Path, start: Start, effects: Path, seed: int
) -> None:
    config, log = job(tmp_path, journal=True, snapshots=JOURNAL_SNAPSHOTS)
    at_kill = kill_mid_run(
        start, config, log, snapshots=3, share=random.Random(seed).uniform(0.2, 0.7)
    )
    effects_at_kill = lines(effects)
    reruns = rerun_until_ok(start, config)
    resent = _RESENT.search(reruns[0].stderr)
    assert resent and int(resent.group(1)) > 0, reruns[0].stderr[-2000:]
    # Every periodic snapshot of every run closed nothing: no pause recorded. (Only the
    # final snapshot of a run that ends takes the cut: at most one per run.)
    events = snapshot_events(tmp_path / "run")
    paused = [e for e in events if e["pause_seconds"] > 0]
    assert len(events) - len(paused) >= 3, events
    assert len(paused) <= len(reruns) + 1, paused
    check_after_the_kill(tmp_path, config, log, effects, at_kill, effects_at_kill, reruns[-1])


async def test_a_participant_killed_between_its_checkpoint_and_the_publication(
    tmp_path: Path, effects: Path
) -> None:
    log = tmp_path / "engine.jsonl"
    config = job_config(
        tmp_path,
        environment="tests.support.effect_log_env:EffectLogEnvironment",
        tasks=TASKS,
        group_size=1,
        concurrency=CONCURRENCY,
        policy=logged_policy(log),
        journal={"enabled": True},
        snapshot={"every_seconds": 600, "mode": "journal", "deadline_seconds": 60},
        train={"batch_size": 4, "checkpoint_every_steps": 1000},
        final_states_log=str(tmp_path / "final-states"),
    )
    killed: dict[str, Any] = {}

    async def kill_the_replica() -> None:
        # Every participant has checkpointed (its manifest is written); the trainer has not
        # captured its ledger, nothing is published yet.
        pids = replica_servers(config.workdir, "replica-0")
        assert len(pids) == 3, pids
        kill_all(pids)
        assert await asyncio.to_thread(wait_gone, pids, 10) == []
        killed["log_at"] = log.stat().st_size
        killed["effects"] = lines(effects)
        killed["at"] = time.time()

    async with embedded_job(config, replica_restart_wait_s=60) as h:
        coordinator = h.trainer.coordinator
        assert coordinator is not None
        run = asyncio.create_task(h.trainer.run())
        # As ``rollpoint run`` does: a replica whose processes die is restarted and the
        # trainer told (the job's own wiring, rollpoint/job/run.py).
        watch = asyncio.create_task(
            h.runtime.supervise(h.trainer.replica_down, h.trainer.replica_up)
        )
        while len(episode_calls(lines(log, live=True))) < TASKS * 4 // 3:
            assert not run.done(), "the job ended before the fault"
            await asyncio.sleep(0.05)
        coordinator.before_capture = kill_the_replica
        report = await coordinator.save()
        coordinator.before_capture = None
        summary = await run
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    assert report.published, report.blocked_by
    manifest = h.store.load(report.snapshot_id)
    assert manifest.journaled and manifest.pause_seconds == 0
    assert {p.kind for p in manifest.participants if p.replica == "replica-0"} == set(
        ParticipantKind
    )
    assert not summary.failed_groups

    twice, before = redone(log, killed["log_at"])
    assert len(twice) <= CONCURRENCY, f"{len(twice)} policy calls done again: {twice}"
    tasks = load_tasks_for(config.job_settings())
    env = EffectLogEnvironment()
    expected = Counter((t.task_id, e) for t in tasks for e in env.expected_side_effects(t))
    seen = Counter((line["task"], line["effect"]) for line in lines(effects))
    assert set(seen) == set(expected), set(seen) ^ set(expected)
    repeated = {k for k, n in seen.items() if n > 1}
    in_doubt = {(line["task"], line["effect"]) for line in killed["effects"][-CONCURRENCY:]}
    assert repeated <= in_doubt, "an effect made well before the kill was made again"
    found = invariants.check_workdir(
        config.workdir,
        tasks,
        config.group_size,
        resumed_since=killed["at"],
        full_reward="all",
        final_states=config.final_states_log,
    )
    assert found == [], invariants.report(found)
    assert before, "no call before the kill"


async def test_the_chaos_kind_kills_a_replica_between_its_checkpoint_and_the_publication(
    tmp_path: Path,
) -> None:
    """``rollpoint chaos``'s ``checkpoint_kill`` on a job with journal-mode snapshots: one
    trial, run as the command runs it, with its invariants checked by the command's own
    checks (I1 to I4)."""
    config_path = write_job_config(
        tmp_path,
        tasks=8,
        policy={"latency_ms": 50, "error_rate": 0},
        journal={"enabled": True},
        snapshot={"every_seconds": 0.3, "mode": "journal"},
    )
    runner = ChaosRunner(config_path, load_config(config_path), run_timeout_s=120)
    fault = PlannedFault(
        kind=ChaosFault.CHECKPOINT_KILL,
        run=0,
        at_s=0.5,
        replica=1,
        servers=list(ParticipantKind),
    )
    plan = TrialPlan(trial=0, config=config_path, workdir=tmp_path / "trial-0", faults=[fault])
    outcome = await runner.trial(plan)
    assert outcome.violations == [], invariants.report(outcome.violations)
    assert outcome.faults_injected == {ChaosFault.CHECKPOINT_KILL: 1}, outcome.missed
    assert [r.returncode for r in outcome.runs] == [0]
    assert outcome.snapshots["published"] >= 2
