"""The model server's call journal: every finished policy call, durable before its reply leaves.

Owns: the model server's :class:`~rollpoint.store.journal.Journal` (a folder in the
snapshot store, ``<store>/journal/model/<name>-<replica>/``), what one ``policy_call``
record holds (the reply's bytes and headers as the caller got them, the canonical digest of
the request, and the call ledger's record of the call, token trace included), and answering
a call again from it.

One call, under the journal::

    tagged ─▶ journaled call of (rollout, turn) with the same request? ─ yes ─▶ its reply
                                      │ no
                                      └─▶ the engine ─▶ ledger ─▶ append (durable) ─▶ reply

Keys across a restore. A restored session resumes under the *next* attempt
(``Session.from_record``: ``episode.next_attempt()``), so the call it makes again for turn
``t`` carries attempt ``a + 1`` where the journaled one carries ``a``: the journal key
``model|r|a<a>|t<t>|c0`` differs. A call is therefore answered from the journaled call of
the same rollout and turn with the highest attempt at or below the caller's, *when the
request is the same* (the digest of its JSON body with sorted keys: messages, tools, seed,
sampling): a continued attempt asks exactly what the saved session asked, so it gets the
recorded reply; a call whose conversation differs (a fresh attempt whose earlier turns went
another way) is a different call and goes to the engine. Nothing changes in the agent.

Streamed callers (``"stream": true``) are relayed as the engine sends them, all but the
stream's last chunk: that one is held until the call is journaled (the ledger files the
call when the engine's stream ends), so a caller that got the whole stream got a journaled
call, and one whose stream broke before its end retries it (a transport failure) and is
answered from the journal if the record was made. The record keeps the event stream's
bytes as relayed; an answer from it is that stream in one body (``text/event-stream``), the
same events a streaming client reads.

Does not own: the segment format, group commit or retention (:mod:`rollpoint.store.journal`),
proxying or token reading (the model server).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import HEADER_POLICY_VERSION
from rollpoint.protocol.manifest import JournalMark
from rollpoint.servers.model.call_ledger import CallRecord, json_form
from rollpoint.servers.model.episode_tag import EpisodeTag
from rollpoint.servers.model.generation_cut import HEADER_TOKEN_SEGMENTS
from rollpoint.store.journal import Journal, Position
from rollpoint.store.journal_format import journal_key
from rollpoint.store.journal_shipping import (
    Shipping,
    journal_relative,
    journal_url,
    open_store_journal,
)

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServer

log = logging.getLogger(__name__)

KIND = "policy_call"
_KEPT_HEADERS = (HEADER_POLICY_VERSION, HEADER_TOKEN_SEGMENTS)


def request_key(payload: dict[str, Any]) -> str:
    """The digest a re-issued call must match: its JSON body with sorted keys, so a session
    restored from a snapshot (same values, maybe another key order) asks the same call."""
    canonical = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


@dataclass(slots=True)
class CallJournalCounts:
    journaled: int = 0
    """Calls appended since this server started."""
    answered: int = 0
    """Calls answered from the journal (never sent to the engine)."""
    recovered: int = 0
    """Calls found in the journal when it was opened (earlier processes' calls)."""


class CallJournal:
    """The journal of one model server; open with :meth:`open`, serve calls with :meth:`serve`."""

    def __init__(self, journal: Journal, server: ModelServer) -> None:
        self.journal = journal
        self.shipping: Shipping | None = None
        """Shipping the journal to an fsspec store from this machine's spool (None: the
        store is a local folder, the journal is in it): :mod:`rollpoint.store.journal_shipping`."""
        self._server = server
        self.relative = journal_relative("model", server.settings.name, server.settings.replica)
        self.counts = CallJournalCounts()
        self._by_turn: dict[tuple[str, int], dict[int, str]] = {}
        """(rollout, turn) -> {attempt: journal key} of every journaled call."""
        for rec in journal.records_after():
            if rec.kind == KIND:
                self._index(rec.key)
                self.counts.recovered += 1

    @classmethod
    async def open(cls, folder: str, server: ModelServer, *, window_s: float) -> CallJournal:
        journal = await asyncio.to_thread(Journal.open, folder, window_s=window_s)
        return await asyncio.to_thread(cls, journal, server)

    @property
    def position(self) -> Position:
        return self.journal.position

    def mark(self) -> JournalMark:
        """Where the journal stands as a cut opens (the commit saves it), after forgetting
        the calls in segments retention deleted: the index keeps what the kept snapshots'
        positions still need, nothing older."""
        if self.journal.forget_removed():
            kept = {}
            for turn, attempts in self._by_turn.items():
                left = {a: k for a, k in attempts.items() if k in self.journal}
                if left:
                    kept[turn] = left
            self._by_turn = kept
        position = self.journal.checkpoint()
        return JournalMark(folder=self.relative, segment=position.segment, offset=position.offset)

    def _index(self, key: str) -> None:
        # model|<rollout>|a<attempt>|t<turn>|c<call>: journal_key refuses parts with '|'.
        _, rollout_id, attempt, turn, _ = key.split("|")
        self._by_turn.setdefault((rollout_id, int(turn[1:])), {})[int(attempt[1:])] = key

    def _journaled(self, tag: EpisodeTag, asked: str) -> dict[str, Any] | None:
        """The journaled call a call of ``tag`` asking ``asked`` is answered with, or None."""
        attempts = self._by_turn.get((tag.rollout_id, tag.turn))
        if not attempts:
            return None
        for attempt in sorted((a for a in attempts if a <= tag.attempt), reverse=True):
            rec = self.journal.lookup(attempts[attempt])
            if rec is None:  # dropped by retention
                continue
            value: dict[str, Any] = rec.value()
            if value.get("request") == asked:
                return value
        return None

    async def serve(
        self, request: Request, inner: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """One ``/v1/chat/completions`` call: from the journal when it holds it, else from
        ``inner`` (the model server), journaled before the reply is returned."""
        tag = EpisodeTag.from_headers(request.headers)
        if tag is None:
            return await inner(request)
        try:
            payload = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return await inner(request)  # refused there, with the model server's message
        if not isinstance(payload, dict):
            return await inner(request)
        asked = request_key(payload)
        found = self._journaled(tag, asked)
        if found is not None:
            # Through the gate as an engine call is: a cut in progress holds it, so the
            # ledger does not change under a checkpoint's capture.
            async with self._server.gate.admit():
                return self._answer(tag, found)
        filed_before = self._last_call(tag)
        response = await inner(request)
        if response.status_code != 200:
            return response
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._journaled_stream(
                tag, asked, response, response.body_iterator, filed_before
            )
            return response
        await self._append(tag, asked, response, bytes(response.body), filed_before)
        return response

    def _last_call(self, tag: EpisodeTag) -> CallRecord | None:
        calls = self._server.ledger.calls(tag.rollout_id)
        return calls[-1] if calls else None

    async def _append(
        self,
        tag: EpisodeTag,
        asked: str,
        response: Response,
        body: bytes,
        filed_before: CallRecord | None,
    ) -> None:
        """Journal the call ``response`` answered, if the ledger filed it during the call
        (``filed_before``: its last record before it)."""
        last = self._last_call(tag)
        if last is None or last is filed_before:
            return  # filed nothing: retired while it ran, or its stream broke
        if (last.attempt, last.turn) != (tag.attempt, tag.turn):
            return
        key = journal_key("model", tag.rollout_id, tag.attempt, tag.turn, 0)
        value = {
            "request": asked,
            "content_type": response.media_type,
            "headers": {h: response.headers[h] for h in _KEPT_HEADERS if h in response.headers},
            "body": body.decode(),
            "record": json_form(last),
        }
        await self.journal.append_json(key, KIND, value)
        self._index(key)
        self.counts.journaled += 1

    async def _journaled_stream(
        self,
        tag: EpisodeTag,
        asked: str,
        response: StreamingResponse,
        chunks: AsyncIterable[str | bytes | memoryview],
        filed_before: CallRecord | None,
    ) -> AsyncIterator[bytes]:
        """The stream's chunks as they come, the last one held until the call is journaled."""
        relayed: list[bytes] = []
        held: bytes | None = None
        async for chunk in chunks:
            if held is not None:
                yield held
            held = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
            relayed.append(held)
        # The relay has ended: the ledger filed the call if the stream was whole.
        await self._append(tag, asked, response, b"".join(relayed), filed_before)
        if held is not None:
            yield held

    def _answer(self, tag: EpisodeTag, found: dict[str, Any]) -> Response:
        """The recorded reply, filed in the ledger again under the caller's attempt."""
        self._server.guard(tag)
        started = time.perf_counter()
        record = CallRecord.model_validate(
            {**found["record"], "attempt": tag.attempt, "turn": tag.turn, "latency_s": 0.0}
        )
        self._server.ledger.record(record)
        self.counts.answered += 1
        log.debug(
            "call %s#%d turn %d answered from the journal in %.1f ms",
            tag.rollout_id,
            tag.attempt,
            tag.turn,
            (time.perf_counter() - started) * 1000,
        )
        return Response(
            found["body"].encode(), media_type=found["content_type"], headers=found["headers"]
        )

    async def close(self) -> None:
        if self.shipping is not None:
            await self.shipping.aclose()  # what is left shipped, while the journal is open
        await self.journal.close()


async def open_call_journal(server: ModelServer) -> CallJournal | None:
    """The server's call journal when its settings ask for one (None otherwise)."""
    settings = server.settings
    if not settings.journal:
        return None
    root = settings.snapshot_root
    if root is None:
        raise ConfigError(
            f"model server {settings.name}/{settings.replica}: journal needs a snapshot store"
        )
    relative = journal_relative("model", settings.name, settings.replica)
    folder = journal_url(root, relative)
    journal, shipping = await open_store_journal(root, relative, window_s=settings.journal_window_s)
    opened = await asyncio.to_thread(CallJournal, journal, server)
    opened.shipping = shipping
    log.info(
        "model server %s/%s: call journal %s holds %d calls",
        settings.name,
        settings.replica,
        folder,
        opened.counts.recovered,
    )
    return opened
