"""Policy lag: each untrained row's oldest version, the dispatch hold, and a sample's lag —
a continued episode's pre-crash turns count, a call that spanned an update counts its oldest
segment, and what a snapshot saves brings a restored run's rows back with their versions."""

from __future__ import annotations

import asyncio

from rollpoint.protocol.episode import ModelCall, RunReply
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.token_data import TokenSegment
from rollpoint.trainer.policy_lag import PolicyLag, sample_lag
from rollpoint.trainer.train_hooks import TrainSample


def call(turn: int, attempt: int, version: int, *segments: tuple[int, int]) -> ModelCall:
    return ModelCall(
        turn=turn,
        attempt=attempt,
        response={"role": "assistant", "content": "x"},
        policy_version=version,
        segments=[TokenSegment(policy_version=v, tokens=n) for v, n in segments] or None,
    )


def reply(rollout_id: str, attempt: int, calls: list[ModelCall], row: int = 0) -> RunReply:
    return RunReply(
        episode=EpisodeId(rollout_id=rollout_id, attempt=attempt),
        task_id="t",
        group_id="t-g0",
        row=row,
        reward=1.0,
        messages=[],
        model_calls=calls,
        turns=len(calls),
        finish_reason="final",
    )


def test_a_continued_episodes_pre_crash_turns_and_oldest_segments_count() -> None:
    # Turn 0 before the crash (attempt 0, version 1); turn 1 continued across an update.
    calls = [call(0, 0, 1), call(1, 1, 3, (2, 5), (3, 9)), call(2, 1, 4)]
    sample = TrainSample.from_reply(
        reply("r1", 1, calls), advantage=0.0, group_size=2, live=4, max_lag=2
    )
    assert [t.policy_lag for t in sample.trajectory] == [3, 2, 0]
    assert sample.policy_lag == 3 == sample_lag(calls, 4) and sample.stale
    unbounded = TrainSample.from_reply(reply("r1", 1, calls), advantage=0.0, group_size=2, live=4)
    assert not unbounded.stale


async def test_the_hold_follows_the_oldest_untrained_row_and_a_restore_keeps_it() -> None:
    live = [0]
    busy = [True]
    lag = PolicyLag(1, live=lambda: live[0], busy=lambda: busy[0])
    lag.sent("t-g0", 0, "r1")
    assert lag.is_open  # sent under the live version
    live[0] = 1
    assert not lag.is_open  # one version behind now, and the run has other work
    busy[0] = False
    assert lag.is_open  # nothing else would ever move: holding would stall the run
    busy[0] = True
    # A restore: the row comes back from the snapshot's document with its version.
    restored = PolicyLag(1, live=lambda: live[0], busy=lambda: True)
    restored.load(lag.to_doc())
    restored.sent("t-g0", 0, "r1")  # its continued try (same rollout) keeps version 0
    assert restored.oldest() == 0
    restored.finished(reply("r1", 1, [call(0, 0, 0), call(1, 1, 1)]))
    assert restored.oldest() == 0 and not restored.is_open
    waiter = asyncio.ensure_future(restored.wait_open())
    await asyncio.sleep(0)
    assert not waiter.done()
    restored.settled("t-g0", 2)  # trained
    await asyncio.wait_for(waiter, 1)
    assert restored.holds == 1
    # A fresh try of a row (a new rollout id) starts over at the live version.
    restored.sent("t-g0", 1, "r2")
    restored.sent("t-g0", 1, "r3")
    assert restored.oldest() == 1


async def test_a_restored_run_of_the_trainers_versions_waits_for_it_to_say_one() -> None:
    lag = PolicyLag(None, live=lambda: 0, busy=lambda: True, awaiting_trainer=True)
    waiter = asyncio.ensure_future(lag.wait_open())
    await asyncio.sleep(0)
    assert not waiter.done()
    lag.trainer_reported()
    await asyncio.wait_for(waiter, 1)
    assert lag.holds == 0  # not a hold for the bound
