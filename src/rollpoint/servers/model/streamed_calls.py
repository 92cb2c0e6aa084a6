"""Streamed callers: a ``"stream": true`` call relayed from the engine as it comes.

Owns the relay (:class:`StreamedCalls`, held by the model server). The call passes the gate
and the retired-attempt check and is posted upstream as it was asked; an engine that
refuses it before streaming is answered as a plain call's refusal. Then the engine's bytes
go to the caller chunk by chunk, read on the way by a
:class:`~rollpoint.servers.model.stream_assembler.StreamAssembler` when the call is tagged
(and, with ``cut_generations`` on, kept as the call's output so far in the server's
``partials``). A stream that ends whole, of an attempt not retired meanwhile, is recorded
(with its token segments when it spanned a weight update). One that broke, or carried a
malformed chunk (not relayed), ends short for the caller; one that ended with no finish
reason was relayed as it came; neither is recorded (logged). The gate and the engine's
response are let go however the reply ends
(:class:`~rollpoint.servers.model.engine_upstream.HeldStream`).

Does not own: a streamed caller's saved prefix, which is not continued (it is taken and
refused before the relay: :mod:`rollpoint.servers.model.cut_calls`), nor recording
(:mod:`rollpoint.servers.model.call_recorder`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from rollpoint.policy.engine_adapters import EngineAdapter
from rollpoint.protocol.errors import StaleAttemptError, TransportError
from rollpoint.protocol.ids import HEADER_POLICY_VERSION
from rollpoint.protocol.token_data import TokenSegment
from rollpoint.servers.model.engine_upstream import UPSTREAM_ERRORS, HeldStream
from rollpoint.servers.model.episode_tag import EpisodeTag
from rollpoint.servers.model.generation_cut import PartialCall, request_digest
from rollpoint.servers.model.stream_assembler import StreamAssembler

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServer

log = logging.getLogger(__name__)


class StreamedCalls:
    """The relay of one model server's streamed calls."""

    def __init__(self, server: ModelServer, adapter: EngineAdapter) -> None:
        self._server = server
        self._adapter = adapter

    async def call(
        self,
        body: bytes,
        payload: dict[str, Any],
        tag: EpisodeTag | None,
        regenerated: str | None = None,
    ) -> Response:
        """Relay the engine's stream for ``body`` (``regenerated``: why the call's saved prefix
        was not continued, for its record)."""
        server = self._server
        stack = AsyncExitStack()
        await stack.enter_async_context(server.gate.admit())
        try:
            server.guard(tag)
        except BaseException:
            await stack.aclose()
            raise
        stack.enter_context(server.running.track(tag))
        version = server.policy_version
        started = time.perf_counter()
        try:
            resp = await stack.enter_async_context(
                server.upstream.session.post(
                    server.upstream.completions_url, data=body, headers=server.upstream.headers
                )
            )
            refusal = None
            if resp.status >= 400:
                refusal = (resp.status, resp.content_type, await resp.read())
        except UPSTREAM_ERRORS as exc:
            await stack.aclose()
            raise server.upstream.unreachable(exc) from None
        except BaseException:
            await stack.aclose()
            raise
        if refusal is not None:
            await stack.aclose()
            server.calls_total += 1
            return server.upstream.refusal(*refusal)

        partial = None
        if server.settings.cut_generations and tag is not None:
            partial = PartialCall(
                tag.rollout_id, tag.attempt, tag.turn, version, request=request_digest(body)
            )

        async def relay() -> AsyncIterator[bytes]:
            assembler = (
                StreamAssembler(self._adapter.stream(), partial, self._adapter.name)
                if tag is not None
                else None
            )
            if partial is not None:
                server.partials[id(partial)] = partial
            try:
                async for chunk in resp.content.iter_any():
                    if assembler is not None:
                        assembler.feed(chunk)
                    yield chunk
            except UPSTREAM_ERRORS as exc:
                log.warning("upstream stream broke: %s: %s", type(exc).__name__, exc)
                return
            except TransportError as exc:
                # A malformed chunk, not relayed: the caller's stream ends short (a
                # transport failure it retries) and the call is not filed.
                log.warning("upstream stream refused: %s", exc.message)
                return
            finally:
                if partial is not None:
                    server.partials.pop(id(partial), None)
            server.calls_total += 1
            server.call_seconds.observe(time.perf_counter() - started)
            if assembler is not None and tag is not None and not self._retired(tag):
                try:
                    assembler.check_finished(server.settings.upstream_url)
                    read = assembler.tokens.result() if assembler.tokens is not None else None
                    # The bytes are relayed already; the call is just not filed (never half).
                    server.recorder.record(
                        tag,
                        payload,
                        assembler.message(),
                        assembler.finish_reason,
                        assembler.usage,
                        version=version,
                        latency=time.perf_counter() - started,
                        streamed=True,
                        read=read,
                        completion_id=assembler.completion_id,
                        # Spanned a weight update (keep): the headers left before it did.
                        segments=_spanning(partial),
                        regenerated=regenerated,
                    )
                except TransportError as exc:
                    log.warning("stream of %s not recorded: %s", tag.rollout_id, exc.message)

        return HeldStream(
            relay(),
            stack,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={HEADER_POLICY_VERSION: str(version), "cache-control": "no-cache"},
        )

    def _retired(self, tag: EpisodeTag) -> bool:
        try:
            self._server.guard(tag)
        except StaleAttemptError:
            return True
        return False


def _spanning(partial: PartialCall | None) -> list[TokenSegment] | None:
    """The segments of a call that spanned a weight update; None for one of one version."""
    if partial is None:
        return None
    segments = partial.segments()
    return segments if len(segments) > 1 else None
