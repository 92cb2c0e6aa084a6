"""The faults a chaos trial's folder suffers between two runs.

Owns applying, before a run, the faults its plan puts there
(:meth:`~rollpoint.app.chaos.plan.TrialPlan.before_run`): the newest snapshot damaged
(:mod:`rollpoint.testing.snapshot_damage`), the records file most snapshots share damaged,
a journal damaged (:mod:`rollpoint.testing.journal_damage`); and healing a store a killed
run left full. What happened is said as the events the run's record starts with.

It does not apply the faults under a live run (the trial process and the runner's kills
do), nor judge what they left (:meth:`~rollpoint.app.chaos.command.ChaosRunner.check`).
"""

from __future__ import annotations

import time

from rollpoint.app.chaos.plan import (
    JOURNAL_DAMAGES,
    ChaosFault,
    TrialEvent,
    TrialPlan,
    trial_store_folder,
)
from rollpoint.testing.faulty_store import heal
from rollpoint.testing.journal_damage import NothingToDamage as NoJournalToDamage
from rollpoint.testing.journal_damage import damage_journal
from rollpoint.testing.snapshot_damage import (
    Damage,
    NothingToDamage,
    damage_newest,
    damage_shared_pack,
)

__all__ = ["damage_between"]


def damage_between(plan: TrialPlan) -> list[TrialEvent]:
    """Apply the faults on the trial's folder planned before this run: what happened,
    as the events the run's record starts with."""
    # A trial process killed while the disk was full left it full: it has room again.
    heal(trial_store_folder(plan))
    events = []
    for fault in plan.before_run():
        now = time.time()
        try:
            if fault.kind is ChaosFault.PACK_DAMAGE:
                done = damage_shared_pack(trial_store_folder(plan), fault.how or "flip")
            elif fault.kind in JOURNAL_DAMAGES:
                done = damage_journal(
                    trial_store_folder(plan), JOURNAL_DAMAGES[fault.kind], fault.participant
                )
            else:
                done = damage_newest(trial_store_folder(plan), fault.damage or Damage.FILE)
        except (NothingToDamage, NoJournalToDamage) as exc:
            events.append(
                TrialEvent(event="missed", ts=now, detail=fault.describe(), reason=str(exc))
            )
            continue
        for event in ("fault", "over"):
            events.append(
                TrialEvent(
                    event=event, ts=now, kind=fault.kind, detail=fault.describe(), reason=done
                )
            )
    return events
