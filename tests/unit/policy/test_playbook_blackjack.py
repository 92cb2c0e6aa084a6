"""The blackjack playbook: status first, hit below a per-episode threshold, stand above it."""

from __future__ import annotations

import orjson
import pytest

from rollpoint.policy.playbook import FinalDecision, Mistake, Playbook, ToolCallDecision
from tests.unit.policy.fake_environments import (
    BLACKJACK_PROMPT,
    BLACKJACK_TOOLS,
    FakeBlackjack,
    ask,
    assistant_call,
    call_problem,
    run_episode,
    tool_result,
)

PERFECT = Playbook(seed=0, error_rate=0.0)


def hand(player_sum: int, *, done: bool = False, outcome: str | None = None) -> str:
    return orjson.dumps(
        {
            "player_sum": player_sum,
            "dealer_card": 10,
            "usable_ace": False,
            "done": done,
            "outcome": outcome,
        }
    ).decode()


def after_status(result: str) -> list[dict[str, object]]:
    return [
        {"role": "user", "content": BLACKJACK_PROMPT},
        assistant_call("c0", "blackjack_status", "{}"),
        tool_result("c0", result),
    ]


def threshold_of(playbook: Playbook, seed: int) -> int:
    """The sum at which this episode stops hitting, found by probing every sum."""
    for player_sum in range(4, 22):
        decision = ask(playbook, after_status(hand(player_sum)), BLACKJACK_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision)
        if decision.name == "blackjack_stand":
            return player_sum
    raise AssertionError("never stands")


def test_first_call_is_status() -> None:
    decision = ask(PERFECT, [{"role": "user", "content": BLACKJACK_PROMPT}], BLACKJACK_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert (decision.name, decision.arguments) == ("blackjack_status", "{}")


@pytest.mark.parametrize(("player_sum", "action"), [(8, "blackjack_hit"), (15, "blackjack_hit")])
def test_low_sum_hits_whatever_the_threshold(player_sum: int, action: str) -> None:
    for seed in range(20):
        decision = ask(PERFECT, after_status(hand(player_sum)), BLACKJACK_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision)
        assert decision.name == action


def test_high_sum_stands_whatever_the_threshold() -> None:
    for seed in range(20):
        decision = ask(PERFECT, after_status(hand(18)), BLACKJACK_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision)
        assert decision.name == "blackjack_stand"


def test_threshold_is_drawn_per_episode_from_16_17_18() -> None:
    thresholds = [threshold_of(PERFECT, seed) for seed in range(60)]
    assert set(thresholds) == {16, 17, 18}
    assert thresholds.count(17) > thresholds.count(16)


def test_threshold_holds_for_the_whole_episode() -> None:
    for seed in range(30):
        threshold = threshold_of(PERFECT, seed)
        # Later in the same episode (more turns played), the same sums give the same moves.
        messages = [
            *after_status(hand(12)),
            assistant_call("c1", "blackjack_hit", "{}"),
            tool_result("c1", hand(threshold - 1)),
        ]
        decision = ask(PERFECT, messages, BLACKJACK_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision) and decision.name == "blackjack_hit"
        messages[-1] = tool_result("c1", hand(threshold))
        decision = ask(PERFECT, messages, BLACKJACK_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision) and decision.name == "blackjack_stand"


@pytest.mark.parametrize(("outcome", "word"), [("win", "won"), ("lose", "lost"), ("draw", "drew")])
def test_done_hand_ends_with_the_outcome(outcome: str, word: str) -> None:
    messages = after_status(hand(20, done=True, outcome=outcome))
    decision = ask(PERFECT, messages, BLACKJACK_TOOLS)
    assert isinstance(decision, FinalDecision)
    assert word in decision.text and outcome in decision.text


def test_failed_move_is_decided_again_from_the_last_good_hand() -> None:
    messages = [
        *after_status(hand(12)),
        assistant_call("c1", "blackjack_hit", "{"),
        tool_result("c1", "error: arguments are not valid JSON"),
    ]
    decision = ask(PERFECT, messages, BLACKJACK_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert (decision.name, decision.arguments) == ("blackjack_hit", "{}")


def test_refused_move_without_error_prefix_is_decided_from_the_last_hand() -> None:
    messages = [
        *after_status(hand(12)),
        assistant_call("c1", "blackjack_double_down", "{}"),
        tool_result("c1", "unknown tool 'blackjack_double_down'"),
    ]
    decision = ask(PERFECT, messages, BLACKJACK_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert (decision.name, decision.arguments) == ("blackjack_hit", "{}")


def test_unreadable_hand_asks_for_status_again() -> None:
    decision = ask(PERFECT, after_status("the table is closed"), BLACKJACK_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert decision.name == "blackjack_status"


def test_full_hands_reach_a_final_message_with_the_outcome() -> None:
    outcomes = set()
    for seed in range(30):
        table = FakeBlackjack(seed=seed)
        episode = run_episode(
            PERFECT, prompt=BLACKJACK_PROMPT, tools=BLACKJACK_TOOLS, environment=table, seed=seed
        )
        assert episode.calls[0].name == "blackjack_status"
        assert episode.final is not None and table.outcome is not None
        assert table.outcome in episode.final
        outcomes.add(table.outcome)
    assert {"win", "lose"} <= outcomes


def test_error_rate_one_makes_every_move_wrong() -> None:
    always_wrong = Playbook(seed=0, error_rate=1.0)
    kinds = set()
    for seed in range(30):
        for messages in ([{"role": "user", "content": BLACKJACK_PROMPT}], after_status(hand(12))):
            decision = ask(always_wrong, messages, BLACKJACK_TOOLS, seed=seed)
            assert isinstance(decision, ToolCallDecision)
            assert call_problem(decision.name, decision.arguments, BLACKJACK_TOOLS) is not None
            kinds.add(decision.mistake)
    # A call without arguments can only be malformed or aimed at a tool that does not exist.
    assert kinds == {Mistake.MALFORMED_JSON, Mistake.UNKNOWN_TOOL}
