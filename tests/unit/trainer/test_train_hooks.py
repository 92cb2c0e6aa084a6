"""The simulated trainer reports metrics computed from the batch it was given."""

from __future__ import annotations

import pytest

from rollpoint.protocol.errors import ConfigError
from rollpoint.trainer.train_hooks import SimulatedTrainer, TrainSample


def sample(reward: float, advantage: float) -> TrainSample:
    return TrainSample(
        task_id="t",
        group_id="t-g0",
        row=0,
        group_size=2,
        rollout_id="r1",
        attempt=0,
        reward=reward,
        advantage=advantage,
        messages=[],
        model_calls=[],
        turns=1,
        finish_reason="final",
    )


async def test_metrics_summarise_the_batch() -> None:
    metrics = await SimulatedTrainer().train_step(
        1, [sample(1.0, 1.0), sample(0.0, -1.0), sample(0.5, 0.0)]
    )
    assert metrics["loss"] == pytest.approx(2 / 3)
    assert metrics["reward_mean"] == pytest.approx(0.5)
    assert metrics["zero_advantage_share"] == pytest.approx(1 / 3)
    assert metrics["samples"] == 3


def test_a_negative_step_time_is_refused() -> None:
    with pytest.raises(ConfigError):
        SimulatedTrainer(-1)
