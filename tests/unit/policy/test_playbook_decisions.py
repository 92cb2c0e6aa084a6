"""Decisions in general: determinism, recognising the environment, never crashing."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rollpoint.policy.playbook import FinalDecision, Playbook, ToolCallDecision
from tests.unit.policy.fake_environments import (
    BLACKJACK_PROMPT,
    BLACKJACK_TOOLS,
    MAIL,
    SYNC,
    WORKPLACE_TOOLS,
    ask,
    assistant_call,
    request,
    tool_result,
    tool_spec,
    workplace_prompt,
)

SLOPPY = Playbook(seed=5, error_rate=0.5)
WORKPLACE_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": workplace_prompt([SYNC], [MAIL])},
    assistant_call("call_a", "calendar_create_event", '{"title": "Team sync"}'),
    tool_result("call_a", "error: missing argument date"),
]

_CROSS_PROCESS = """
import sys
from rollpoint.policy.openai_wire import ChatCompletionRequest
from rollpoint.policy.playbook import Playbook
playbook = Playbook(seed=5, error_rate=0.5)
for line in sys.stdin:
    print(repr(playbook.decide(ChatCompletionRequest.model_validate_json(line))))
"""


def test_same_request_gets_the_same_decision() -> None:
    for seed in range(20):
        first = ask(SLOPPY, WORKPLACE_TURN, WORKPLACE_TOOLS, seed=seed)
        assert ask(SLOPPY, WORKPLACE_TURN, WORKPLACE_TOOLS, seed=seed) == first
        assert (
            Playbook(seed=5, error_rate=0.5).decide(
                request(WORKPLACE_TURN, WORKPLACE_TOOLS, seed=seed)
            )
            == first
        )


def test_same_request_gets_the_same_decision_in_another_process() -> None:
    requests = [request(WORKPLACE_TURN, WORKPLACE_TOOLS, seed=seed) for seed in range(10)]
    expected = [repr(SLOPPY.decide(r)) for r in requests]
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", _CROSS_PROCESS],
            input="\n".join(r.model_dump_json() for r in requests),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            timeout=30,
        )
        assert out.stdout.splitlines() == expected


def test_request_seed_and_policy_seed_change_the_decision() -> None:
    by_request_seed = {
        repr(ask(SLOPPY, WORKPLACE_TURN, WORKPLACE_TOOLS, seed=s)) for s in range(20)
    }
    assert len(by_request_seed) > 1
    by_policy_seed = {
        repr(ask(Playbook(seed=s, error_rate=0.5), WORKPLACE_TURN, WORKPLACE_TOOLS))
        for s in range(20)
    }
    assert len(by_policy_seed) > 1


def test_fields_the_playbook_does_not_read_change_nothing() -> None:
    plain = ask(SLOPPY, WORKPLACE_TURN, WORKPLACE_TOOLS, seed=3)
    echoed = [dict(m) for m in WORKPLACE_TURN]
    # What a client adds when it echoes an assistant message back.
    echoed[2] |= {"refusal": None, "annotations": [], "audio": None}
    noisy = ask(
        SLOPPY, echoed, WORKPLACE_TOOLS, seed=3, temperature=0.7, stream=True, model="other"
    )
    assert noisy == plain


def test_tool_call_ids_differ_from_turn_to_turn() -> None:
    first = ask(SLOPPY, [{"role": "user", "content": BLACKJACK_PROMPT}], BLACKJACK_TOOLS)
    assert isinstance(first, ToolCallDecision)
    later = ask(
        SLOPPY,
        [
            {"role": "user", "content": BLACKJACK_PROMPT},
            assistant_call(first.call_id, first.name, first.arguments),
            tool_result(first.call_id, "error: try again"),
        ],
        BLACKJACK_TOOLS,
    )
    assert isinstance(later, ToolCallDecision)
    assert later.call_id != first.call_id


def test_unknown_tools_are_played_by_the_generic_playbook() -> None:
    tools = [tool_spec("weather_lookup", {"city": "string"})]
    decision = ask(SLOPPY, [{"role": "user", "content": "What is the weather?"}], tools)
    assert isinstance(decision, ToolCallDecision) and decision.name == "weather_lookup"


def test_unknown_tools_with_no_tool_turns_get_a_polite_final_message() -> None:
    tools = [tool_spec("weather_lookup", {"city": "string"})]
    playbook = Playbook(seed=5, error_rate=0.5, tool_turns=0)
    decision = ask(playbook, [{"role": "user", "content": "What is the weather?"}], tools)
    assert isinstance(decision, FinalDecision) and "Sorry" in decision.text


def test_chat_without_tools_or_question_gets_a_polite_final_message() -> None:
    decision = ask(SLOPPY, [{"role": "user", "content": "Tell me a story."}], None)
    assert isinstance(decision, FinalDecision) and decision.text


def test_tool_choice_none_hides_the_tools() -> None:
    decision = ask(
        SLOPPY, [{"role": "user", "content": BLACKJACK_PROMPT}], BLACKJACK_TOOLS, tool_choice="none"
    )
    assert isinstance(decision, FinalDecision)


_text = st.text(max_size=60)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": _text}),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "tool_call_id": st.sampled_from(["a", "b"]), "content": _text}
    ),
    st.builds(
        assistant_call,
        st.sampled_from(["a", "b"]),
        st.sampled_from(["calendar_create_event", "blackjack_hit", "email_send", "x"]),
        st.one_of(_text, st.just('{"title": "Team sync", "query": 3}'), st.just("[1]")),
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": st.just("a"),
            "content": st.sampled_from(
                ['{"player_sum": 30, "done": false}', '{"player_sum": "x"}', "[]", "null"]
            ),
        }
    ),
)
_prompt = st.sampled_from(
    [workplace_prompt([SYNC], [MAIL]), BLACKJACK_PROMPT, "What is 3 ^ 4?", "What is", ""]
)


@settings(max_examples=300, deadline=None)
@given(
    prompt=_prompt,
    rest=st.lists(_message, max_size=8),
    tools=st.sampled_from([None, WORKPLACE_TOOLS, BLACKJACK_TOOLS]),
    seed=st.one_of(st.none(), st.integers()),
)
def test_any_conversation_gets_a_decision(
    prompt: str, rest: list[dict[str, Any]], tools: list[dict[str, Any]] | None, seed: int | None
) -> None:
    messages = [{"role": "user", "content": prompt}, *rest]
    decision = ask(Playbook(seed=1, error_rate=0.3), messages, tools, seed=seed)
    assert isinstance(decision, ToolCallDecision | FinalDecision)
