"""The scripted policy's decisions: which tool to call next, or what to answer, and when to blunder.

Owns: recognising the environment from the tools offered (``calendar_*`` → workplace,
``blackjack_*`` → blackjack, ``gym_step`` → a Gymnasium environment
(:mod:`.gym_playbook`), no tools and a ``What is`` prompt → math, anything else →
unknown), reading the state of the episode from the conversation (the task prompt, every
assistant tool call and the tool result answering it, matched by ``tool_call_id``), and one
playbook per environment, and the generic playbook for every other environment: from the
tool specs of the request alone, ``tool_turns`` turns each calling one offered tool with
seeded arguments valid for its JSON schema (:mod:`.schema_arguments`), then a final answer
naming what it did. With that, an environment nobody taught the policy runs, snapshots and
resumes with no LLM. The prompt formats and tool results it parses are the fixed
contract of ``docs/architecture.md`` ("Built-in environments"); it never imports the
environments themselves.

Deterministic: a decision is a pure function of the policy seed, the request's ``seed``, the
conversation and the names of the tools offered, hashed with blake2b (never ``hash()``), so
the same request gets the same answer in every process. Two random streams come from it: one
per *conversation* (its opening messages; fixed for the whole episode, e.g. the blackjack
threshold) and one per *turn* (the whole transcript; e.g. whether this turn blunders).

A blunder (probability ``error_rate`` per turn) replaces the right tool call with a wrong one
(malformed JSON, a missing argument, a wrong type, an unknown tool) so the agent's error paths
run; for math it is a wrong number. A tool result starting with ``error`` counts as failed and
the step is tried again on the next turn; a step counts as done only once that exact, correct
call went through, so our own wrong calls are retried however the tool words its refusal.

Does not own: the HTTP routes or the OpenAI response shapes (:mod:`.scripted_policy`,
:mod:`.openai_wire`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any, TypeVar

import orjson

from rollpoint.policy import gym_playbook
from rollpoint.policy.openai_wire import ChatCompletionRequest, ChatMessage
from rollpoint.policy.schema_arguments import sample_arguments

T = TypeVar("T")


class Environment(StrEnum):
    WORKPLACE = "workplace"
    BLACKJACK = "blackjack"
    MATH = "math"
    GYMNASIUM = "gymnasium"
    """A ``gymnasium:<env id>`` environment: its ``gym_step`` tool (:mod:`.gym_playbook`)."""
    UNKNOWN = "unknown"
    """Nothing we know: play it from the tool specs (:func:`play_generic`)."""


class Mistake(StrEnum):
    MALFORMED_JSON = "malformed_json"
    """Arguments cut in half: not valid JSON."""
    MISSING_ARGUMENT = "missing_argument"
    WRONG_TYPE = "wrong_type"
    """``duration_minutes: "thirty"``, or a string argument sent as a list."""
    UNKNOWN_TOOL = "unknown_tool"
    """A tool that is not offered, e.g. ``calendar_delete_everything``."""


@dataclass(frozen=True, slots=True)
class ToolCallDecision:
    call_id: str
    name: str
    arguments: str
    """The JSON argument string, exactly as it goes on the wire (malformed on a blunder)."""
    mistake: Mistake | None = None


@dataclass(frozen=True, slots=True)
class FinalDecision:
    text: str


Decision = ToolCallDecision | FinalDecision

# ---------------------------------------------------------------------------------------------
# Reading the conversation


@dataclass(frozen=True, slots=True)
class Exchange:
    """One tool call the assistant made, and how it went."""

    name: str
    arguments: dict[str, Any] | None
    """The parsed arguments; None when they were not a JSON object."""
    result: str | None
    """The tool message answering it; None when none did."""

    @property
    def ok(self) -> bool:
        return self.result is not None and not self.result.lstrip().lower().startswith("error")


@dataclass(frozen=True, slots=True)
class Transcript:
    prompt: str
    """The first user message: the task."""
    tools: tuple[str, ...]
    exchanges: tuple[Exchange, ...]

    def succeeded(self, name: str, arguments: dict[str, Any]) -> bool:
        """Whether exactly this call went through.

        Exact arguments, not just a matching title: a wrong call of ours never counts as done,
        even when the tool's refusal does not begin with ``error``.
        """
        return any(ex.ok and ex.name == name and ex.arguments == arguments for ex in self.exchanges)

    def latest(self, prefix: str, parse: Callable[[str], T | None]) -> T | None:
        """The newest successful result of a ``prefix*`` tool that ``parse`` can read."""
        for ex in reversed(self.exchanges):
            if ex.ok and ex.name.startswith(prefix) and ex.result is not None:
                parsed = parse(ex.result)
                if parsed is not None:
                    return parsed
        return None


def _parse_arguments(raw: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def read_transcript(messages: Sequence[ChatMessage], tools: Sequence[str]) -> Transcript:
    results = {m.tool_call_id: m.text for m in messages if m.role == "tool" and m.tool_call_id}
    exchanges = tuple(
        Exchange(
            call.function.name, _parse_arguments(call.function.arguments), results.get(call.id)
        )
        for m in messages
        if m.role == "assistant" and m.tool_calls
        for call in m.tool_calls
    )
    prompt = next((m.text for m in messages if m.role == "user"), "")
    return Transcript(prompt=prompt, tools=tuple(tools), exchanges=exchanges)


_TOOL_PREFIX_ENVIRONMENT = (
    ("calendar_", Environment.WORKPLACE),
    ("blackjack_", Environment.BLACKJACK),
    (gym_playbook.STEP_TOOL, Environment.GYMNASIUM),
)


def recognise(transcript: Transcript) -> Environment:
    for tool in transcript.tools:
        for prefix, environment in _TOOL_PREFIX_ENVIRONMENT:
            if tool.startswith(prefix):
                return environment
    if not transcript.tools and "What is" in transcript.prompt:
        return Environment.MATH
    return Environment.UNKNOWN


# ---------------------------------------------------------------------------------------------
# The playbooks: each returns the next tool call it wants, or the final text


@dataclass(frozen=True, slots=True)
class Intent:
    """A correct tool call: the step is done once this exact call went through."""

    name: str
    arguments: dict[str, Any]

    def done_in(self, transcript: Transcript) -> bool:
        return transcript.succeeded(self.name, self.arguments)


@dataclass(frozen=True, slots=True)
class Turn:
    transcript: Transcript
    episode_rng: random.Random
    """Seeded by the conversation's opening: the same on every turn of one episode."""
    blunder: bool
    turn_rng: random.Random
    """Seeded by the whole transcript: this turn's own draws (the generic playbook's)."""
    specs: Mapping[str, dict[str, Any] | None]
    """The JSON schema of each offered tool's arguments, by name (None: no schema)."""
    tool_turns: int
    """The generic playbook's number of tool-calling turns before its final answer."""


