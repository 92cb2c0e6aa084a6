"""One answer of the scripted policy, rendered: :class:`ScriptedReply`.

Owns what a call's reply holds and how it is written on the wire: its id, model and usage
(prompt tokens estimated at four characters a token, ``tokens_per_call`` completion
tokens, or the stand-in tokens counted when token data is asked), each choice's assistant
message (the playbook's decision, with stand-in reasoning before a tool call, cut after a
``continue_final_message`` prefix), its token ids and logprobs in vLLM's or SGLang's shape,
and the three renderings the routes send: one JSON completion, SSE chunks, and the paced
chunks a long generation streams one token at a time. Also the body of a generation a
pause aborted (:func:`aborted_completion`) and the engine's own log line of a reply.

Does not own: what to answer (:mod:`rollpoint.policy.playbook`), the routes, the pacing
or the weights (:mod:`rollpoint.policy.scripted_policy`).
"""

from __future__ import annotations

import itertools
import os
import time
import zlib
from typing import Any

import orjson

from rollpoint.policy import stand_in_tokenizer as stand_in
from rollpoint.policy.openai_wire import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FinishReason,
    FunctionCall,
    FunctionDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from rollpoint.policy.playbook import Decision, FinalDecision
from rollpoint.policy.scripted_settings import PolicySettings

CHARS_PER_TOKEN = 4
_TOKENS_PER_MESSAGE = 4
"""Chat-template overhead per message, as real tokenizers add role markers."""
_STREAM_PIECE_CHARS = 16
"""Stream deltas carry this many characters each, so clients exercise their accumulation."""
SSE_DONE = b"data: [DONE]\n\n"


def estimate_prompt_tokens(request: ChatCompletionRequest) -> int:
    chars = 0
    for message in request.messages:
        chars += len(message.text)
        for call in message.tool_calls or ():
            chars += len(call.function.name) + len(call.function.arguments)
    return chars // CHARS_PER_TOKEN + _TOKENS_PER_MESSAGE * len(request.messages)


def _finish_reason(decision: Decision) -> FinishReason:
    return "stop" if isinstance(decision, FinalDecision) else "tool_calls"


def reasoning_text(call_id: str, tokens: int) -> str:
    """``tokens`` stand-in tokens of "reasoning" (four characters each), a pure function of
    the call id (itself a function of the seeds and the conversation)."""
    return "".join(f"{zlib.crc32(f'{call_id}/{i}'.encode()) % 4096:03x} " for i in range(tokens))


def assistant_message(decision: Decision, reasoning_tokens: int = 0) -> AssistantMessage:
    if isinstance(decision, FinalDecision):
        return AssistantMessage(content=decision.text)
    call = ToolCall(
        id=decision.call_id,
        function=FunctionCall(name=decision.name, arguments=decision.arguments),
    )
    content = reasoning_text(decision.call_id, reasoning_tokens) if reasoning_tokens else None
    return AssistantMessage(content=content, tool_calls=[call])


def _padded(message: AssistantMessage, padding: str) -> AssistantMessage:
    if not padding:
        return message
    return message.model_copy(update={"content": (message.content or "") + padding})


def _cut(message: AssistantMessage, prefix: str) -> AssistantMessage:
    """What is left of ``message`` to generate after ``prefix`` of its content."""
    if not prefix:
        return message
    rest = (message.content or "")[len(prefix) :]
    if message.tool_calls:
        return AssistantMessage(content=rest or None, tool_calls=message.tool_calls)
    return AssistantMessage(content=rest)


def _pieces(text: str) -> list[str]:
    return [text[i : i + _STREAM_PIECE_CHARS] for i in range(0, len(text), _STREAM_PIECE_CHARS)]


def _deltas(message: AssistantMessage) -> list[Delta]:
    """Content in pieces, then each tool call's head and its arguments in pieces."""
    if not message.tool_calls:
        return [
            Delta(role="assistant", content=""),
            *(Delta(content=p) for p in _pieces(message.content or "")),
        ]
    deltas = [Delta(role="assistant")]
    if message.content:
        deltas += [Delta(content=p) for p in _pieces(message.content)]
    for call in message.tool_calls:
        deltas += _tool_call_deltas(call)
    return deltas


def _tool_call_deltas(call: ToolCall) -> list[Delta]:
    head = ToolCallDelta(
        index=0,
        id=call.id,
        type="function",
        function=FunctionDelta(name=call.function.name, arguments=""),
    )
    tail = (
        Delta(tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=p))])
        for p in _pieces(call.function.arguments)
    )
    return [Delta(tool_calls=[head]), *tail]


