"""Retention of snapshots and train checkpoints: one decision, so neither strands the other.

A snapshot is usable only with a durable train checkpoint at a step in its span
``[committed_step, train_step]`` (the finished queue's committed step at the cut, the trainer's step at the
cut), and a train checkpoint is worth keeping only with a snapshot that composes with it.
Pruning each by its own count broke that: while snapshot writes failed (a full disk) the
train checkpoints moved past every kept snapshot, and the rerun found nothing to resume.

:func:`plan` keeps, from what exists:

- snapshots: the ``keep_snapshots`` newest, every pinned or protected one, and — when none
  of those composes with an existing train checkpoint — the newest one that does;
- train checkpoints: the ``keep_checkpoints`` newest, and for every kept snapshot the
  newest checkpoint in its span (the one a restore would use).

:func:`checkpoints_to_keep` is the trainer's question when it writes a checkpoint: "newest"
counts along its own line of steps. A run that resumed at step *n* from an older snapshot
(the newer ones damaged) finds the checkpoints of the abandoned steps after *n* still
there: they stay only while a kept snapshot composes with them, and never outrank the
checkpoint just written or the ones before it (counted as the newest, they got the rerun's
own checkpoints deleted, and with them every snapshot it published: a chaos trial's run lost).

The snapshot store applies the snapshot half when it publishes, the train checkpoint store
the checkpoint half when it saves; both ask :func:`plan` with the same inputs. A failed
snapshot write prunes nothing (nothing is published). It does not delete anything itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A loadable snapshot, newest first in a list, and the steps it composes with."""

    snapshot_id: str
    committed_step: int
    """The finished queue's committed step at the cut (0 for a manifest older than schema 4)."""
    train_step: int

    def composes_with(self, step: int) -> bool:
        return self.committed_step <= step <= self.train_step


@dataclass(frozen=True)
class Plan:
    snapshots: frozenset[str]
    checkpoints: frozenset[int]


def plan(
    snapshots: Sequence[Span],
    checkpoints: Iterable[int],
    *,
    keep_snapshots: int,
    keep_checkpoints: int,
    protect: Iterable[str] = (),
) -> Plan:
    """What to keep. ``snapshots`` newest first; ``checkpoints`` the durable steps present
    (step 0 composes implicitly: it needs no file)."""
    steps = sorted(set(checkpoints))
    present = {0, *steps}
    kept = {s.snapshot_id for s in snapshots[:keep_snapshots]} | set(protect)
    chosen = [s for s in snapshots if s.snapshot_id in kept]
    if not any(any(s.composes_with(step) for step in present) for s in chosen):
        usable = next((s for s in snapshots if any(s.composes_with(t) for t in present)), None)
        if usable is not None:
            kept.add(usable.snapshot_id)
            chosen.append(usable)
    kept_steps = set(steps[-keep_checkpoints:]) if keep_checkpoints > 0 else set()
    for span in chosen:
        inside = [step for step in steps if span.composes_with(step)]
        if inside:
            kept_steps.add(inside[-1])
    return Plan(frozenset(kept), frozenset(kept_steps))


def checkpoints_to_keep(
    snapshots: Sequence[Span],
    checkpoints: Iterable[int],
    written: int,
    *,
    keep_snapshots: int,
    keep_checkpoints: int,
    protect: Iterable[str] = (),
) -> frozenset[int]:
    """The train checkpoints to keep once the one of step ``written`` is: :func:`plan` over
    the steps up to ``written`` (the run's own line, ``written`` always among them), plus
    each later step a kept snapshot composes with (a line the run abandoned)."""
    protect = frozenset(protect)
    steps = set(checkpoints)
    own = plan(
        snapshots,
        {s for s in steps if s <= written} | {written},
        keep_snapshots=keep_snapshots,
        keep_checkpoints=keep_checkpoints,
        protect=protect,
    ).checkpoints
    later = plan(
        snapshots, steps, keep_snapshots=keep_snapshots, keep_checkpoints=0, protect=protect
    ).checkpoints
    return own | {written} | {s for s in later if s > written}
