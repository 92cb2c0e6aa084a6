"""The workplace playbook: create each event, search each, send each email, then summarise."""

from __future__ import annotations

from collections import Counter

import orjson

from rollpoint.policy.playbook import FinalDecision, Mistake, Playbook, ToolCallDecision
from tests.unit.policy.fake_environments import (
    DEMO,
    MAIL,
    SYNC,
    WORKPLACE_TOOLS,
    FakeWorkplace,
    ask,
    assistant_call,
    call_problem,
    run_episode,
    tool_result,
    workplace_prompt,
)

PROMPT = workplace_prompt([SYNC, DEMO], [MAIL])
PERFECT = Playbook(seed=0, error_rate=0.0)


def test_error_free_run_makes_exactly_the_right_calls_in_order() -> None:
    calendar = FakeWorkplace()
    episode = run_episode(PERFECT, prompt=PROMPT, tools=WORKPLACE_TOOLS, environment=calendar)

    steps = [(c.name, orjson.loads(c.arguments)) for c in episode.calls]
    assert steps[:4] == [
        ("calendar_create_event", SYNC),
        ("calendar_create_event", DEMO),
        ("calendar_search_events", {"query": "Team sync"}),
        ("calendar_search_events", {"query": "Demo"}),
    ]
    assert steps[4][0] == "email_send"
    assert {k: steps[4][1][k] for k in ("to", "subject")} == MAIL
    assert isinstance(steps[4][1]["body"], str) and steps[4][1]["body"]
    assert len(steps) == 5
    assert calendar.events == [SYNC, DEMO]
    assert [{k: m[k] for k in ("to", "subject")} for m in calendar.sent] == [MAIL]
    assert episode.final is not None
    assert "Team sync" in episode.final and "Demo" in episode.final
    assert "ana@example.com" in episode.final
    assert all(c.mistake is None for c in episode.calls)


def test_prompt_without_emails_sends_none() -> None:
    calendar = FakeWorkplace()
    episode = run_episode(
        PERFECT, prompt=workplace_prompt([SYNC], []), tools=WORKPLACE_TOOLS, environment=calendar
    )
    assert [c.name for c in episode.calls] == ["calendar_create_event", "calendar_search_events"]
    assert calendar.sent == []
    assert episode.final is not None


def test_failed_step_is_retried_correctly_on_the_next_turn() -> None:
    create = orjson.dumps(SYNC).decode()
    for error_text in ("error: calendar is busy", "Error: database locked", "  ERROR 500"):
        messages = [
            {"role": "user", "content": PROMPT},
            assistant_call("c1", "calendar_create_event", create),
            tool_result("c1", error_text),
        ]
        decision = ask(PERFECT, messages, WORKPLACE_TOOLS)
        assert isinstance(decision, ToolCallDecision)
        assert decision.name == "calendar_create_event"
        assert orjson.loads(decision.arguments) == SYNC


def test_wrong_call_that_failed_is_followed_by_the_correct_call() -> None:
    messages = [
        {"role": "user", "content": PROMPT},
        assistant_call("c1", "calendar_create_event", '{"title": "Team sy'),
        tool_result("c1", "error: arguments are not valid JSON"),
        assistant_call("c2", "calendar_delete_everything", "{}"),
        tool_result("c2", "error: unknown tool calendar_delete_everything"),
    ]
    decision = ask(PERFECT, messages, WORKPLACE_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert (decision.name, orjson.loads(decision.arguments)) == ("calendar_create_event", SYNC)


def test_wrong_call_is_retried_even_when_the_refusal_does_not_say_error() -> None:
    without_date = {k: v for k, v in SYNC.items() if k != "date"}
    as_words = {**SYNC, "duration_minutes": "thirty"}
    for wrong in (without_date, as_words):
        messages = [
            {"role": "user", "content": PROMPT},
            assistant_call("c1", "calendar_create_event", orjson.dumps(wrong).decode()),
            tool_result("c1", "calendar_create_event: missing required argument 'date'"),
        ]
        decision = ask(PERFECT, messages, WORKPLACE_TOOLS)
        assert isinstance(decision, ToolCallDecision)
        assert (decision.name, orjson.loads(decision.arguments)) == ("calendar_create_event", SYNC)


def test_unanswered_call_counts_as_not_done() -> None:
    messages = [
        {"role": "user", "content": PROMPT},
        assistant_call("c1", "calendar_create_event", orjson.dumps(SYNC).decode()),
    ]
    decision = ask(PERFECT, messages, WORKPLACE_TOOLS)
    assert isinstance(decision, ToolCallDecision)
    assert orjson.loads(decision.arguments) == SYNC


def test_error_rate_one_makes_every_call_wrong_with_every_kind_of_mistake() -> None:
    always_wrong = Playbook(seed=3, error_rate=1.0)
    # Conversations at each stage of the plan: nothing done, events created, all searched.
    calendar = FakeWorkplace()
    perfect = run_episode(PERFECT, prompt=PROMPT, tools=WORKPLACE_TOOLS, environment=calendar)
    stages = [perfect.messages[: 1 + 2 * done] for done in range(5)]
    kinds: Counter[Mistake] = Counter()
    for seed in range(40):
        for messages in stages:
            decision = ask(always_wrong, messages, WORKPLACE_TOOLS, seed=seed)
            assert isinstance(decision, ToolCallDecision)
            assert call_problem(decision.name, decision.arguments, WORKPLACE_TOOLS) is not None
            assert decision.mistake is not None
            kinds[decision.mistake] += 1
    assert set(kinds) == set(Mistake)


def test_wrong_type_on_create_sends_duration_as_words() -> None:
    always_wrong = Playbook(seed=0, error_rate=1.0)
    messages = [{"role": "user", "content": PROMPT}]
    for seed in range(200):
        decision = ask(always_wrong, messages, WORKPLACE_TOOLS, seed=seed)
        assert isinstance(decision, ToolCallDecision)
        if decision.mistake is Mistake.WRONG_TYPE:
            assert orjson.loads(decision.arguments)["duration_minutes"] == "thirty"
            return
    raise AssertionError("no wrong-type mistake in 200 seeds")


def test_episodes_with_mistakes_still_finish_with_no_duplicates() -> None:
    sloppy = Playbook(seed=11, error_rate=0.3)
    mistakes = 0
    for seed in range(20):
        calendar = FakeWorkplace()
        episode = run_episode(
            sloppy, prompt=PROMPT, tools=WORKPLACE_TOOLS, environment=calendar, seed=seed
        )
        assert episode.final is not None
        assert calendar.events == [SYNC, DEMO]
        assert len(calendar.sent) == 1
        mistakes += sum(c.mistake is not None for c in episode.calls)
    assert mistakes > 0


def test_prompt_with_nothing_to_do_gets_a_final_message() -> None:
    decision = ask(PERFECT, [{"role": "user", "content": "Hello there"}], WORKPLACE_TOOLS)
    assert isinstance(decision, FinalDecision)
    assert decision.text