def _token_deltas(message: AssistantMessage) -> list[tuple[Delta, int]]:
    """One delta per decoded token (with how many tokens it carries), as an engine streams
    at one token a chunk: the role, each content token, each tool call's head (its marker,
    name and arguments marker tokens) then each arguments token. The end token rides on
    the finish chunk."""
    groups: list[tuple[Delta, int]] = [(Delta(role="assistant", content=""), 0)]
    groups += [(Delta(content=t.text), 1) for t in stand_in.encode(message.content or "")]
    for call in message.tool_calls or ():
        head = ToolCallDelta(
            index=0,
            id=call.id,
            type="function",
            function=FunctionDelta(name=call.function.name, arguments=""),
        )
        groups.append((Delta(tool_calls=[head]), 2 + len(stand_in.encode(call.function.name))))
        groups += [
            (
                Delta(
                    tool_calls=[ToolCallDelta(index=0, function=FunctionDelta(arguments=t.text))]
                ),
                1,
            )
            for t in stand_in.encode(call.function.arguments)
        ]
    return groups


class _Tokens:
    """One choice's stand-in token data: ids, their text, and their logprobs, from token
    ``start`` on (a continuation generates only what follows its prefix; positions, and so
    logprobs, are those of the whole message: the same as the uninterrupted call's)."""

    def __init__(self, message: AssistantMessage, seed: int, index: int, start: int = 0) -> None:
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        whole = stand_in.message_body(message.content or "", calls)
        self.prefix_ids = [t.id for t in whole[:start]]
        self.tokens = whole[start:]
        self.ids = [t.id for t in self.tokens]
        self.logprobs = [
            stand_in.logprob(seed, index, start + pos, t.id) for pos, t in enumerate(self.tokens)
        ]

    def content(self, start: int, stop: int, *, as_ids: bool, top: int) -> ChoiceLogprobs:
        entries = []
        for token, lp in zip(self.tokens[start:stop], self.logprobs[start:stop], strict=True):
            tops = [
                TopLogprob(token=_token_text(t, as_ids), logprob=alt, bytes=_bytes(t))
                for t, alt in stand_in.alternatives(token, lp, top)
            ]
            entries.append(
                TokenLogprob(
                    token=_token_text(token, as_ids),
                    logprob=lp,
                    bytes=_bytes(token),
                    top_logprobs=tops,
                )
            )
        return ChoiceLogprobs(content=entries)


def _token_text(token: stand_in.Token, as_ids: bool) -> str:
    return f"token_id:{token.id}" if as_ids else token.text


def _bytes(token: stand_in.Token) -> list[int]:
    return list(token.text.encode("utf-8", "surrogatepass"))


def _prompt_ids(request: ChatCompletionRequest) -> list[int]:
    return stand_in.prompt_ids(
        (
            m.role,
            m.text,
            [(c.function.name, c.function.arguments) for c in m.tool_calls or ()],
        )
        for m in request.messages
    )


def choice_seed(request_seed: int | None, index: int) -> int | None:
    """The seed choice ``index`` is decided under: choice 0 under the request's own."""
    if index == 0:
        return request_seed
    return ((request_seed or 0) * 1_000_003 + index) & 0x7FFFFFFF


