"""Test doubles of the built-in environments' tool surface, as the architecture doc specifies it.

They answer tool calls in the documented formats (an ``error: ...`` text for a bad call, JSON
otherwise) so the playbook can be driven through whole episodes without the real
environments, which the scripted policy must not depend on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollpoint.policy.openai_wire import ChatCompletionRequest
from rollpoint.policy.playbook import Decision, FinalDecision, Playbook, ToolCallDecision


def tool_spec(name: str, properties: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name.replace("_", " "),
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in properties.items()},
                "required": list(properties),
            },
        },
    }


WORKPLACE_TOOLS = [
    tool_spec(
        "calendar_create_event",
        {
            "title": "string",
            "date": "string",
            "start_time": "string",
            "duration_minutes": "integer",
        },
    ),
    tool_spec("calendar_search_events", {"query": "string"}),
    tool_spec("email_send", {"to": "string", "subject": "string", "body": "string"}),
    tool_spec("email_list_sent", {}),
]
BLACKJACK_TOOLS = [
    tool_spec(n, {}) for n in ("blackjack_status", "blackjack_hit", "blackjack_stand")
]
BLACKJACK_PROMPT = (
    "Play one hand of blackjack. Call blackjack_status to see your hand, then blackjack_hit or "
    "blackjack_stand until the hand is over."
)

SYNC = {"title": "Team sync", "date": "2025-01-15", "start_time": "10:00", "duration_minutes": 30}
DEMO = {"title": "Demo", "date": "2025-03-01", "start_time": "14:30", "duration_minutes": 60}
MAIL = {"to": "ana@example.com", "subject": "Team sync scheduled"}


def workplace_prompt(events: list[dict[str, Any]], emails: list[dict[str, Any]]) -> str:
    lines = [
        "Schedule these events in my calendar, then search for each one to confirm it is there:"
    ]
    lines += [
        f'- "{e["title"]}" on {e["date"]} at {e["start_time"]} for {e["duration_minutes"]} minutes'
        for e in events
    ]
    if emails:
        lines.append("Then send these emails:")
        lines += [f'- to "{m["to"]}" with subject "{m["subject"]}"' for m in emails]
    return "\n".join(lines)


_JSON_TYPES: dict[str, type] = {"string": str, "integer": int}


def call_problem(name: str, arguments: str, tools: list[dict[str, Any]]) -> str | None:
    """Why a tool call is wrong against the offered specs; None when it is a valid call."""
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if name not in specs:
        return f"unknown tool {name}"
    try:
        args = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return "arguments are not valid JSON"
    if not isinstance(args, dict):
        return "arguments are not a JSON object"
    for required in specs[name]["required"]:
        if required not in args:
            return f"missing argument {required}"
    for key, prop in specs[name]["properties"].items():
        wanted = _JSON_TYPES[prop["type"]]
        if key in args and (not isinstance(args[key], wanted) or isinstance(args[key], bool)):
            return f"argument {key} must be a {prop['type']}"
    return None


@dataclass
class FakeWorkplace:
    events: list[dict[str, Any]] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, name: str, arguments: str) -> str:
        problem = call_problem(name, arguments, WORKPLACE_TOOLS)
        if problem is not None:
            return f"error: {problem}"
        args = orjson.loads(arguments)
        if name == "calendar_create_event":
            self.events.append(args)
            return orjson.dumps({"created": {"id": len(self.events), **args}}).decode()
        if name == "calendar_search_events":
            found = [e for e in self.events if args["query"] in e["title"]]
            return orjson.dumps(found).decode()
        if name == "email_send":
            self.sent.append(args)
            return orjson.dumps({"sent": True}).decode()
        return orjson.dumps(self.sent).decode()


def _hand_value(cards: list[int]) -> tuple[int, bool]:
    total = sum(cards)
    usable_ace = 1 in cards and total + 10 <= 21
    return total + 10 if usable_ace else total, usable_ace


@dataclass
class FakeBlackjack:
    """A Blackjack-v1 look-alike: a seeded infinite deck, the dealer draws to 17."""

    seed: int = 0
    player: list[int] = field(default_factory=list)
    dealer: list[int] = field(default_factory=list)
    outcome: str | None = None

    def __post_init__(self) -> None:
        self._deck = random.Random(self.seed)
        self.player = [self._draw(), self._draw()]
        self.dealer = [self._draw(), self._draw()]

    def _draw(self) -> int:
        return min(self._deck.randint(1, 13), 10)

    def __call__(self, name: str, arguments: str) -> str:
        problem = call_problem(name, arguments, BLACKJACK_TOOLS)
        if problem is not None:
            return f"error: {problem}"
        if self.outcome is None and name == "blackjack_hit":
            self.player.append(self._draw())
            if _hand_value(self.player)[0] > 21:
                self.outcome = "lose"
        elif self.outcome is None and name == "blackjack_stand":
            while _hand_value(self.dealer)[0] < 17:
                self.dealer.append(self._draw())
            self.outcome = self._compare()
        player_sum, usable_ace = _hand_value(self.player)
        return orjson.dumps(
            {
                "player_sum": player_sum,
                "dealer_card": self.dealer[0],
                "usable_ace": usable_ace,
                "done": self.outcome is not None,
                "outcome": self.outcome,
            }
        ).decode()

    def _compare(self) -> str:
        mine, theirs = _hand_value(self.player)[0], _hand_value(self.dealer)[0]
        if theirs > 21 or mine > theirs:
            return "win"
        return "draw" if mine == theirs else "lose"


def request(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **fields: Any
) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "scripted", "messages": messages, "tools": tools, **fields}
    )


def ask(
    playbook: Playbook,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    **fields: Any,
) -> Decision:
    return playbook.decide(request(messages, tools, **fields))


def assistant_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


def tool_result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


@dataclass
class Episode:
    messages: list[dict[str, Any]]
    calls: list[ToolCallDecision]
    final: str | None


def run_episode(
    playbook: Playbook,
    *,
    prompt: str,
    tools: list[dict[str, Any]] | None,
    environment: Callable[[str, str], str],
    seed: int | None = None,
    max_turns: int = 60,
) -> Episode:
    """Play until a final message (or ``max_turns``), as the agent server does."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    calls: list[ToolCallDecision] = []
    for _ in range(max_turns):
        decision = ask(playbook, messages, tools, seed=seed)
        if isinstance(decision, FinalDecision):
            messages.append({"role": "assistant", "content": decision.text})
            return Episode(messages, calls, decision.text)
        calls.append(decision)
        messages.append(assistant_call(decision.call_id, decision.name, decision.arguments))
        messages.append(
            tool_result(decision.call_id, environment(decision.name, decision.arguments))
        )
    return Episode(messages, calls, None)
