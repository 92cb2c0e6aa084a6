"""The scripted policy's stand-in tokenizer and sampler: deterministic ids and logprobs, no model.

Owns: turning text into token ids (four characters a token, each id a CRC of its text, so
the same text always gives the same ids in any process), the chat template (every message
is its role token, its content and tool calls, then an end token; a prompt ends with the
assistant role token, as ``add_generation_prompt`` does), and the logprob "sampled" for
each generated token (a pure function of the request seed, the choice index, the position
and the id, on a 1/1024 grid so float32 holds it exactly).

The template is chosen so that a conversation's next prompt starts with the previous
prompt followed by the previous completion, as real chat templates do for the latest
turn: the call ledger can then store each prompt as the suffix it adds.

Does not own: what to answer (:mod:`rollpoint.policy.playbook`) or the reply's shape
(:mod:`rollpoint.policy.scripted_policy`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_CHARS_PER_TOKEN = 4
_VOCAB = 50_000
_FIRST_TEXT_ID = 256
"""Ids under this one are special tokens."""
_ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
_OTHER_ROLE = 5
END = 6
_TOOL_CALL = 7
_ARGUMENTS = 8
_SPECIAL_TEXT = {
    1: "<|system|>",
    2: "<|user|>",
    3: "<|assistant|>",
    4: "<|tool|>",
    5: "<|role|>",
    END: "<|end|>",
    _TOOL_CALL: "<|tool_call|>",
    _ARGUMENTS: "<|arguments|>",
}


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    text: str


def encode(text: str) -> list[Token]:
    pieces = (text[i : i + _CHARS_PER_TOKEN] for i in range(0, len(text), _CHARS_PER_TOKEN))
    return [
        Token(_FIRST_TEXT_ID + zlib.crc32(p.encode("utf-8", "surrogatepass")) % _VOCAB, p)
        for p in pieces
    ]


def _special(token_id: int) -> Token:
    return Token(token_id, _SPECIAL_TEXT[token_id])


def message_body(content: str, tool_calls: Iterable[tuple[str, str]]) -> list[Token]:
    """A message after its role token: content, each tool call (name, arguments), end."""
    tokens = encode(content)
    for name, arguments in tool_calls:
        tokens += [_special(_TOOL_CALL), *encode(name), _special(_ARGUMENTS), *encode(arguments)]
    tokens.append(_special(END))
    return tokens


def prompt_ids(messages: Iterable[tuple[str, str, Sequence[tuple[str, str]]]]) -> list[int]:
    """The prompt of ``(role, content, tool_calls)`` messages, ending on the assistant role."""
    ids: list[int] = []
    for role, content, calls in messages:
        ids.append(_ROLES.get(role, _OTHER_ROLE))
        ids.extend(t.id for t in message_body(content, calls))
    ids.append(_ROLES["assistant"])
    return ids


def logprob(seed: int, choice: int, position: int, token_id: int) -> float:
    """The logprob the stand-in engine reports for a sampled token: in [-2, -1/1024]."""
    k = zlib.crc32(f"{seed}/{choice}/{position}/{token_id}".encode()) % 2048
    return -(k + 1) / 1024


def alternatives(token: Token, sampled: float, count: int) -> list[tuple[Token, float]]:
    """``count`` top logprobs: the sampled token first, then less likely ids."""
    out = [(token, sampled)]
    for j in range(1, count):
        alt = _FIRST_TEXT_ID + (token.id + 7919 * j) % _VOCAB
        out.append((Token(alt, f"<{alt}>"), sampled - j))
    return out[:count]
