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
