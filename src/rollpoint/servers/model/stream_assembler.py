"""Assembling a streamed reply: the assistant message of choice 0, rebuilt from the
engine's OpenAI server-sent events as they pass by.

Owns :class:`StreamAssembler`: fed a stream's bytes as they arrive, it splits them into
``data:`` events, checks each chunk before anything keeps a piece of it
(:mod:`rollpoint.policy.stream_chunk_check`), hands each event to the engine adapter's token
reader and to the call's :class:`~rollpoint.servers.model.generation_cut.PartialCall` when
it has them, and joins choice 0's role, content and tool-call deltas; it tells a stream cut
short (no finish reason) and gives the plain ``chat.completion`` the engine would have
answered. And :func:`clean_message`: a reply's message as the call ledger keeps it.

Does not own: the HTTP of the stream (the model server relays it or reads it whole), nor
reading token data (the engine adapters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from rollpoint.policy.engine_adapters import TokenStream
from rollpoint.policy.stream_chunk_check import check_chunk
from rollpoint.protocol.errors import TransportError
from rollpoint.servers.model.generation_cut import PartialCall


def clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # Engines pad messages with nulls (refusal, audio, ...): keep what was said, and content
    # (null next to tool calls), the same shape the agent keeps in its transcript.
    cleaned = {k: v for k, v in message.items() if v is not None}
    cleaned.setdefault("content", None)
    return cleaned


class StreamAssembler:
    """Rebuilds the assistant message of choice 0 from OpenAI SSE chunks as they pass by."""

    def __init__(
        self,
        tokens: TokenStream | None = None,
        partial: PartialCall | None = None,
        engine: str = "engine",
    ) -> None:
        self.engine = engine
        """Named by a chunk's refusal (:mod:`rollpoint.policy.stream_chunk_check`)."""
        self.tokens = tokens
        """Fed every parsed event: the engine adapter's reader of the stream's token data."""
        self.partial = partial
        """Fed every parsed event too: the call's partial output, for the generation cut."""
        self.created: Any = None
        self.model: Any = None
        self._buf = bytearray()
        self._content: list[str] = []
        self._role = "assistant"
        self._tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.completion_id: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end]).strip()
            del self._buf[: end + 1]
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if not data or data == b"[DONE]":
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        check_chunk(self.engine, event)  # before anything keeps a piece of it
        if self.tokens is not None:
            self.tokens.feed(event)
        if self.partial is not None:
            self.partial.feed(event)
        if isinstance(event.get("id"), str):
            self.completion_id = event["id"]
        if self.created is None:
            self.created, self.model = event.get("created"), event.get("model")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            self._role = delta["role"]
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._tool_delta(call)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        entry = self._tools.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        fn = call.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str) and fn["name"]:
                entry["function"]["name"] = fn["name"]
            if isinstance(fn.get("arguments"), str):
                entry["function"]["arguments"] += fn["arguments"]

    def check_finished(self, upstream: str) -> None:
        """Raise :class:`TransportError` when the stream ended with no finish reason for
        choice 0: it was cut short, and what came is not the engine's whole reply."""
        if self.finish_reason is None:
            raise TransportError(
                f"upstream {upstream}: the stream ended before choice 0 finished (no finish_reason)"
            )

    def message(self) -> dict[str, Any]:
        return clean_message(self.reply_message())

    def reply_message(self) -> dict[str, Any]:
        """The message as a plain reply carries it (content null next to tool calls)."""
        # An empty string the engine streamed is its content; no content delta at all is
        # none (and so is the empty content next to tool calls, as a plain reply has it).
        content = "".join(self._content) if self._content else None
        message: dict[str, Any] = {"role": self._role, "content": content}
        if self._tools:
            message["content"] = content or None
            message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
        return message

    def reply(self, partial: PartialCall, ids_from: int, entries_from: int) -> dict[str, Any]:
        """The plain ``chat.completion`` the engine would have answered, from the stream
        (in the order of OpenAI's and vLLM's fields; a continuation's own tokens only)."""
        choice: dict[str, Any] = {
            "index": 0,
            "message": self.reply_message(),
            "finish_reason": self.finish_reason,
            "logprobs": (
                {"content": partial.entries[entries_from:]} if partial.saw_logprobs else None
            ),
        }
        if partial.saw_ids:
            choice["token_ids"] = partial.ids[ids_from:]
        reply: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }
        if partial.prompt is not None:
            reply["prompt_token_ids"] = partial.prompt
        return reply
