"""The tally's account of planned faults: each one injected, or not injected with why."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

from rollpoint.app.chaos.plan import ChaosFault, PlannedFault, TrialEvent, TrialPlan
from rollpoint.app.chaos.tally import ChaosTally, RunRecord, TrialOutcome
from rollpoint.protocol.participant import ParticipantKind

KILL = PlannedFault(kind=ChaosFault.PROCESS_KILL, run=0, at_s=2.0)
STOP = PlannedFault(
    kind=ChaosFault.REPLICA_STOP, run=0, at_s=0.5, servers=[ParticipantKind.AGENT], seconds=0.3
)
SLOW = PlannedFault(kind=ChaosFault.SLOW_PREPARE, run=0, at_s=0.7, seconds=0.4)
PARTITION = PlannedFault(kind=ChaosFault.PARTITION, run=0, at_s=1.9, seconds=0.2)
LATER = PlannedFault(kind=ChaosFault.SLOW_PREPARE, run=1, at_s=0.2, seconds=0.4)


def outcome(runs: list[RunRecord], *faults: PlannedFault) -> TrialOutcome:
    plan = TrialPlan(trial=0, config=Path("job.yaml"), workdir=Path("trial-0"), faults=list(faults))
    return TrialOutcome(0, plan, runs, Counter(), [], 1.0)


def test_a_run_that_finished_first_misses_its_kill_and_the_later_runs_faults() -> None:
    struck = TrialEvent(event="fault", ts=1.0, kind=STOP.kind, detail=STOP.describe())
    said = TrialEvent(
        event="missed", ts=1.0, detail=SLOW.describe(), reason="found nothing to hit: gone"
    )
    run = RunRecord(run=0, started_at=0.0, events=[struck, said], returncode=0)

    o = outcome([run], KILL, STOP, SLOW, PARTITION, LATER)

    assert [(f.describe(), why) for f, why in o.missed] == [
        (KILL.describe(), "the run ended (exit 0) before the kill at 2.00s"),
        (SLOW.describe(), "found nothing to hit: gone"),
        (PARTITION.describe(), "the run ended (exit 0) before it took effect"),
        (LATER.describe(), "run 1 never ran: the trial ended with run 0"),
    ]
    assert o.faults_injected == {ChaosFault.REPLICA_STOP: 1}
    tally = ChaosTally(seed=1, config="job.yaml", outcomes=[o])
    doc = tally.to_json()
    assert doc["faults_missed"]["slow_prepare"] == 2
    assert sum(doc["faults_missed"].values()) + sum(doc["faults_injected"].values()) == 5
    assert doc["per_trial"][0]["faults_missed"][1] == {
        "fault": SLOW.describe(),
        "reason": "found nothing to hit: gone",
    }


def test_a_kill_that_landed_and_a_fault_struck_before_it_are_not_missed() -> None:
    struck = TrialEvent(event="fault", ts=1.0, kind=STOP.kind, detail=STOP.describe())
    killed = RunRecord(
        run=0, started_at=0.0, events=[struck], returncode=-signal.SIGKILL, killed_at=2.1
    )
    rerun = RunRecord(run=1, started_at=3.0, returncode=0)

    o = outcome([killed, rerun], KILL, STOP, PARTITION)

    assert [(f.kind, why) for f, why in o.missed] == [
        (ChaosFault.PARTITION, "the run ended (killed by the plan) before it took effect")
    ]


def test_a_run_stopped_on_failed_groups_is_not_a_failed_run_nor_a_pass() -> None:
    # Chaos trials exit 3 when a run stops early on failure.max_failed_fraction: the
    # snapshots committed (not I4), and the rows the failed groups never trained are I1's.
    stopped = RunRecord(run=0, started_at=0.0, returncode=3)
    crashed = RunRecord(run=0, started_at=0.0, returncode=1)

    assert stopped.stopped_on_failed_groups and not stopped.failed
    assert crashed.failed and not crashed.stopped_on_failed_groups
    o = outcome([stopped])
    assert not o.finished  # a trial ends only on a run that exits 0
    tally = ChaosTally(seed=1, config="job.yaml", outcomes=[o, outcome([crashed])])
    doc = tally.to_json()
    assert doc["runs_failed"] == 1 and doc["runs_stopped_on_failed_groups"] == 1


def test_the_check_counts_a_stop_on_failed_groups_by_its_untrained_rows_not_as_i4(
    tmp_path: Path,
) -> None:
    import yaml

    from rollpoint.app.chaos.command import ChaosRunner
    from rollpoint.app.config import load_config
    from rollpoint.testing.invariants import Invariant

    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump({"workdir": str(tmp_path / "run"), "environment": "workplace", "tasks": 2})
    )
    runner = ChaosRunner(config, load_config(config), run_timeout_s=60)
    plan = TrialPlan(trial=0, config=config, workdir=tmp_path / "trial-0")
    plan.workdir.mkdir()

    stopped = runner.check(plan, [RunRecord(run=0, started_at=0.0, returncode=3)])
    crashed = runner.check(plan, [RunRecord(run=0, started_at=0.0, returncode=1)])

    # Nothing was trained here: I1 counts every row; the workdir's missing snapshots are
    # I4's own finding, but the stop itself is not said to be a run that failed.
    assert Invariant.EXACTLY_ONCE in {v.kind for v in stopped}
    assert not [v for v in stopped if "stopped by itself" in v.detail]
    assert [v for v in crashed if "stopped by itself (exit 1)" in v.detail]
