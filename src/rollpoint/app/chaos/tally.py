"""What the chaos trials did and found: per run, per trial, and summed into one table.

Owns the records of ``rollpoint chaos`` (:class:`RunRecord` for one trial process,
:class:`TrialOutcome` for one trial) and :class:`ChaosTally`, which sums them into the
rich tables the command prints and the JSON object ``--json`` writes. Every fault kind and
every invariant appears in both, zeros included, so a script can read any count without
asking whether it exists. It runs nothing and checks nothing: the runner in
:mod:`rollpoint.app.chaos.command` fills it.
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from rich.table import Table

from rollpoint.app import exit_codes
from rollpoint.app.chaos.plan import KILLS, ChaosFault, PlannedFault, TrialEvent, TrialPlan
from rollpoint.testing.invariants import Invariant, Violation

PUBLISHED = "published"
FAILED = "failed"


@dataclass
class RunRecord:
    """One process of one trial: how it ended and the events it printed."""

    run: int
    started_at: float
    """Unix time it was started."""
    events: list[TrialEvent] = field(default_factory=list)
    returncode: int | None = None
    killed_at: float | None = None
    """When the runner sent the plan's SIGKILL (it may have exited just before)."""
    kill: ChaosFault = ChaosFault.PROCESS_KILL
    """Which kill that was: the whole trial's, or the trainer's alone."""
    in_commit: bool | None = None
    """For a ``journal_commit_kill``: a journal segment was seen growing right before the
    kill (False: none within its wait, and it killed anyway: not injected as planned)."""
    timed_out: bool = False
    intruders: list[str] = field(default_factory=list)
    """What went wrong with a second run started beside this one (it was not refused)."""

    @property
    def killed(self) -> bool:
        """The plan's kill landed: the process died of it."""
        return self.killed_at is not None and self.returncode == -signal.SIGKILL

    @property
    def failed(self) -> bool:
        """It exited non-zero on its own (not killed by the plan, not hung), for another
        reason than failed groups."""
        return (
            self.returncode not in (0, None, exit_codes.GROUPS_FAILED)
            and not self.killed
            and not self.timed_out
        )

    @property
    def stopped_on_failed_groups(self) -> bool:
        """It stopped early, with a snapshot, because too many groups failed
        (``failure.max_failed_fraction``; exit 3). Not a snapshot that failed to commit
        (I4): the rows those groups never trained are I1's to count, so the trial is not
        passed either."""
        return self.returncode == exit_codes.GROUPS_FAILED and not self.killed

    @property
    def ending(self) -> str:
        """How it ended, in words."""
        if self.killed:
            return "killed by the plan"
        if self.timed_out:
            return "hung, killed"
        return f"exit {self.returncode}"

    @property
    def error(self) -> str:
        return next((e.detail for e in self.events if e.event == "error"), "")

    def faults(self) -> Counter[ChaosFault]:
        found = Counter(e.kind for e in self.events if e.event == "fault" and e.kind is not None)
        if self.killed and self.in_commit is not False:
            found[self.kill] += 1
        return found

    def settled_since(self) -> float:
        """Where I4 looks from: the run's start, or when its last fault was over. A fault
        still going when the run ended leaves nothing after it to judge (``inf``)."""
        struck = sum(1 for e in self.events if e.event == "fault")
        over = [e.ts for e in self.events if e.event == "over"]
        if len(over) < struck:
            return math.inf
        return max([self.started_at, *over])

    def resumed(self) -> tuple[int, int]:
        """(episodes continued, restarted) by this run's restore."""
        found = [e for e in self.events if e.event == "resumed"]
        return sum(e.continued for e in found), sum(e.restarted for e in found)


