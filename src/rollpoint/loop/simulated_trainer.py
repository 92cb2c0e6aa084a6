"""The built-in loop's policy update: a simulated GRPO step that learns nothing.

Owns :class:`SimulatedTrainer`, the update ``rollpoint run`` applies to each batch: it takes
the configured step time (``train.step_seconds``) and reports metrics computed honestly from
the batch it was given. It is a :class:`~rollpoint.trainer.TrainHooks` like any trainer's
own, and the loop calls it through the façade's batches exactly as ``examples/own_trainer.py``
calls its stand-in.
"""

from __future__ import annotations

import asyncio
import math

from rollpoint.protocol.errors import ConfigError
from rollpoint.trainer import TrainSample


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
