"""What a run says of itself: a view while it runs, and a summary when it ends.

Owns :class:`TrainerStats` (a point-in-time view, read by progress displays while the run
runs) and :class:`RunSummary` (what :meth:`~rollpoint.trainer.trainer.Trainer.run` returns).
The trainer loop counts; these only carry its counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollpoint.protocol.model_base import StrictModel


@dataclass(frozen=True, slots=True)
class TrainerStats:
    """A point-in-time view of a run, for progress displays."""

    episodes_finished: int
    turns: int
    reward_sum: float
    train_steps: int
    in_flight: int
    failed_groups: int
    groups_total: int
    groups_trained: int
    policy_version: int

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.episodes_finished if self.episodes_finished else 0.0


class RunSummary(StrictModel):
    episodes: int
    turns: int
    train_steps: int
    failed_groups: dict[str, str]
    """Group id → why it failed."""
    mean_reward: float
    elapsed_s: float
