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
