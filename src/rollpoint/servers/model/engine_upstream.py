"""The model server's upstream: the one HTTP client it reaches the engine through.

Owns the engine's URLs and the headers sent with every call (``api_key``, or the run's data
token for the built-in scripted policy; the callers' own auth is never forwarded), the
client session from the server's start to its stop, and what the engine's answers become
(:class:`EngineUpstream`): unreachable, timed out or a 5xx → :class:`TransportError` (502
``transport_error``); a 4xx passed through with its status and body (the engine refused the
request, not the plumbing); a streamed request read whole (:class:`UpstreamAnswer`); and
``GET /v1/models`` and ``GET /v1/models/{id}``, answered from the engine's list. And
:class:`HeldStream`: a streamed reply that lets go of the engine's response and the gate
however it ends.

Does not own: which calls go upstream and when (the model server, its generation cut and
its weight switch), nor recording them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from yarl import URL

from rollpoint.http.auth import data_token
from rollpoint.http.client import HttpClient
from rollpoint.protocol.errors import ModelNotFoundError, TransportError
from rollpoint.servers.model.generation_cut import PartialCall
from rollpoint.servers.model.stream_assembler import StreamAssembler

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServerSettings

UPSTREAM_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)
"""How a call that got no answer from the engine fails: unreachable, timed out, cut off."""


@dataclass(slots=True)
class UpstreamAnswer:
    """How the engine answered a streamed request: refused, streamed, or plain JSON."""

    refusal: tuple[int, str, bytes] | None = None
    assembler: StreamAssembler | None = None
    plain: bytes | None = None


class HeldStream(StreamingResponse):
    """A streamed reply that releases the upstream response and the gate however it ends.

    Starlette may never start the body iterator (client gone early), so cleanup cannot live
    in the iterator's ``finally``.
    """

    def __init__(self, body: AsyncIterator[bytes], stack: AsyncExitStack, **kw: Any) -> None:
        super().__init__(body, **kw)
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


class EngineUpstream:
    """The engine as one model server reaches it: URLs, auth headers, client session."""

    def __init__(self, settings: ModelServerSettings, engine: str) -> None:
        self.settings = settings
        self.engine = engine
        """The engine adapter's name, which a malformed chunk's refusal names."""
        self._client: HttpClient | None = None
        base = settings.upstream_url.rstrip("/")
        # Parsed once: aiohttp would parse a str URL again on every call.
        self.completions_url = URL(f"{base}/chat/completions")
        self._models_url = f"{base}/models"
        self.headers = {"content-type": "application/json"}
        upstream_key = settings.api_key
        if upstream_key is None and settings.upstream_data_token:
            upstream_key = data_token()
        if upstream_key:
            self.headers["authorization"] = f"Bearer {upstream_key}"
        self.control_headers = {k: v for k, v in self.headers.items() if k != "content-type"}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("model server is not started")
        return self._client.session

    async def start(self) -> None:
        self._client = HttpClient(timeout_s=self.settings.call_timeout_s)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def stream(self, body: dict[str, Any], partial: PartialCall) -> UpstreamAnswer:
        """POST ``body`` (streamed) and read the whole stream, ``partial`` kept current;
        or the engine's refusal (status >= 400), or its plain reply when it answered JSON."""
        try:
            async with self.session.post(
                self.completions_url, data=orjson.dumps(body), headers=self.headers
            ) as resp:
                if resp.status >= 400:
                    return UpstreamAnswer(
                        refusal=(resp.status, resp.content_type, await resp.read())
                    )
                if resp.content_type != "text/event-stream":
                    return UpstreamAnswer(plain=await resp.read())
                assembler = StreamAssembler(partial=partial, engine=self.engine)
                async for chunk in resp.content.iter_any():
                    assembler.feed(chunk)
                assembler.feed(b"\n")
                return UpstreamAnswer(assembler=assembler)
        except UPSTREAM_ERRORS as exc:
            raise self.unreachable(exc) from None

    async def models(self) -> Response:
        try:
            async with self.session.get(self._models_url, headers=self.headers) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.content_type
        except UPSTREAM_ERRORS as exc:
            raise self.unreachable(exc) from None
        if status >= 400:
            return self.refusal(status, content_type, raw)
        return Response(raw, media_type=content_type)

    async def model(self, model_id: str) -> Response:
        """One model's card, found in the upstream's list."""
        listing = await self.models()
        if listing.status_code >= 400:
            return listing
        try:
            cards = orjson.loads(bytes(listing.body))["data"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise TransportError("upstream's model list is not an OpenAI model list") from None
        for card in cards if isinstance(cards, list) else ():
            if isinstance(card, dict) and card.get("id") == model_id:
                return Response(orjson.dumps(card), media_type="application/json")
        raise ModelNotFoundError(f"the model '{model_id}' does not exist upstream")

    async def post(self, body: bytes) -> tuple[int, str, bytes]:
        """POST ``body`` as it came: the engine's status, content type and bytes."""
        try:
            async with self.session.post(
                self.completions_url, data=body, headers=self.headers
            ) as resp:
                return resp.status, resp.content_type, await resp.read()
        except UPSTREAM_ERRORS as exc:
            raise self.unreachable(exc) from None

    def unreachable(self, exc: BaseException) -> TransportError:
        """The error of a call that got no answer from the engine."""
        return TransportError(
            f"upstream {self.settings.upstream_url} unreachable: {type(exc).__name__}: {exc}"
        )

    def refusal(self, status: int, content_type: str, raw: bytes) -> Response:
        """The engine's refusal as the caller gets it: a 4xx as it came, a 5xx raised."""
        if status >= 500:
            text = raw[:200].decode(errors="replace")
            raise TransportError(f"upstream answered HTTP {status}: {text}")
        return Response(raw, status_code=status, media_type=content_type)