@dataclass
class TrialOutcome:
    trial: int
    plan: TrialPlan
    runs: list[RunRecord]
    snapshots: Counter[str]
    """Snapshot attempts of every run by outcome (``published``, ``failed``)."""
    violations: list[Violation]
    seconds: float

    @property
    def finished(self) -> bool:
        return bool(self.runs) and self.runs[-1].returncode == 0

    @property
    def faults_injected(self) -> Counter[ChaosFault]:
        return sum((r.faults() for r in self.runs), Counter())

    @property
    def missed(self) -> list[tuple[PlannedFault, str]]:
        """Every planned fault that did not take effect, with why: what the trial process
        said, or what the runner saw (the run ended first, or never ran)."""
        found = []
        for fault in self.plan.faults:
            reason = self._missed_because(fault)
            if reason is not None:
                found.append((fault, reason))
        return found

    def _missed_because(self, fault: PlannedFault) -> str | None:
        if fault.run >= len(self.runs):
            return f"run {fault.run} never ran: the trial ended with run {len(self.runs) - 1}"
        record = self.runs[fault.run]
        if fault.kind in KILLS:
            if record.killed and record.in_commit is False:
                return "no journal commit was seen being written: killed outside one"
            if record.killed:
                return None
            return f"the run ended ({record.ending}) before the kill at {fault.at_s:.2f}s"
        described = fault.describe()
        if any(e.event == "fault" and e.detail == described for e in record.events):
            return None
        said = [e.reason for e in record.events if e.event == "missed" and e.detail == described]
        return said[0] if said else f"the run ended ({record.ending}) before it took effect"

    @property
    def episodes(self) -> tuple[int, int]:
        resumed = [r.resumed() for r in self.runs]
        return sum(c for c, _ in resumed), sum(r for _, r in resumed)

    def to_json(self) -> dict[str, Any]:
        continued, restarted = self.episodes
        return {
            "trial": self.trial,
            "workdir": str(self.plan.workdir),
            "finished": self.finished,
            "runs": [
                {
                    "run": r.run,
                    "exit": r.returncode,
                    "killed": r.killed,
                    "timed_out": r.timed_out,
                    "error": r.error,
                }
                for r in self.runs
            ],
            "faults_planned": [f.describe() for f in self.plan.faults],
            "faults_injected": _all(ChaosFault, self.faults_injected),
            "faults_missed": [
                {"fault": fault.describe(), "reason": reason} for fault, reason in self.missed
            ],
            "snapshots": {"committed": self.snapshots[PUBLISHED], "failed": self.snapshots[FAILED]},
            "episodes": {"continued": continued, "restarted": restarted},
            "violations": _all(Invariant, Counter(v.kind for v in self.violations)),
            "seconds": round(self.seconds, 2),
        }


def _all(kinds: type[ChaosFault] | type[Invariant], counts: Counter[Any]) -> dict[str, int]:
    """Every member of ``kinds`` with its count, zeros included."""
    return {kind.value: counts[kind] for kind in kinds}


