"""Train hooks: the seam between rollpoint's loop and whatever updates the policy.

Owns the :class:`TrainHooks` protocol a trainer implements (one async ``train_step`` per
batch of whole prompt groups), the :class:`TrainSample` it receives, and the built-in
:class:`SimulatedTrainer`, which does no learning: it sleeps for the configured step time
and reports metrics computed from the batch it was given. It does not pick batches
(:mod:`.trainer_loop`) or compute advantages (:mod:`.grpo`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Protocol

from pydantic import JsonValue

from rollpoint.protocol.episode import ModelCall, RunReply
from rollpoint.protocol.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One sealed rollout, ready to train on."""

    task_id: str
    group_id: str
    row: int
    group_size: int
    rollout_id: str
    attempt: int
    reward: float
    advantage: float
    """GRPO advantage within its group."""
    messages: list[dict[str, JsonValue]]
    model_calls: list[ModelCall]
    turns: int
    finish_reason: str

    @classmethod
    def from_reply(cls, reply: RunReply, *, advantage: float, group_size: int) -> TrainSample:
        return cls(
            task_id=reply.task_id,
            group_id=reply.group_id,
            row=reply.row,
            group_size=group_size,
            rollout_id=reply.episode.rollout_id,
            attempt=reply.episode.attempt,
            reward=reply.reward,
            advantage=advantage,
            messages=reply.messages,
            model_calls=reply.model_calls,
            turns=reply.turns,
            finish_reason=reply.finish_reason,
        )


class TrainHooks(Protocol):
    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        """Update the policy on ``batch`` (whole prompt groups); return metrics to log."""
        ...


class SimulatedTrainer:
    """A trainer that takes ``step_seconds`` per step and learns nothing.

    Its metrics are honest summaries of the batch: ``loss`` is the mean absolute
    advantage (what a policy-gradient step with unit log-prob gradients would weigh),
    ``reward_mean`` the batch's mean reward, ``zero_advantage_share`` the share of
    samples from groups with no signal.
    """

    def __init__(self, step_seconds: float = 0.0) -> None:
        if step_seconds < 0:
            raise ConfigError(f"simulated trainer: step_seconds must be >= 0, got {step_seconds}")
        self.step_seconds = step_seconds

    async def train_step(self, step: int, batch: list[TrainSample]) -> dict[str, float]:
        if self.step_seconds:
            await asyncio.sleep(self.step_seconds)
        n = len(batch)
        if n == 0:
            return {"loss": 0.0, "reward_mean": 0.0, "zero_advantage_share": 0.0, "samples": 0.0}
        return {
            "loss": math.fsum(abs(s.advantage) for s in batch) / n,
            "reward_mean": math.fsum(s.reward for s in batch) / n,
            "zero_advantage_share": sum(1 for s in batch if s.advantage == 0.0) / n,
            "samples": float(n),
        }
