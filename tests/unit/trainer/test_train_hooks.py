"""The train hooks' samples (tokens included), and the built-in loop's simulated update."""

from __future__ import annotations

import pytest

from rollpoint.loop import SimulatedTrainer
from rollpoint.protocol.errors import ConfigError
from rollpoint.trainer.train_hooks import TrainSample


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


def test_a_sample_carries_each_turns_tokens_and_rebuilds_the_sequence() -> None:
    from rollpoint.protocol.episode import ModelCall, RunReply
    from rollpoint.protocol.ids import EpisodeId
    from rollpoint.protocol.token_data import TokenTrace, as_float32, context_after
    from rollpoint.trainer.train_hooks import token_segments

    first = TokenTrace.build(
        engine="vllm",
        completion_ids=[7, 8],
        completion_logprobs=[-0.5, -0.25],
        prompt_ids=[1, 2],
        context=None,
    )
    second = TokenTrace.build(
        engine="vllm",
        completion_ids=[9],
        completion_logprobs=[-0.1],
        prompt_ids=[1, 2, 7, 8, 3],
        context=context_after([first]),
    )
    calls = [
        ModelCall(
            turn=0,
            attempt=0,
            response={},
            policy_version=4,
            tokens=first,
            completion_id="c0",
            finish_reason="tool_calls",
        ),
        ModelCall(turn=1, attempt=1, response={}, policy_version=5, tokens=second),
    ]
    reply = RunReply(
        episode=EpisodeId(rollout_id="r1", attempt=1),
        task_id="t",
        group_id="g",
        row=0,
        reward=1.0,
        messages=[],
        model_calls=calls,
        turns=2,
        finish_reason="final",
    )
    sample = TrainSample.from_reply(reply, advantage=0.0, group_size=1)
    a, b = sample.trajectory
    assert (a.turn, a.attempt, a.policy_version, a.completion_id) == (0, 0, 4, "c0")
    assert (b.turn, b.attempt, b.policy_version) == (1, 1, 5)
    assert a.completion_token_ids == [7, 8] and a.completion_logprobs == [-0.5, -0.25]
    assert (b.prompt_token_ids, b.prompt_is_suffix) == ([3], True)
    assert b.completion_logprobs == as_float32([-0.1])
    assert token_segments(sample.trajectory) == [([1, 2, 7, 8, 3, 9], [0, 0, 1, 1, 0, 1])]
    assert a.to_json()["completion_token_ids"] == [7, 8]
