"""The client transport seam: one reused aiohttp session per process for the data plane.

Every outbound call of rollpoint (agent → model, agent → tools, model → engine,
trainer → agent streams, coordinator → participants) goes through :class:`HttpClient`,
so tests and the fault injector see the same code paths as production. Errors come back
typed: a peer's refusal is rebuilt from its envelope (:func:`error_from_wire`); a peer
that is down, times out or answers garbage is a :class:`TransportError`.

No call waits forever: every request is bounded by its ``timeout_s`` or, when that is None
(the default, or an explicit None), by the client's own ``timeout_s``; there is no way to
ask for no timeout (aiohttp reads a per-request ``timeout=None`` as "none at all"). A stream
is bounded by the time it may stay silent (a peer that accepts and never answers is a
:class:`TransportError` after ``timeout_s``), unless its caller says, by name, that its own
deadline ends it (``caller_deadline=True``: the dispatcher's row deadlines).

Why aiohttp and not httpx on the data plane: measured on a 2-core machine, a FastAPI
proxy hop at 32 concurrent calls did 1,114 calls/s with aiohttp and 250 calls/s with httpx.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from rollpoint.http.ndjson_lines import DEFAULT_MAX_LINE_BYTES, OversizedLine, capped_lines
from rollpoint.protocol.errors import ConfigError, TransportError, error_from_wire


def _bounded(name: str, seconds: float) -> float:
    if not (isinstance(seconds, int | float) and 0 < seconds < math.inf):
        raise ConfigError(
            f"http client: {name} must be a finite number of seconds > 0, got {seconds!r}"
        )
    return float(seconds)


def _why(exc: BaseException, timeout: aiohttp.ClientTimeout) -> str:
    if isinstance(exc, TimeoutError):
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"TimeoutError: could not connect within {timeout.sock_connect:g}s"
        if timeout.total is not None:
            return f"TimeoutError: no answer within {timeout.total:g}s"
        return f"TimeoutError: nothing received for {timeout.sock_read:g}s"
    return f"{type(exc).__name__}: {exc}"


class HttpClient:
    """A thin, typed wrapper over one :class:`aiohttp.ClientSession`.

    Create it inside a running event loop; close it with :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        limit: int = 0,
        limit_per_host: int = 0,
    ) -> None:
        """``limit_per_host``: most connections to one host and port; requests beyond wait
        for one, and then ``timeout_s`` bounds each read on the wire instead of the whole
        request (a request queued on purpose must not time out for the queue).
        ``timeout_s`` and ``connect_timeout_s`` must be finite and positive."""
        self._token = token
        self._queued = bool(limit_per_host)
        self._timeout_s = _bounded("timeout_s", timeout_s)
        self._connect_s = _bounded("connect_timeout_s", connect_timeout_s)
        self._timeout = self._timeout_of(None)
        # limit=0: no pool cap; concurrency is bounded by the callers (dispatcher, gate).
        # keepalive below uvicorn's 5 s idle close: otherwise a loop busy at that moment sends
        # its next request on a connection the server is closing (ServerDisconnected).
        connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=limit_per_host, ttl_dns_cache=300, keepalive_timeout=4
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )

    @property
    def timeout_s(self) -> float:
        """What bounds a call that names no timeout of its own."""
        return self._timeout_s

    def _timeout_of(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        """The bound of one call: ``timeout_s``, or the client's when None (never unbounded)."""
        bound = self._timeout_s if timeout_s is None else _bounded("timeout_s", timeout_s)
        if self._queued:  # the wait for a pooled connection is not the peer's fault
            return aiohttp.ClientTimeout(sock_connect=self._connect_s, sock_read=bound)
        return aiohttp.ClientTimeout(total=bound, sock_connect=self._connect_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    def _headers(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self._token:
            out["authorization"] = f"Bearer {self._token}"
        if headers:
            out.update(headers)
        return out

    async def request_json(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Send ``body`` as JSON and return the decoded JSON reply; raise typed errors."""
        decoded, _ = await self.request_json_with_headers(
            method, url, body=body, headers=headers, timeout_s=timeout_s
        )
        return decoded

    async def request_json_with_headers(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[Any, Mapping[str, str]]:
        """Like :meth:`request_json`, also returning the reply headers (case-insensitive)."""
        data = orjson.dumps(body) if body is not None else None
        timeout = self._timeout_of(timeout_s)
        try:
            async with self._session.request(
                method, url, data=data, headers=self._headers(headers), timeout=timeout
            ) as resp:
                raw = await resp.read()
                status = resp.status
                reply_headers = resp.headers
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"{method} {url}: {_why(exc, timeout)}") from None
        try:
            decoded = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            if status >= 400:
                raise error_from_wire(
                    status, raw[:200].decode(errors="replace"), peer=url
                ) from None
            raise TransportError(f"{method} {url}: reply is not JSON") from None
        if status >= 400:
            raise error_from_wire(status, decoded, peer=url)
        return decoded, reply_headers

    async def post_json(self, url: str, body: Any, **kw: Any) -> Any:
        return await self.request_json("POST", url, body=body, **kw)

    async def get_json(self, url: str, **kw: Any) -> Any:
        return await self.request_json("GET", url, **kw)

    async def stream_ndjson(
        self,
        url: str,
        body: Any,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        caller_deadline: bool = False,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> AsyncIterator[Any]:
        """POST ``body`` and yield each JSON line of the reply as it arrives.

        A line longer than ``max_line_bytes`` is read and dropped, and an
        :class:`~rollpoint.http.ndjson_lines.OversizedLine` is yielded in its place
        (:mod:`rollpoint.http.ndjson_lines`): the caller decides what that costs.

        ``timeout_s`` (None: the client's) bounds how long the stream may stay silent, not
        its whole length. ``caller_deadline=True`` says, explicitly, that the caller ends the
        stream on a deadline of its own (the dispatcher's row deadlines, on the pause clock:
        a snapshot pause may keep a stream quiet longer than any fixed time), and then
        only the connect is bounded here."""
        silent_s = self._timeout_s if timeout_s is None else _bounded("timeout_s", timeout_s)
        timeout = aiohttp.ClientTimeout(
            sock_connect=self._connect_s, sock_read=None if caller_deadline else silent_s
        )
        try:
            async with self._session.post(
                url, data=orjson.dumps(body), headers=self._headers(headers), timeout=timeout
            ) as resp:
                if resp.status >= 400:
                    raw = await resp.read()
                    try:
                        decoded: Any = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        decoded = raw[:200].decode(errors="replace")
                    raise error_from_wire(resp.status, decoded, peer=url)
                # Not resp.content.readline(): it refuses lines over 512 KiB (LineTooLong).
                async for line in capped_lines(resp.content.iter_any(), max_line_bytes):
                    if isinstance(line, OversizedLine):
                        yield line
                        continue
                    try:
                        yield orjson.loads(line)
                    except orjson.JSONDecodeError:
                        raise TransportError(f"POST {url}: stream line is not JSON") from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"POST {url}: {_why(exc, timeout)}") from None

    async def aclose(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
