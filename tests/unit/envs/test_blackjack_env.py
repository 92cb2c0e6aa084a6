"""The blackjack environment on the real Gymnasium ``Blackjack-v1``."""

from __future__ import annotations

import json
from typing import Any

import gymnasium as gym
import orjson
import pytest

from rollpoint.envs.base import ToolArgumentError
from rollpoint.envs.blackjack import BlackjackEnvironment, BlackjackState
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import EpisodeError, InvalidCheckpointStateError
from rollpoint.protocol.participant import CheckpointMode

env = BlackjackEnvironment()
PROMPT = (
    "Play one hand of blackjack. Call blackjack_status to see your hand, "
    "then blackjack_hit or blackjack_stand until the hand is over."
)


def task(seed: int) -> TaskRow:
    return TaskRow(
        task_id=f"bj-{seed}", environment="blackjack", prompt=PROMPT, params={"seed": seed}
    )


def tool(state: BlackjackState, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(env.call(state, name, {}))
    return out


def reference_game(seed: int) -> Any:
    game = gym.make("Blackjack-v1", natural=False, sab=False)
    game.reset(seed=seed)
    return game


def test_tasks_are_deterministic_and_use_the_documented_prompt() -> None:
    tasks = env.make_tasks(10, seed=4)
    assert tasks == env.make_tasks(10, seed=4)
    assert tasks != env.make_tasks(10, seed=5)
    assert tasks[3].task_id == "blackjack-0003"
    assert {t.prompt for t in tasks} == {PROMPT}
    assert len({t.params["seed"] for t in tasks}) == 10
    assert env.checkpoint_mode is CheckpointMode.TURN
    tools: list[dict[str, Any]] = env.tools()
    assert [t["function"]["name"] for t in tools] == [
        "blackjack_status",
        "blackjack_hit",
        "blackjack_stand",
    ]


def test_status_reports_the_gymnasium_observation_with_the_documented_keys() -> None:
    for seed in range(20):
        state = env.start(task(seed))
        player_sum, dealer_card, usable_ace = reference_game(seed).unwrapped._get_obs()
        raw = env.call(state, "blackjack_status", {})
        assert list(json.loads(raw)) == [
            "player_sum",
            "dealer_card",
            "usable_ace",
            "done",
            "outcome",
        ]
        assert json.loads(raw) == {
            "player_sum": player_sum,
            "dealer_card": dealer_card,
            "usable_ace": bool(usable_ace),
            "done": False,
            "outcome": None,
        }


def test_hit_and_stand_follow_the_real_game_and_map_the_reward() -> None:
    expected_outcome = {1.0: "win", 0.0: "draw", -1.0: "lose"}
    rewards = {"win": 1.0, "draw": 0.5, "lose": 0.0}
    seen = set()
    for seed in range(60):
        state = env.start(task(seed))
        game = reference_game(seed)
        # Hit below 14 then stand: the same actions on both games.
        while True:
            action = 1 if tool(state, "blackjack_status")["player_sum"] < 14 else 0
            reply = tool(state, "blackjack_hit" if action else "blackjack_stand")
            obs, reward, terminated, _, _ = game.step(action)
            assert reply["player_sum"] == obs[0]
            if terminated:
                break
            assert reply["done"] is False
        assert reply["done"] is True
        assert reply["outcome"] == expected_outcome[float(reward)]
        verdict = env.verify(state, task(seed), "done")
        assert verdict.reward == rewards[reply["outcome"]]
        assert verdict.detail["outcome"] == reply["outcome"]
        seen.add(reply["outcome"])
    assert seen == {"win", "draw", "lose"}


def test_playing_after_the_hand_is_over_is_a_tool_error() -> None:
    state = env.start(task(1))
    final = tool(state, "blackjack_stand")
    assert final["done"] is True
    for name in ("blackjack_hit", "blackjack_stand"):
        with pytest.raises(ToolArgumentError, match=f"{name}: the hand is over"):
            env.call(state, name, {})
    assert tool(state, "blackjack_status") == final


def test_tools_take_no_arguments() -> None:
    state = env.start(task(1))
    with pytest.raises(ToolArgumentError, match="unexpected argument 'cards'"):
        env.call(state, "blackjack_hit", {"cards": 2})
    assert tool(state, "blackjack_status")["done"] is False


def test_an_unfinished_hand_earns_nothing() -> None:
    state = env.start(task(2))
    assert env.verify(state, task(2), None).reward == 0.0


def test_start_refuses_a_task_without_a_seed() -> None:
    bad = TaskRow(task_id="bj-x", environment="blackjack", prompt=PROMPT, params={})
    with pytest.raises(EpisodeError, match="bj-x"):
        env.start(bad)


def hit_until_done(state: BlackjackState) -> list[dict[str, Any]]:
    replies = []
    while not (reply := tool(state, "blackjack_hit"))["done"]:
        replies.append(reply)
    return [*replies, reply]


def test_export_restore_deals_the_same_next_cards() -> None:
    for seed in range(40):
        original = env.start(task(seed))
        first = tool(original, "blackjack_hit")
        exported = env.export_state(original)
        restored = env.restore_state(task(seed), orjson.loads(orjson.dumps(exported)))
        assert tool(restored, "blackjack_status") == first
        if first["done"]:
            with pytest.raises(ToolArgumentError):
                env.call(restored, "blackjack_hit", {})
            continue
        assert hit_until_done(restored) == hit_until_done(original)
        assert restored.game.player == original.game.player
        assert env.verify(restored, task(seed), None) == env.verify(original, task(seed), None)


def test_export_restore_then_stand_plays_the_same_dealer_hand() -> None:
    played = 0
    for seed in range(40):
        original = env.start(task(seed))
        # One hit first, so the generator has moved past where a reset would leave it.
        if tool(original, "blackjack_hit")["done"]:
            continue
        restored = env.restore_state(task(seed), env.export_state(original))
        assert tool(restored, "blackjack_stand") == tool(original, "blackjack_stand")
        assert restored.game.dealer == original.game.dealer
        played += 1
    assert played >= 10


def bad_state(**change: Any) -> dict[str, Any]:
    exported = env.export_state(env.start(task(3)))
    return {**exported, **change}


@pytest.mark.parametrize(
    ("exported", "message"),
    [
        (bad_state(player=[11, 2]), "'player.0'"),
        (bad_state(dealer=[5]), "'dealer'"),
        (bad_state(outcome="maybe"), "'outcome'"),
        (bad_state(surprise=1), "'surprise'"),
        (
            bad_state(rng={**bad_state()["rng"], "bit_generator": "MT19937"}),
            "bit generator 'MT19937'",
        ),
        (bad_state(rng={**bad_state()["rng"], "state": "nope"}), "bad generator state"),
    ],
)
def test_restore_refuses_malformed_state(exported: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidCheckpointStateError, match=message):
        env.restore_state(task(3), exported)
