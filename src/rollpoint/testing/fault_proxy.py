"""A fault-injecting HTTP proxy: one real server in front of one upstream, failing on command.

Owns a small aiohttp server on ``host:port`` (127.0.0.1 and a free port by default) that
forwards every request to one upstream base URL through one reused client session and
streams each reply back chunk by chunk, so NDJSON streams and SSE pass through as the
upstream produces them. A test adds rules; each is a :class:`~rollpoint.testing.fault.Fault`
(what to do, to which requests, how many times). Rules are tried in the order they were
added and the first one that matches with hits left takes the request; a request no rule
takes is forwarded untouched. Each rule counts its hits and sets its ``hit`` event when
its fault has taken effect, so a test can wait for "the reply was lost" rather than sleep.

It is a real HTTP server on a real socket: servers under test and other processes reach
it by :attr:`FaultProxy.url`. It lives on the event loop that starts it (its rules' events
belong to that loop) and is not thread-safe.

It knows nothing of rollpoint's protocol (faults match methods, paths and bytes, not
verbs) and does not decide which faults a test needs::

    async with FaultProxy(server_url) as proxy:
        rule = proxy.add(Fault.drop_reply(path="/rollpoint/v1/checkpoint/commit"))
        client = ParticipantClient(ParticipantAddress(kind, replica, proxy.url), http)
        ...
        await rule.wait()
        await proxy.heal()
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from rollpoint.protocol.errors import ConfigError, LaunchError, TransportError
from rollpoint.testing.fault import Fault, FaultKind, ProxiedRequest

log = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        # Recomputed on each hop: the body is re-framed (replies are streamed chunked).
        "content-length",
        "host",
    }
)
# The client session adds these when absent; a transparent proxy must not.
_NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_REBIND_WAIT_S = 2.0
_SHUTDOWN_S = 1.0


class Rule:
    """A fault added to a proxy, with its counters and its ``hit`` event."""

    def __init__(self, fault: Fault, number: int) -> None:
        self.fault = fault
        self.number = number
        self.taken = 0
        """Requests this rule took (``times`` counts these)."""
        self.hits = 0
        """Times the fault took effect (see :class:`FaultKind` for when)."""
        self.hit = asyncio.Event()
        """Set the first time the fault takes effect; stays set."""
        self.active = True
        """False once removed, released or healed: it takes no more requests."""
        self._released = asyncio.Event()
        self._bumped = asyncio.Event()

    @property
    def exhausted(self) -> bool:
        return self.fault.times is not None and self.taken >= self.fault.times

    async def wait(self, hits: int = 1, *, timeout_s: float = 10.0) -> None:
        """Wait until the fault took effect ``hits`` times; :class:`TimeoutError` naming the
        rule if it did not in time."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.hits < hits:
                    await self._bumped.wait()
        except TimeoutError:
            raise TimeoutError(
                f"{self!r} took effect {self.hits} time(s), not {hits}, within {timeout_s}s"
            ) from None

    def _take(self, request: ProxiedRequest) -> bool:
        if not self.active or self.exhausted or not self.fault.match.matches(request):
            return False
        self.taken += 1
        return True

    def _took_effect(self) -> None:
        self.hits += 1
        self.hit.set()
        # Waiters hold the old event: setting it wakes them, the fresh one is for next time.
        bumped, self._bumped = self._bumped, asyncio.Event()
        bumped.set()

    def _retire(self) -> None:
        self.active = False
        self._released.set()

    def __repr__(self) -> str:
        times = "always" if self.fault.times is None else f"{self.taken}/{self.fault.times}"
        return f"<rule {self.number}: {self.fault.kind} {self.fault.match.describe()} ({times})>"