_EVENT_RE = re.compile(
    r'^\s*-\s*"(?P<title>.+)" on (?P<date>\d{4}-\d{2}-\d{2}) at (?P<start_time>\d{1,2}:\d{2})'
    r" for (?P<duration>\d{1,6}) minutes?",
    re.MULTILINE,
)
_EMAIL_RE = re.compile(r'^\s*-\s*to "(?P<to>[^"]+)" with subject "(?P<subject>.+)"', re.MULTILINE)


def _workplace_plan(prompt: str) -> list[Intent]:
    events = [m.groupdict() for m in _EVENT_RE.finditer(prompt)]
    creates = [
        Intent(
            "calendar_create_event",
            {
                "title": e["title"],
                "date": e["date"],
                "start_time": e["start_time"],
                "duration_minutes": int(e["duration"]),
            },
        )
        for e in events
    ]
    searches = [Intent("calendar_search_events", {"query": e["title"]}) for e in events]
    emails = [
        Intent(
            "email_send",
            {"to": m["to"], "subject": m["subject"], "body": f"Hi,\n\n{m['subject']}.\n\nBest"},
        )
        for m in _EMAIL_RE.finditer(prompt)
    ]
    return creates + searches + emails


def play_workplace(turn: Turn) -> Intent | str:
    plan = _workplace_plan(turn.transcript.prompt)
    if not plan:
        return "I could not find any events or emails in your request, so I did nothing."
    pending = next((step for step in plan if not step.done_in(turn.transcript)), None)
    if pending is not None:
        return pending
    titles = [s.arguments["title"] for s in plan if s.name == "calendar_create_event"]
    recipients = [s.arguments["to"] for s in plan if s.name == "email_send"]
    text = f"Done: scheduled {len(titles)} event(s) and confirmed each is in the calendar"
    text += f" ({', '.join(titles)})" if titles else ""
    if recipients:
        text += f"; sent {len(recipients)} email(s) to {', '.join(recipients)}"
    return text + "."


_BLACKJACK_THRESHOLDS = (16, 17, 17, 18)
_OUTCOME_WORDS = {"win": "won", "lose": "lost", "draw": "drew"}


