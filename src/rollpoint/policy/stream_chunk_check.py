"""Engine data checked where it arrives: one streamed chunk at a time.

Owns :func:`check_chunk`, which the model server's stream reader
(:class:`~rollpoint.servers.model.stream_assembler.StreamAssembler`) calls on every parsed SSE
event before anything reads it (the engine adapter's token reader, the generation cut's
partial output): each choice's ``token_ids`` are ints in ``[0, 2**31)``, its
``logprobs.content`` entries carry float logprobs <= 0, and a tool call's first delta (the
one naming its function) carries an ``id``. A bad chunk raises
:class:`~rollpoint.protocol.errors.TransportError` naming the engine and the field: that
call fails as a transport error (the agent retries it), and nothing of it reaches a
snapshot or a saved prefix.

Why here (issue 33): ids were only checked once a stream ended, so with the generation cut
on one bad id (2**31, ``"13"``, ``13.0``, -1) in a call in flight was saved in every
snapshot's prefix and made each one fail; a streamed tool call without an id made the
agent's next call a 400 that failed the group. The checks themselves are the adapters'
(:mod:`rollpoint.policy.engine_adapters`), applied per chunk.
"""

from __future__ import annotations

from typing import Any

from rollpoint.policy.engine_adapters import _bad, _content, _content_logprobs, _ids


def check_chunk(engine: str, event: dict[str, Any]) -> None:
    """Refuse a streamed chunk whose token data or tool calls are malformed."""
    prompt = event.get("prompt_token_ids")
    if prompt is not None:
        _ids(engine, "chunk prompt_token_ids", prompt)
    choices = event.get("choices")
    if choices is None:
        return
    if not isinstance(choices, list):
        raise _bad(engine, "chunk choices", "is not a list")
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise _bad(engine, f"chunk choices[{position}]", "is not an object")
        field = f"chunk choices[{choice.get('index', position)}]"
        ids = choice.get("token_ids")
        if ids is not None:
            _ids(engine, f"{field}.token_ids", ids)
        content = _content(engine, f"{field}.logprobs", choice.get("logprobs"))
        if content:
            _content_logprobs(engine, f"{field}.logprobs.content", content)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            _check_tool_calls(engine, f"{field}.delta.tool_calls", delta.get("tool_calls"))


def _check_tool_calls(engine: str, field: str, calls: Any) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _bad(engine, field, "is not a list")
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise _bad(engine, f"{field}[{i}]", "is not an object")
        function = call.get("function")
        starts = isinstance(function, dict) and function.get("name") is not None
        call_id = call.get("id")
        if starts and not (isinstance(call_id, str) and call_id):
            raise _bad(
                engine, f"{field}[{i}].id", f"is missing on the call's first delta: {call_id!r}"
            )