class Rules:
    """The rules in force, in the order they are tried: what the fault proxy and the fault
    transport (:mod:`rollpoint.testing.fault_transport`) share. Numbers rules as added."""

    def __init__(self) -> None:
        self._rules: list[Rule] = []
        self._numbers = itertools.count(1)

    def add(self, fault: Fault) -> Rule:
        rule = Rule(fault, next(self._numbers))
        self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        """Stop applying ``rule``; what it holds goes on."""
        rule._retire()
        if rule in self._rules:
            self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule (each one's held requests go on)."""
        for rule in list(self._rules):
            self.remove(rule)

    def retire_all(self) -> None:
        """Retire every rule without removing it (the proxy is closing)."""
        for rule in self._rules:
            rule._retire()

    def take(self, request: ProxiedRequest) -> Rule | None:
        """The first rule that takes ``request`` (counting it), if any."""
        return next((r for r in self._rules if r._take(request)), None)

    @property
    def active(self) -> list[Rule]:
        return [r for r in self._rules if r.active and not r.exhausted]


class RuleCommands:
    """The rule commands of a fault-injecting front (the fault proxy, the fault transport
    of :mod:`rollpoint.testing.fault_transport`): a test adds, removes and lists rules the
    same way on either. The front keeps its :class:`Rules` in ``_rules``."""

    _rules: Rules

    def add(self, fault: Fault) -> Rule:
        """Apply ``fault`` to the matching requests from now on (after earlier rules)."""
        return self._rules.add(fault)

    def remove(self, rule: Rule) -> None:
        """Stop applying ``rule``; requests it holds go on."""
        self._rules.remove(rule)

    def release(self, rule: Rule) -> None:
        """Let the requests ``rule`` holds go on, and hold no more (same as :meth:`remove`)."""
        self.remove(rule)

    @property
    def rules(self) -> list[Rule]:
        """The rules still in force, in the order they are tried."""
        return self._rules.active


@dataclass(frozen=True)
class ProxyStats:
    requests: int
    """Requests received (connections refused while partitioned never arrive)."""
    by_route: Mapping[str, int]
    """Requests received per ``"METHOD /path"``."""
    forwarded: int
    faulted: Mapping[FaultKind, int]
    open_connections: int
    partitions: int
    partitioned: bool


_Action = Callable[[web.BaseRequest, ProxiedRequest, Rule], Awaitable[web.StreamResponse]]


class FaultProxy(RuleCommands):
    """A real HTTP proxy in front of ``upstream``; use as an async context manager. Its
    rules: :class:`RuleCommands` (a request a removed rule held is forwarded)."""

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if not upstream.startswith(("http://", "https://")):
            raise ConfigError(f"fault proxy: upstream must be an http(s) URL, got {upstream!r}")
        self.upstream = upstream.rstrip("/")
        self.host = host
        self._port = port
        self._connect_timeout_s = connect_timeout_s
        self._rules = Rules()
        self._by_route: Counter[str] = Counter()
        self._forwarded = 0
        self._partitions = 0
        self._faulted: Counter[FaultKind] = Counter()
        self._partitioned = False
        self._closing = False
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: web.Server | None = None
        self._runner: web.ServerRunner | None = None
        self._site: web.SockSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._actions: dict[FaultKind, _Action] = {
            FaultKind.DROP_REPLY: self._drop_reply,
            FaultKind.DELAY: self._delay,
            FaultKind.RESET: self._reset,
            FaultKind.REFUSE: self._refuse,
            FaultKind.HOLD: self._hold,
            FaultKind.GARBAGE: self._answer,
            FaultKind.ERROR: self._answer,
        }

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._runner is None:
            raise ConfigError("fault proxy: not started (use `async with FaultProxy(...)`)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}"

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._server = web.Server(self._handle, access_log=None)
        self._runner = web.ServerRunner(self._server, shutdown_timeout=_SHUTDOWN_S)
        await self._runner.setup()
        await self._listen()
        return self

    async def aclose(self) -> None:
        """Stop serving: held and delayed requests are dropped, every connection is cut."""
        if self._runner is None:
            return
        self._closing = True
        self._rules.retire_all()
        self._cut_all()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self._runner = self._server = self._site = self._session = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- commands ----------------------------------------------------------------------

    async def partition(self) -> None:
        """Refuse new connections and cut every open one, until :meth:`heal`."""
        if self._partitioned:
            return
        self._partitioned = True
        self._partitions += 1
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        self._cut_all()

    async def heal(self) -> None:
        """Undo every fault: rules removed, held requests forwarded, and after a partition
        the proxy listens again on the same port."""
        self._rules.clear()
        if self._partitioned:
            await self._listen()
            self._partitioned = False

    @property
    def stats(self) -> ProxyStats:
        return ProxyStats(
            requests=sum(self._by_route.values()),
            by_route=dict(self._by_route),
            forwarded=self._forwarded,
            faulted=dict(self._faulted),
            open_connections=len(self._server.connections) if self._server is not None else 0,
            partitions=self._partitions,
            partitioned=self._partitioned,
        )

    # --- serving -----------------------------------------------------------------------

    async def _listen(self) -> None:
        assert self._runner is not None
        sock = await _bind(self.host, self._port)
        self._port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        self._site = site

    def _cut_all(self) -> None:
        if self._server is None:
            return
        for handler in self._server.connections:
            if handler.transport is not None:
                handler.transport.abort()

    async def _handle(self, raw: web.BaseRequest) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            return await self._serve(raw)
        finally:
            self._handlers.discard(task)

    async def _serve(self, raw: web.BaseRequest) -> web.StreamResponse:
        self._by_route[f"{raw.method} {raw.path}"] += 1
        if self._partitioned or self._closing:
            # Accepted just before the listener closed: a partition loses it too.
            return _cut(raw)
        request = ProxiedRequest(
            raw.method, raw.path, raw.query_string, raw.headers, await raw.read()
        )
        try:
            rule = self._rules.take(request)
        except Exception as exc:
            log.exception("fault proxy: a rule's predicate failed on %s %s", raw.method, raw.path)
            return _json_reply(
                500, TransportError(f"fault proxy: a rule's predicate failed: {exc!r}").to_wire()
            )
        if rule is None:
            return await self._pass_through(raw, request)
        self._faulted[rule.fault.kind] += 1
        return await self._actions[rule.fault.kind](raw, request, rule)

    def _send(self, raw: web.BaseRequest, request: ProxiedRequest) -> Any:
        assert self._session is not None
        self._forwarded += 1
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP
        )
        return self._session.request(
            request.method,
            URL(self.upstream + raw.raw_path, encoded=True),
            data=request.body or None,
            headers=headers,
            skip_auto_headers=_NO_AUTO_HEADERS,
            allow_redirects=False,
        )

    async def _pass_through(
        self, raw: web.BaseRequest, request: ProxiedRequest
    ) -> web.StreamResponse:
        reply: web.StreamResponse | None = None
        try:
            async with self._send(raw, request) as upstream:
                reply = web.StreamResponse(
                    status=upstream.status,
                    reason=upstream.reason,
                    headers=_end_to_end(upstream.headers),
                )
                await reply.prepare(raw)
                async for chunk in upstream.content.iter_any():
                    await reply.write(chunk)
                await reply.write_eof()
                return reply
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if reply is not None and reply.prepared:
                # The status is out: a broken upstream (or client) can only break the reply.
                return _cut(raw)
            failure = TransportError(
                f"fault proxy: upstream {self.upstream} failed: {type(exc).__name__}: {exc}"
            )
            return _json_reply(502, failure.to_wire())

    async def _exchange(self, raw: web.BaseRequest, request: ProxiedRequest) -> None:
        """Forward and read the whole reply, which the caller throws away."""
        try:
            async with self._send(raw, request) as upstream:
                await upstream.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("fault proxy: upstream failed on a faulted request: %r", exc)

    # --- one action per fault kind -----------------------------------------------------

    async def _drop_reply(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        await self._exchange(raw, request)
        reply = _cut(raw)
        rule._took_effect()
        return reply

    async def _delay(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        rule._took_effect()
        await asyncio.sleep(rule.fault.seconds)
        return await self._pass_through(raw, request)

    async def _reset(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        reply = _cut(raw, reset=True)
        rule._took_effect()
        return reply

    async def _refuse(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        if rule.fault.forward:
            await self._exchange(raw, request)
        reply = _cut(raw)
        await self.partition()
        rule._took_effect()
        return reply

    async def _hold(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        rule._took_effect()
        await rule._released.wait()
        if self._closing or self._partitioned:
            return _cut(raw)
        return await self._pass_through(raw, request)

    async def _answer(
        self, raw: web.BaseRequest, request: ProxiedRequest, rule: Rule
    ) -> web.StreamResponse:
        fault = rule.fault
        if fault.forward:
            await self._exchange(raw, request)
        rule._took_effect()
        return web.Response(
            status=fault.status, body=fault.body, headers={"Content-Type": fault.content_type}
        )


def _end_to_end(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)


def _cut(raw: web.BaseRequest, *, reset: bool = False) -> web.StreamResponse:
    """Close the client's connection with no response (``reset``: with an RST)."""
    transport = raw.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if reset and sock is not None:
            # Linger 0: close() sends an RST instead of a FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    # Never written (the connection is gone); aiohttp needs a response object all the same.
    return web.Response()


def _json_reply(status: int, body: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; after a partition, the same port again (a
    connection of this machine may hold it for a moment)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + _REBIND_WAIT_S
    while True:
        # IPPROTO_TCP: asyncio sets TCP_NODELAY only when the socket says TCP.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or port == 0 or time.monotonic() > deadline:
                raise LaunchError(
                    f"fault proxy: cannot listen on {host}:{port}: {exc.strerror}"
                ) from None
        await asyncio.sleep(0.05)