def _hand(result: str) -> dict[str, Any] | None:
    try:
        hand = orjson.loads(result)
    except orjson.JSONDecodeError:
        return None
    return hand if isinstance(hand, dict) and isinstance(hand.get("player_sum"), int) else None


def play_blackjack(turn: Turn) -> Intent | str:
    threshold = turn.episode_rng.choice(_BLACKJACK_THRESHOLDS)
    hand = turn.transcript.latest("blackjack_", _hand)
    if hand is None:
        return Intent("blackjack_status", {})
    if hand.get("done"):
        outcome = str(hand.get("outcome"))
        word = _OUTCOME_WORDS.get(outcome, "finished")
        return (
            f"The hand is over: I {word} (outcome: {outcome}) with {hand['player_sum']} "
            f"against the dealer's {hand.get('dealer_card')}."
        )
    return Intent("blackjack_hit" if hand["player_sum"] < threshold else "blackjack_stand", {})


_MATH_RE = re.compile(
    r"What is\s+(?P<a>-?\d+(?:\.\d+)?)\s*(?P<op>\*\*|//|[-+*/%x\u00d7\u00f7^])\s*(?P<b>-?\d+(?:\.\d+)?)"
)
_MAX_EXPONENT = 64


def _power(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1 or abs(b) > _MAX_EXPONENT:
        raise ArithmeticError("exponent out of range")
    return a ** int(b)


_OPERATORS: dict[str, Callable[[Fraction, Fraction], Fraction]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "x": lambda a, b: a * b,
    "\u00d7": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "\u00f7": lambda a, b: a / b,
    "//": lambda a, b: Fraction(a // b),
    "%": lambda a, b: a % b,
    "**": _power,
    "^": _power,
}


def _format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def play_math(turn: Turn) -> Intent | str:
    match = _MATH_RE.search(turn.transcript.prompt)
    if match is None:
        return "I could not find an arithmetic question to answer."
    rng = turn.episode_rng
    offset = rng.randint(1, 9) * rng.choice((-1, 1)) if turn.blunder else 0
    try:
        value = _OPERATORS[match["op"]](Fraction(match["a"]), Fraction(match["b"]))
        # ValueError: past Python's int-to-text digit limit, which a huge operand can reach.
        return _format_number(value + offset)
    except (ArithmeticError, ValueError):
        return "That has no finite answer I can give."


def play_gymnasium(turn: Turn) -> Intent | str:
    step = gym_playbook.next_step(turn)
    return step if isinstance(step, str) else Intent(gym_playbook.STEP_TOOL, step)


def play_unknown(turn: Turn) -> Intent | str:
    if turn.specs and turn.tool_turns > 0:
        return play_generic(turn)
    return "Sorry, I can't help with this request: none of the tools offered fit a task I know."


def play_generic(turn: Turn) -> Intent | str:
    """Any environment, from its tool specs: ``tool_turns`` calls, then a final answer.

    Every tool-calling turn counts, a refused one too, so an episode ends after the same
    number of turns whatever the tools answer. The tool and its arguments are drawn from
    the turn's own rng: the same transcript gets the same call in every process.
    """
    made = turn.transcript.exchanges
    names = sorted(turn.specs)
    if len(made) >= turn.tool_turns or not names:
        ok = sum(1 for ex in made if ex.ok)
        used = ", ".join(sorted({ex.name for ex in made})) or "no tool"
        return f"Done: {len(made)} tool call(s) ({ok} succeeded) using {used}."
    name = turn.turn_rng.choice(names)
    return Intent(name, sample_arguments(turn.specs[name], turn.turn_rng))


_PLAYS: dict[Environment, Callable[[Turn], Intent | str]] = {
    Environment.WORKPLACE: play_workplace,
    Environment.BLACKJACK: play_blackjack,
    Environment.MATH: play_math,
    Environment.GYMNASIUM: play_gymnasium,
    Environment.UNKNOWN: play_unknown,
}

# ---------------------------------------------------------------------------------------------
# Blunders: the wrong call that replaces the right one


def _malformed_json(intent: Intent, rng: random.Random) -> tuple[str, str]:
    text = orjson.dumps(intent.arguments).decode()
    # Any proper prefix of a JSON object is unterminated, hence invalid.
    return intent.name, text[: max(1, len(text) // 2)]


def _missing_argument(intent: Intent, rng: random.Random) -> tuple[str, str]:
    dropped = rng.choice(sorted(intent.arguments))
    rest = {k: v for k, v in intent.arguments.items() if k != dropped}
    return intent.name, orjson.dumps(rest).decode()


def _wrong_type(intent: Intent, rng: random.Random) -> tuple[str, str]:
    args = dict(intent.arguments)
    if "duration_minutes" in args:
        args["duration_minutes"] = "thirty"
    else:
        name = rng.choice(sorted(k for k, v in args.items() if isinstance(v, str)))
        args[name] = [args[name]]
    return intent.name, orjson.dumps(args).decode()


def _unknown_tool(intent: Intent, rng: random.Random) -> tuple[str, str]:
    if intent.name.startswith(("calendar_", "email_")):
        prefix = "calendar"
    elif intent.name.startswith("blackjack_"):
        prefix = "blackjack"
    else:
        prefix = intent.name.partition("_")[0]
    return f"{prefix}_delete_everything", orjson.dumps(intent.arguments).decode()


_MISTAKES: dict[Mistake, Callable[[Intent, random.Random], tuple[str, str]]] = {
    Mistake.MALFORMED_JSON: _malformed_json,
    Mistake.MISSING_ARGUMENT: _missing_argument,
    Mistake.WRONG_TYPE: _wrong_type,
    Mistake.UNKNOWN_TOOL: _unknown_tool,
}


def _possible_mistakes(intent: Intent) -> list[Mistake]:
    possible = [Mistake.MALFORMED_JSON, Mistake.UNKNOWN_TOOL]
    args = intent.arguments
    if args:
        possible.append(Mistake.MISSING_ARGUMENT)
    if "duration_minutes" in args or any(isinstance(v, str) for v in args.values()):
        possible.append(Mistake.WRONG_TYPE)
    return possible


# ---------------------------------------------------------------------------------------------
# The policy


def _canonical(messages: Sequence[ChatMessage]) -> list[Any]:
    """Only what the playbook reads, so extra fields a client echoes back change nothing."""
    return [
        (
            m.role,
            m.text,
            [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()],
            m.tool_call_id,
        )
        for m in messages
    ]


def _digest(*parts: Any) -> bytes:
    return hashlib.blake2b(orjson.dumps(parts), digest_size=16).digest()


def _rng(digest: bytes) -> random.Random:
    return random.Random(int.from_bytes(digest[:8], "big"))


def _specs(request: ChatCompletionRequest, offered: Sequence[str]) -> dict[str, Any]:
    wanted = set(offered)
    return {
        t.function.name: t.function.parameters
        for t in request.tools or ()
        if t.function is not None and t.function.name in wanted
    }


class Playbook:
    """Decides one turn: ``decide(request)`` is a pure function of the seeds and the request."""

    def __init__(self, *, seed: int = 0, error_rate: float = 0.0, tool_turns: int = 3) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], got {error_rate}")
        if tool_turns < 0:
            raise ValueError(f"tool_turns must be >= 0, got {tool_turns}")
        self.seed = seed
        self.error_rate = error_rate
        self.tool_turns = tool_turns

    def decide(self, request: ChatCompletionRequest) -> Decision:
        tools = request.tool_names()
        messages = _canonical(request.messages)
        opening = next((i + 1 for i, m in enumerate(messages) if m[0] == "user"), len(messages))
        # As text: orjson refuses integers past 64 bits, and a client may send one.
        seeds = f"{self.seed}/{request.seed}"
        episode_rng = _rng(_digest(seeds, messages[:opening], tools))
        turn_digest = _digest(seeds, messages, tools)
        turn_rng = _rng(turn_digest)
        transcript = read_transcript(request.messages, tools)
        blunder = turn_rng.random() < self.error_rate
        environment = recognise(transcript)
        with_specs = environment in (Environment.UNKNOWN, Environment.GYMNASIUM)
        specs = _specs(request, tools) if with_specs else {}
        turn = Turn(transcript, episode_rng, blunder, turn_rng, specs, self.tool_turns)
        outcome = _PLAYS[environment](turn)
        if isinstance(outcome, str):
            return FinalDecision(outcome)
        call_id = "call_" + turn_digest.hex()[:24]
        if not turn.blunder:
            return ToolCallDecision(call_id, outcome.name, orjson.dumps(outcome.arguments).decode())
        mistake = turn_rng.choice(_possible_mistakes(outcome))
        name, arguments = _MISTAKES[mistake](outcome, turn_rng)
        return ToolCallDecision(call_id, name, arguments, mistake)
