"""The generation cut on the call path: a tagged plain call streamed from the engine, and
continued from its saved prefix after a restore.

Owns what becomes of a tagged one-choice plain call while the cut is on (:class:`CutCalls`,
held by the model server):

- it is sent upstream streamed, its output so far listed in the server's ``partials``
  while it runs;
- its rollout's saved prefix (the server's ``prefixes``: same turn, an earlier attempt) is
  taken and continued, unless a refusal rule says no
  (:func:`~rollpoint.servers.model.generation_cut.refusal`) or the engine answers the
  continuation with a 4xx: then the call is decoded from scratch and the reason counted;
- a stream the engine aborted for a weight update is streamed again from the same start
  once the new weights are live;
- the plain reply is assembled from the chunks (or passed on as the engine answered, when
  it answered plain JSON), stitched behind its prefix, stamped with the version its first
  token was sampled under and its token segments, and recorded.

A streamed caller's or a many-choice call's saved prefix is taken and refused here too
(:meth:`CutCalls.take_prefix`, :meth:`CutCalls.refused`).

Does not own: the saved forms and the rules (:mod:`rollpoint.servers.model.generation_cut`),
saving and installing prefixes (:mod:`rollpoint.servers.model.model_participant`), nor the
streamed callers' relay (:mod:`rollpoint.servers.model.streamed_calls`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from fastapi.responses import Response

from rollpoint.policy.engine_adapters import EngineAdapter
from rollpoint.protocol.errors import TransportError
from rollpoint.protocol.ids import HEADER_POLICY_VERSION
from rollpoint.protocol.token_data import TokenSegment
from rollpoint.servers.model.engine_upstream import UpstreamAnswer
from rollpoint.servers.model.episode_tag import EpisodeTag
from rollpoint.servers.model.generation_cut import (
    HEADER_TOKEN_SEGMENTS,
    CallPrefix,
    PartialCall,
    continuation_body,
    refusal,
    request_digest,
    segments_header,
    stitch,
)
from rollpoint.servers.model.stream_assembler import clean_message

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServer

log = logging.getLogger(__name__)


class CutCalls:
    """The generation cut's side of one model server's calls."""

    def __init__(self, server: ModelServer, adapter: EngineAdapter) -> None:
        self._server = server
        self._adapter = adapter

    def take_prefix(self, tag: EpisodeTag | None) -> CallPrefix | None:
        """The saved prefix a replacement call continues: same rollout and turn, a later
        attempt. A prefix its rollout has moved past is dropped."""
        if tag is None:
            return None
        prefix = self._server.prefixes.get(tag.rollout_id)
        if prefix is None or prefix.attempt >= tag.attempt:
            return None
        del self._server.prefixes[tag.rollout_id]
        return prefix if prefix.turn == tag.turn else None

    def refused(self, tag: EpisodeTag, reason: str) -> None:
        self._server.cut.refused(reason)
        log.info("saved prefix of %s turn %d regenerated: %s", tag.rollout_id, tag.turn, reason)

    async def call(self, raw_body: bytes, payload: dict[str, Any], tag: EpisodeTag) -> Response:
        """A plain call streamed from the engine (its partial output known throughout),
        continued from its saved prefix when there is one and nothing refuses it."""
        server = self._server
        prefix = self.take_prefix(tag)
        reason: str | None = None
        asked = request_digest(raw_body)
        async with server.gate.admit():
            server.guard(tag)
            with server.running.track(tag):
                version = server.policy_version
                started = time.perf_counter()
                up: UpstreamAnswer | None = None
                if prefix is not None:
                    reason = refusal(
                        payload,
                        prefix,
                        engine=self._adapter.name,
                        enabled=server.settings.continue_prefixes,
                        policy_version=version,
                        request=asked,
                    )
                if prefix is not None and reason is None:
                    partial = PartialCall.continuing(
                        prefix, attempt=tag.attempt, version=version, prompt=prefix.prompt()
                    )
                    body = continuation_body(payload, prefix, self._adapter.name)
                    up, partial = await self._stream_again_if_aborted(tag, body, partial)
                    if up.refusal is not None:
                        # An engine that cannot take the prefix says so with a 4xx.
                        reason, up = "engine_refused", None
                if up is None:
                    partial = PartialCall(
                        tag.rollout_id, tag.attempt, tag.turn, version, request=asked
                    )
                    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
                    up, partial = await self._stream_again_if_aborted(tag, body, partial)
                latency = time.perf_counter() - started
        server.calls_total += 1
        if up.refusal is not None:
            return server.upstream.refusal(*up.refusal)
        continued = prefix is not None and reason is None
        raw = up.plain
        if raw is not None:
            # An engine that answers plain JSON to a streamed request: its reply as it is.
            try:
                reply = orjson.loads(raw)
                if not isinstance(reply["choices"][0]["message"], dict):
                    raise TypeError
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
                raise TransportError("upstream reply is not an OpenAI chat completion") from None
            fresh = len(reply["choices"][0].get("token_ids") or ())
        else:
            assert up.assembler is not None
            # A continuation's partial starts with the prefix: the reply holds its own
            # tokens, and the prefix goes back in front when it is stitched.
            skip_ids = skip_entries = 0
            if continued and prefix is not None:
                skip_ids = prefix.count
                skip_entries = prefix.count if prefix.completion_logprobs is not None else 0
            # A stream that ends before choice 0 has a finish reason was cut short (llama.cpp's
            # server ends one with [DONE] when another request waits): no reply, a failure.
            up.assembler.check_finished(server.settings.upstream_url)
            reply = up.assembler.reply(partial, skip_ids, skip_entries)
            fresh = len(partial.ids) - skip_ids
        segments = None
        spans = partial.segments() if raw is None else []
        if not continued and spans:
            # The version its first token was sampled under; more than one: it spanned a
            # weight update (keep mode) and carries each version's run.
            version = spans[0].policy_version
            if len(spans) > 1:
                segments = spans
        headers = {HEADER_POLICY_VERSION: str(version)}
        if segments is not None:
            headers[HEADER_TOKEN_SEGMENTS] = segments_header(segments)
        if continued and prefix is not None:
            segments = spans or [
                *prefix.segments,
                TokenSegment(policy_version=version, tokens=fresh),
            ]
            stitch(reply, prefix)
            raw = None
            server.cut.continued += 1
            server.cut.continued_tokens += prefix.count
            headers[HEADER_TOKEN_SEGMENTS] = segments_header(segments)
        elif prefix is not None and reason is not None:
            self.refused(tag, reason)
        # Retired while it ran: its caller was stopped, so the reply is refused, not filed.
        server.guard(tag)
        choice = reply["choices"][0]
        # Malformed token data raises here: the call fails whole and nothing is filed.
        read = self._adapter.read(reply)
        server.recorder.record(
            tag,
            payload,
            clean_message(choice["message"]),
            choice.get("finish_reason"),
            reply.get("usage"),
            version=version,
            latency=latency,
            streamed=False,
            read=read,
            completion_id=reply.get("id"),
            segments=segments,
            continued_tokens=prefix.count if segments is not None and prefix is not None else 0,
            regenerated=reason,
        )
        body_out = raw if raw is not None else orjson.dumps(reply)
        return Response(body_out, media_type="application/json", headers=headers)

    async def _stream_again_if_aborted(
        self, tag: EpisodeTag, body: dict[str, Any], partial: PartialCall
    ) -> tuple[UpstreamAnswer, PartialCall]:
        """Stream ``body``; a stream the engine aborted for a weight update is streamed
        again, from the same start, once the new weights are live."""
        aborts = 0
        while True:
            start = partial.clone_start()
            up = await self._stream_upstream(body, partial)
            if up.assembler is None or up.assembler.finish_reason != "abort":
                return up, partial
            aborts += 1
            await self._server.after_abort(tag, aborts)
            partial = start
            partial.version = self._server.policy_version

    async def _stream_upstream(self, body: dict[str, Any], partial: PartialCall) -> UpstreamAnswer:
        """The engine's answer to ``body`` streamed
        (:meth:`~rollpoint.servers.model.engine_upstream.EngineUpstream.stream`), ``partial``
        listed in the server's ``partials`` while it runs."""
        key = id(partial)
        self._server.partials[key] = partial
        try:
            return await self._server.upstream.stream(body, partial)
        finally:
            del self._server.partials[key]