class ScriptedReply:
    """One call's identity and accounting, shared by the plain and the streamed rendering.

    With ``return_token_ids`` or ``logprobs`` asked, every choice gets stand-in token data
    (vLLM's shape) and ``usage`` counts those tokens; otherwise usage is the estimate.
    """

    def __init__(
        self,
        settings: PolicySettings,
        request: ChatCompletionRequest,
        decisions: list[Decision],
        prefix: str = "",
        padding: str = "",
    ) -> None:
        """``prefix``: the content already generated (``continue_final_message``); the
        request's messages are then the conversation before the partial assistant one.
        ``padding``: added to every choice's content (an oversized reply, on purpose)."""
        self.id = "chatcmpl-" + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = request.model or settings.model
        self.decisions = decisions
        whole = [
            _padded(assistant_message(d, settings.reasoning_tokens), padding) for d in decisions
        ]
        self.messages = [_cut(m, prefix) for m in whole]
        start = len(prefix) // CHARS_PER_TOKEN
        self.prefix_given = bool(prefix)
        self.return_ids = request.return_token_ids
        self.sglang = settings.shape == "sglang"
        self.return_prompt = request.return_prompt_token_ids
        self.logprobs = request.logprobs
        self.as_ids = request.return_tokens_as_token_ids
        self.top = request.top_logprobs
        self.prompt: list[int] | None = None
        self.tokens: list[_Tokens] | None = None
        if self.return_ids or self.logprobs:
            seed = request.seed or 0
            self.tokens = [_Tokens(m, seed, i, start) for i, m in enumerate(whole)]
            # As vLLM renders continue_final_message: the final message left open, so the
            # prefix's tokens end the prompt.
            self.prompt = _prompt_ids(request) + self.tokens[0].prefix_ids
            prompt_tokens = len(self.prompt)
            completion = sum(len(t.ids) for t in self.tokens)
        else:
            prompt_tokens = estimate_prompt_tokens(request)
            completion = settings.tokens_per_call * len(decisions)
        self.completion_tokens = completion
        self.usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
        )

    def _choice_tokens(
        self, index: int, start: int, stop: int, *, streamed: bool = False
    ) -> dict[str, Any]:
        if self.tokens is None:
            return {}
        tokens = self.tokens[index]
        out: dict[str, Any] = {}
        if self.return_ids and not (streamed and self.sglang):
            out["token_ids"] = tokens.ids[start:stop]
            if self.sglang and self.return_prompt:
                out["prompt_token_ids"] = self.prompt
        if self.logprobs:
            out["logprobs"] = tokens.content(start, stop, as_ids=self.as_ids, top=self.top)
        return out

    def completion(self) -> bytes:
        choices = [
            Choice(
                index=i,
                message=self.messages[i],
                finish_reason=_finish_reason(d),
                **self._choice_tokens(i, 0, len(self.tokens[i].ids) if self.tokens else 0),
            )
            for i, d in enumerate(self.decisions)
        ]
        body = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage,
            prompt_token_ids=self.prompt if self.return_ids and not self.sglang else None,
        )
        return body.model_dump_json().encode()

    def stream(self, *, include_usage: bool) -> list[bytes]:
        chunks: list[bytes] = []
        for i, decision in enumerate(self.decisions):
            deltas = _deltas(self.messages[i])
            # The ids ride on the content deltas after the role delta, spread evenly; the
            # end token rides on the chunk that carries the finish reason.
            n = len(self.tokens[i].ids) if self.tokens else 0
            spans = _spans(max(n - 1, 0), len(deltas) - 1)
            for j, delta in enumerate(deltas):
                start, stop = (0, 0) if j == 0 else spans[j - 1]
                tokens = self._choice_tokens(i, start, stop, streamed=True)
                choice = ChunkChoice(index=i, delta=delta, **tokens)
                first = i == 0 and j == 0
                prompt = self.prompt if first and self.return_ids and not self.sglang else None
                chunks.append(self._chunk([choice], prompt=prompt))
            last = ChunkChoice(
                index=i,
                delta=Delta(),
                finish_reason=_finish_reason(decision),
                **self._choice_tokens(i, max(n - 1, 0), n, streamed=True),
            )
            chunks.append(self._chunk([last]))
        if include_usage:
            chunks.append(self._chunk([], usage=self.usage))
        return [*chunks, SSE_DONE]

    def timed_stream(self, *, include_usage: bool) -> list[tuple[bytes, int]]:
        """Choice 0 at one token a chunk, each chunk with the tokens it carries (to wait
        for): role, content and tool-call tokens, then the finish chunk with the end token."""
        decision, tokens = self.decisions[0], self.tokens[0] if self.tokens else None
        n = len(tokens.ids) if tokens else 0
        chunks: list[tuple[bytes, int]] = []
        at = 0
        for j, (delta, count) in enumerate(_token_deltas(self.messages[0])):
            stop = min(at + count, max(n - 1, 0))
            choice = ChunkChoice(
                index=0, delta=delta, **self._choice_tokens(0, at, stop, streamed=True)
            )
            prompt = self.prompt if j == 0 and self.return_ids and not self.sglang else None
            chunks.append((self._chunk([choice], prompt=prompt), stop - at))
            at = stop
        last = ChunkChoice(
            index=0,
            delta=Delta(),
            finish_reason=_finish_reason(decision),
            **self._choice_tokens(0, at, n, streamed=True),
        )
        chunks.append((self._chunk([last]), n - at))
        if include_usage:
            chunks.append((self._chunk([], usage=self.usage), 0))
        return [*chunks, (SSE_DONE, 0)]

    def _chunk(
        self,
        choices: list[ChunkChoice],
        usage: Usage | None = None,
        prompt: list[int] | None = None,
    ) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt,
        )
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"

    def abort_chunk(self) -> bytes:
        """The chunk an engine ends an aborted generation with (finish reason ``abort``)."""
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def log_line(self, request: ChatCompletionRequest) -> bytes:
        """The call log's record of this reply: what was asked (but the conversation) and
        every choice's token data, as the engine's own account of what it sampled."""
        asked = request.model_dump(mode="json", exclude={"messages", "tools"}, exclude_none=True)
        choices = [
            {
                "index": i,
                "finish_reason": _finish_reason(d),
                "token_ids": None if self.tokens is None else self.tokens[i].ids,
                "logprobs": None if self.tokens is None else self.tokens[i].logprobs,
            }
            for i, d in enumerate(self.decisions)
        ]
        line: dict[str, Any] = {
            "id": self.id,
            "created": self.created,
            "request": asked,
            "prompt_token_ids": self.prompt,
            "choices": choices,
        }
        if self.prefix_given and self.tokens is not None:
            # Given, not generated: what this call decoded is ``token_ids`` alone.
            line["prefix_token_ids"] = self.tokens[0].prefix_ids
        return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def aborted_completion(reply: ScriptedReply) -> bytes:
    """A plain reply to a generation a pause aborted: no message, finish reason ``abort``."""
    body = {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ""},
                "finish_reason": "abort",
            }
        ],
        "usage": reply.usage.model_dump(),
    }
    return orjson.dumps(body)


def _spans(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` items cut into ``parts`` consecutive spans, as even as can be."""
    if parts <= 0:
        return []
    bounds = [count * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))
