"""A local engine peer that speaks the OpenAI chat wire as llama.cpp's server does.

Its replies have the shape of ``llama-cpp-python``'s ``python -m llama_cpp.server``
(recorded from it: ``tests/fixtures/engines/llamacpp_chat*.json``): text and, when asked,
per-token ``logprobs.content`` (token strings, ``bytes: null``, ``top_logprobs``), and
never any token ids (it ignores ``return_token_ids``). Streamed: a first chunk with the
role, one chunk per token with its ``delta.content`` and logprob entry, a last chunk with
an empty ``delta`` and the finish reason, then ``[DONE]``; no usage chunk. Plain: the
message, logprobs, finish reason and ``usage``. Like llama.cpp it decodes one request at a
time, and a stream that finds another request waiting ends at once with ``[DONE]`` and no
finish reason (its server's ``interrupt_requests``, on by default).

What it says is a pure function of the request (its messages and seed), so a run with the
generation cut and one without it can be compared reply for reply. Every reply is logged
(:attr:`LlamaCppPeer.replies`, by completion id) with its text, finish reason and usage.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.support.live_server import serve_app

_WORDS = ("The", " answer", " is", " here", ".", " Done", " now", ",", " thanks", "!")


@dataclass
class LlamaCppPeer:
    url: str
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every reply sent, by completion id: ``{text, tokens, finish_reason, usage, streamed}``
    (``tokens``: ``(token, logprob)`` pairs)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    token_delay_s: float = 0.0
    """Decode time per token: with it, calls overlap, and wait for each other."""
    interrupted: int = 0
    """Streams ended early because another request was waiting (as llama.cpp's server does
    with ``interrupt_requests``, its default)."""


def _tokens(request: dict[str, Any]) -> list[tuple[str, float]]:
    key = orjson.dumps([request.get("messages"), request.get("seed")])
    digest = hashlib.blake2b(key, digest_size=32).digest()
    count = 3 + digest[0] % 6
    budget = request.get("max_tokens")
    if isinstance(budget, int):
        count = min(count, budget)
    return [(_WORDS[digest[i + 1] % len(_WORDS)], -(digest[i + 1] % 64) / 16) for i in range(count)]


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "bytes": None,
        "logprob": logprob,
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": None}],
    }


def create_llama_cpp_app(peer: LlamaCppPeer) -> FastAPI:
    app = FastAPI()
    # llama.cpp decodes one request at a time; a stream that sees another request waiting
    # for the model ends at once with [DONE] (no finish reason), as its server does.
    model = asyncio.Lock()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "smollm2", "object": "model", "owned_by": "me"}]}

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        tokens = _tokens(body)
        text = "".join(t for t, _ in tokens)
        budget = body.get("max_tokens")
        finish = "length" if isinstance(budget, int) and len(tokens) >= budget else "stop"
        prompt_tokens = 10 * len(body.get("messages") or ())
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "total_tokens": prompt_tokens + len(tokens),
        }
        with peer.lock:
            completion_id = f"chatcmpl-{len(peer.replies)}"
            peer.replies[completion_id] = {
                "text": text,
                "tokens": tokens,
                "finish_reason": finish,
                "usage": usage,
                "streamed": body.get("stream") is True,
            }
        # As llama.cpp: logprobs only with top_logprobs set (it passes top_logprobs on).
        logprobs = body.get("logprobs") is True and body.get("top_logprobs") is not None
        head = {"id": completion_id, "model": "smollm2", "created": 1764600000}
        if body.get("stream") is not True:
            async with model:
                await asyncio.sleep(peer.token_delay_s * len(tokens))
            reply = {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": (
                            {"content": [_entry(*t) for t in tokens], "refusal": None}
                            if logprobs
                            else None
                        ),
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
            return Response(orjson.dumps(reply), media_type="application/json")

        def chunk(delta: dict[str, Any], lp: Any, finish_reason: str | None) -> bytes:
            event = {
                **head,
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
                ],
            }
            return b"data: " + orjson.dumps(event) + b"\r\n\r\n"

        async def events() -> AsyncIterator[bytes]:
            async with model:
                yield chunk({"role": "assistant"}, None, None)
                for token, logprob in tokens:
                    await asyncio.sleep(peer.token_delay_s)
                    if model._waiters:  # another request waits: llama.cpp's interrupt
                        with peer.lock:
                            peer.interrupted += 1
                        yield b"data: [DONE]\r\n\r\n"
                        return
                    lp = (
                        {"content": [_entry(token, logprob)], "refusal": None} if logprobs else None
                    )
                    yield chunk({"content": token}, lp, None)
                yield chunk({}, None, finish)
                yield b"data: [DONE]\r\n\r\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextmanager
def llama_cpp_peer(token_delay_s: float = 0.0) -> Iterator[LlamaCppPeer]:
    """Serve the peer on a free loopback port; yield it (its ``url`` ends before ``/v1``)."""
    peer = LlamaCppPeer(url="", token_delay_s=token_delay_s)
    with serve_app(create_llama_cpp_app(peer)) as url:
        peer.url = url
        yield peer
