"""A run that already ended: known from its record, before any server starts.

Owns :func:`finished_summary`: a rerun of a run whose event log ends with its ``run_end``
and whose resume point holds every group trained or failed has nothing to do, so the job
says so and returns the run's figures instead of starting every server to find that out.
A run resumed to retry its failed groups (``--retry-failed``), or one that takes groups
while it runs, is not finished by this test.
"""

from __future__ import annotations

from pathlib import Path

from rollpoint.trainer.dispatch.failed_groups import superseded
from rollpoint.trainer.restore.resume_point import ResumePoint
from rollpoint.trainer.run_events import RunEnd, RunStart, read_events
from rollpoint.trainer.state.ledger import RecoveryLedger
from rollpoint.trainer.trainer import RunSummary


def finished_summary(events_path: Path, point: ResumePoint) -> RunSummary | None:
    """The ended run's summary (elapsed 0: nothing ran now), or None when it has work left."""
    ends = [e for e in read_events(events_path).events if isinstance(e, RunStart | RunEnd)]
    if not ends or not isinstance(ends[-1], RunEnd):
        return None  # never ended, or a rerun started since and did not end (a crash)
    what = f"ledger of snapshot {point.manifest.snapshot_id}"
    ledger = RecoveryLedger.from_document(point.ledger_doc, what=what)
    failed = ledger.failed_groups()
    trained = int(point.trainer_doc.get("groups_trained", point.checkpoint.groups_trained))
    if trained + len(failed) < len(ledger.group_ids()):
        return None
    retried = superseded(ledger)
    episodes = int(point.trainer_doc.get("episodes", 0))
    reward_sum = float(point.trainer_doc.get("reward_sum", 0.0))
    return RunSummary(
        episodes=episodes,
        turns=int(point.trainer_doc.get("turns", 0)),
        train_steps=point.checkpoint.step,
        failed_groups={g: r for g, r in failed.items() if g not in retried},
        mean_reward=reward_sum / episodes if episodes else 0.0,
        elapsed_s=0.0,
    )