@dataclass
class ChaosTally:
    seed: int
    config: str
    outcomes: list[TrialOutcome] = field(default_factory=list)

    def add(self, outcome: TrialOutcome) -> None:
        self.outcomes.append(outcome)

    @property
    def faults_injected(self) -> Counter[ChaosFault]:
        return sum((o.faults_injected for o in self.outcomes), Counter())

    @property
    def faults_planned(self) -> Counter[ChaosFault]:
        return Counter(f.kind for o in self.outcomes for f in o.plan.faults)

    @property
    def faults_missed(self) -> Counter[ChaosFault]:
        return Counter(f.kind for o in self.outcomes for f, _ in o.missed)

    @property
    def violations(self) -> list[Violation]:
        """Every violation, its subject prefixed with its trial."""
        return [
            replace(v, subject=f"trial-{o.trial} {v.subject}")
            for o in self.outcomes
            for v in o.violations
        ]

    @property
    def exit_code(self) -> int:
        """0 when every trial held every invariant, else 1."""
        return 1 if self.violations else 0

    @property
    def violations_by_kind(self) -> dict[Invariant, int]:
        found = Counter(v.kind for o in self.outcomes for v in o.violations)
        return {kind: found[kind] for kind in Invariant}

    def _sums(self) -> dict[str, int]:
        runs = [r for o in self.outcomes for r in o.runs]
        snapshots = sum((o.snapshots for o in self.outcomes), Counter[str]())
        episodes = [o.episodes for o in self.outcomes]
        return {
            "runs": len(runs),
            "runs_failed": sum(r.failed for r in runs),
            "runs_stopped_on_failed_groups": sum(r.stopped_on_failed_groups for r in runs),
            "runs_hung": sum(r.timed_out for r in runs),
            "trials_unfinished": sum(not o.finished for o in self.outcomes),
            "committed": snapshots[PUBLISHED],
            "failed": snapshots[FAILED],
            "continued": sum(c for c, _ in episodes),
            "restarted": sum(r for _, r in episodes),
        }

    def to_json(self) -> dict[str, Any]:
        sums = self._sums()
        return {
            "config": self.config,
            "seed": self.seed,
            "trials": len(self.outcomes),
            "runs": sums["runs"],
            "runs_failed": sums["runs_failed"],
            "runs_stopped_on_failed_groups": sums["runs_stopped_on_failed_groups"],
            "runs_hung": sums["runs_hung"],
            "trials_unfinished": sums["trials_unfinished"],
            "faults_injected": _all(ChaosFault, self.faults_injected),
            "faults_planned": _all(ChaosFault, self.faults_planned),
            "faults_missed": _all(ChaosFault, self.faults_missed),
            "snapshots": {"committed": sums["committed"], "failed": sums["failed"]},
            "episodes": {"continued": sums["continued"], "restarted": sums["restarted"]},
            "violations": {k.value: n for k, n in self.violations_by_kind.items()},
            "violation_details": [str(v) for v in self.violations],
            "per_trial": [o.to_json() for o in self.outcomes],
        }

    # --- tables ------------------------------------------------------------------------

    def tables(self, *, verbose: bool) -> list[Table]:
        return [self.summary_table(), *([self.trial_table()] if verbose else [])]

    def summary_table(self) -> Table:
        sums = self._sums()
        table = Table(title=f"rollpoint chaos: {len(self.outcomes)} trials, seed {self.seed}")
        table.add_column("")
        table.add_column("count", justify="right")
        table.add_row("trials", str(len(self.outcomes)))
        table.add_row("runs (first runs and reruns)", str(sums["runs"]))
        table.add_row("runs that failed by themselves", str(sums["runs_failed"]))
        table.add_row(
            "runs stopped on failed groups (exit 3)", str(sums["runs_stopped_on_failed_groups"])
        )
        table.add_row("runs that hung", str(sums["runs_hung"]))
        table.add_row("trials unfinished", str(sums["trials_unfinished"]), end_section=True)
        injected, planned = self.faults_injected, self.faults_planned
        for fault in ChaosFault:
            table.add_row(f"faults injected: {fault}", f"{injected[fault]} of {planned[fault]}")
        table.add_row(
            "faults injected: all", f"{sum(injected.values())} of {sum(planned.values())}"
        )
        table.add_row(
            "faults not injected (why: --verbose, --json)",
            str(sum(self.faults_missed.values())),
            end_section=True,
        )
        table.add_row("snapshots committed", str(sums["committed"]))
        table.add_row("snapshots failed", str(sums["failed"]), end_section=True)
        table.add_row("episodes continued", str(sums["continued"]))
        table.add_row("episodes restarted", str(sums["restarted"]), end_section=True)
        for invariant, n in self.violations_by_kind.items():
            name = f"violations {invariant.value} {invariant.name.lower().replace('_', ' ')}"
            table.add_row(name, str(n), style="bold red" if n else "green")
        return table

    def trial_table(self) -> Table:
        table = Table(title="trials")
        for column in ("trial", "exits", "faults injected", "not injected", "snapshots ok/failed"):
            table.add_column(column)
        for column in ("continued/restarted", "violations", "seconds"):
            table.add_column(column, justify="right")
        for o in self.outcomes:
            continued, restarted = o.episodes
            faults = ", ".join(
                f"{k} x{n}" if n > 1 else k for k, n in sorted(o.faults_injected.items())
            )
            table.add_row(
                str(o.trial),
                ",".join(str(r.returncode) for r in o.runs),
                faults or "-",
                "; ".join(f"{f.describe()}: {why}" for f, why in o.missed) or "-",
                f"{o.snapshots[PUBLISHED]}/{o.snapshots[FAILED]}",
                f"{continued}/{restarted}",
                str(len(o.violations)),
                f"{o.seconds:.1f}",
                style="bold red" if o.violations else None,
            )
        return table
