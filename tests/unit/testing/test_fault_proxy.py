"""The fault proxy against a real upstream: every fault kind, matching, streaming, stats.

The upstream is a small FastAPI app served by uvicorn in a thread; it counts the requests
it processed, so each test can tell "the upstream acted" from "the request never got
there".
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rollpoint.http.app import create_app
from rollpoint.http.client import HttpClient
from rollpoint.protocol.errors import ConfigError, ProtocolError, TransportError
from rollpoint.testing import Fault, FaultKind, FaultProxy, ProxiedRequest
from tests.support.live_server import serve_app


class Upstream:
    """What the upstream app saw, shared with its server thread."""

    def __init__(self) -> None:
        self.processed: list[dict[str, Any]] = []
        self.second_line = threading.Event()

    def app(self) -> FastAPI:
        app = create_app("fault proxy upstream")

        @app.api_route("/echo/{rest:path}", methods=["GET", "POST"])
        async def echo(rest: str, request: Request) -> dict[str, Any]:
            seen = {
                "method": request.method,
                "path": f"/echo/{rest}",
                "query": request.url.query,
                "auth": request.headers.get("authorization"),
                "body": (await request.body()).decode(),
            }
            self.processed.append(seen)
            return seen

        @app.get("/missing")
        async def missing() -> StreamingResponse:
            return StreamingResponse(iter([b'{"error": "gone"}']), status_code=404)

        @app.post("/stream")
        async def stream() -> StreamingResponse:
            async def lines() -> AsyncIterator[bytes]:
                yield b'{"line": 1}\n'
                # The second line waits for the test: it can only have read the first one
                # if the proxy passed it on before the upstream finished.
                await asyncio.to_thread(self.second_line.wait, 10)
                yield b'{"line": 2}\n'

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        @app.get("/sse")
        async def sse() -> StreamingResponse:
            events = [b"data: one\n\n", b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")

        return app


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    state = Upstream()
    with serve_app(state.app()) as url:
        yield state, url
    state.second_line.set()


@pytest.fixture
async def proxy(upstream: tuple[Upstream, str]) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(upstream[1]) as proxy:
        yield proxy


@pytest.fixture
async def http() -> AsyncIterator[HttpClient]:
    async with HttpClient(token="secret", timeout_s=10) as client:
        yield client


async def test_passes_requests_and_replies_through_unchanged(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    state, _ = upstream
    reply = await http.post_json(f"{proxy.url}/echo/a%20b?x=1&y=2", {"k": "v"})
    assert reply == {
        "method": "POST",
        "path": "/echo/a b",
        "query": "x=1&y=2",
        "auth": "Bearer secret",
        "body": '{"k":"v"}',
    }
    with pytest.raises(ProtocolError, match=r"HTTP 404: \{'error': 'gone'\}"):
        await http.get_json(f"{proxy.url}/missing")
    assert proxy.stats.requests == 2 and proxy.stats.forwarded == 2
    assert proxy.stats.faulted == {}
    assert len(state.processed) == 1


async def test_streams_reach_the_client_chunk_by_chunk(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    state, _ = upstream
    lines = http.stream_ndjson(f"{proxy.url}/stream", None)
    async with asyncio.timeout(5):
        first = await anext(lines)
    assert first == {"line": 1}
    state.second_line.set()
    assert [line async for line in lines] == [{"line": 2}]

    async with http.session.get(f"{proxy.url}/sse") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert await resp.read() == b"data: one\n\ndata: [DONE]\n\n"


async def test_drop_reply_lets_the_upstream_act_and_loses_its_reply(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    state, _ = upstream
    rule = proxy.add(Fault.drop_reply(path="/echo/commit"))
    with pytest.raises(TransportError, match="Disconnected"):
        await http.post_json(f"{proxy.url}/echo/commit", {"n": 1})
    assert rule.hit.is_set() and rule.hits == rule.taken == 1
    assert [s["body"] for s in state.processed] == ['{"n":1}']
    # times=1: the retry goes through and the upstream acts again.
    assert (await http.post_json(f"{proxy.url}/echo/commit", {"n": 2}))["body"] == '{"n":2}'
    assert rule.taken == 1 and proxy.rules == []
    assert proxy.stats.faulted == {FaultKind.DROP_REPLY: 1}


async def test_delay_forwards_after_the_wait(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    rule = proxy.add(Fault.delay(0.3, path="/echo/"))
    started = time.monotonic()
    pending = asyncio.create_task(http.get_json(f"{proxy.url}/echo/slow"))
    await rule.wait(timeout_s=2)
    assert upstream[0].processed == []
    assert (await pending)["path"] == "/echo/slow"
    assert time.monotonic() - started >= 0.3


async def test_reset_never_reaches_the_upstream(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    rule = proxy.add(Fault.reset(method="POST"))
    with pytest.raises(TransportError):
        await http.post_json(f"{proxy.url}/echo/x", {})
    assert rule.hit.is_set()
    assert upstream[0].processed == []
    await http.get_json(f"{proxy.url}/echo/get-is-not-matched")
    assert len(upstream[0].processed) == 1


async def test_refuse_partitions_until_healed(
    upstream: tuple[Upstream, str], proxy: FaultProxy
) -> None:
    parked = proxy.add(Fault.hold(path="/echo/bystander"))
    rule = proxy.add(Fault.refuse(path="/echo/prepare"))
    async with aiohttp.ClientSession() as bystander, aiohttp.ClientSession() as other:
        # A connection open at the partition (here: its request is parked) is cut by it.
        # POST: aiohttp would retry an idempotent GET on a fresh connection by itself.
        open_call = asyncio.create_task(bystander.post(f"{proxy.url}/echo/bystander"))
        await parked.wait(timeout_s=2)
        with pytest.raises(aiohttp.ClientError):
            await other.post(f"{proxy.url}/echo/prepare", data=b"{}")
        await rule.wait(timeout_s=1)
        assert proxy.stats.partitioned
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await open_call
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectorError):
                await fresh.get(f"{proxy.url}/echo/during")
        assert upstream[0].processed == []
        await proxy.heal()
        async with bystander.get(f"{proxy.url}/echo/after") as resp:
            assert resp.status == 200
    assert proxy.stats.partitions == 1 and not proxy.stats.partitioned
    assert [s["path"] for s in upstream[0].processed] == ["/echo/after"]


async def test_refuse_with_forward_loses_the_reply_of_a_request_the_upstream_took(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    proxy.add(Fault.refuse(path="/echo/prepare", forward=True))
    with pytest.raises(TransportError):
        await http.post_json(f"{proxy.url}/echo/prepare", {"id": "c1"})
    assert [s["body"] for s in upstream[0].processed] == ['{"id":"c1"}']
    with pytest.raises(TransportError, match="Cannot connect"):
        await http.post_json(f"{proxy.url}/echo/resume", {"id": "c1"})
    await proxy.heal()
    assert (await http.post_json(f"{proxy.url}/echo/resume", {}))["path"] == "/echo/resume"


async def test_hold_forwards_nothing_until_released(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    rule = proxy.add(Fault.hold(path="/echo/held", times=None))
    first = asyncio.create_task(http.get_json(f"{proxy.url}/echo/held"))
    second = asyncio.create_task(http.get_json(f"{proxy.url}/echo/held"))
    await rule.wait(hits=2, timeout_s=2)
    assert upstream[0].processed == [] and not first.done() and not second.done()
    proxy.release(rule)
    assert [r["path"] for r in await asyncio.gather(first, second)] == ["/echo/held"] * 2
    assert len(upstream[0].processed) == 2


async def test_garbage_answers_200_with_a_body_that_is_not_the_protocol(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    proxy.add(Fault.garbage(path="/echo/"))
    with pytest.raises(TransportError, match="not JSON"):
        await http.get_json(f"{proxy.url}/echo/g")
    assert upstream[0].processed == []
    # Valid JSON of the wrong shape is garbage too, for a client that validates replies.
    proxy.add(Fault.garbage(body=b'{"hello": "world"}', path="/echo/", forward=True))
    assert await http.get_json(f"{proxy.url}/echo/g2") == {"hello": "world"}
    assert [s["path"] for s in upstream[0].processed] == ["/echo/g2"]


async def test_error_answers_the_given_status_and_body(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    envelope = {"error": {"code": "deadline_exceeded", "message": "late", "retryable": True}}
    proxy.add(Fault.error(409, envelope, path="/echo/"))
    with pytest.raises(ProtocolError, match="late") as refused:
        await http.get_json(f"{proxy.url}/echo/e")
    assert refused.value.code == "deadline_exceeded"
    proxy.add(Fault.error(503, "overloaded"))
    with pytest.raises(TransportError, match="overloaded"):
        await http.get_json(f"{proxy.url}/echo/e")
    assert upstream[0].processed == []


async def test_rules_match_by_method_path_and_predicate_in_order(
    upstream: tuple[Upstream, str], proxy: FaultProxy, http: HttpClient
) -> None:
    def for_c2(request: ProxiedRequest) -> bool:
        body = request.json()
        return isinstance(body, dict) and body.get("checkpoint_id") == "c2"

    by_body = proxy.add(Fault.error(418, "teapot", path=re.compile(r"/commit$"), when=for_c2))
    by_header = proxy.add(
        Fault.error(451, "header", when=lambda r: r.headers.get("x-fault") == "yes", times=None)
    )
    catch_all = proxy.add(Fault.error(500, "first match wins", path="/echo/", times=None))

    async def status(path: str, body: Any = None, **headers: str) -> int:
        async with http.session.post(
            f"{proxy.url}{path}", data=orjson.dumps(body), headers=headers
        ) as resp:
            return resp.status

    assert await status("/echo/commit", {"checkpoint_id": "c1"}) == 500
    assert await status("/echo/commit", {"checkpoint_id": "c2"}) == 418
    assert await status("/echo/commit", {"checkpoint_id": "c2"}) == 500  # times=1 spent
    assert await status("/echo/x", **{"x-fault": "yes"}) == 451
    assert await status("/echo/x", **{"x-fault": "yes"}) == 451  # always
    assert await status("/other") == 404  # no rule: the upstream's own answer
    assert (by_body.hits, by_header.hits, catch_all.hits) == (1, 2, 2)
    assert proxy.rules == [by_header, catch_all]
    await proxy.heal()
    assert proxy.rules == []
    assert await status("/echo/commit", {"checkpoint_id": "c2"}) == 200


async def test_a_predicate_that_raises_is_a_clear_500(proxy: FaultProxy, http: HttpClient) -> None:
    proxy.add(Fault.reset(when=lambda r: r.json()["missing"]))
    with pytest.raises(TransportError, match="predicate failed"):
        await http.post_json(f"{proxy.url}/echo/x", [1])


async def test_other_processes_reach_it_by_url(proxy: FaultProxy) -> None:
    proxy.add(Fault.error(503, "from the proxy", path="/echo/"))
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        "    urllib.request.urlopen(sys.argv[1], timeout=5)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code, e.read().decode())\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, f"{proxy.url}/echo/x", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await child.communicate()
    assert out.decode().strip() == "503 from the proxy"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Fault.reset(times=0), "times must be >= 1"),
        (lambda: Fault.delay(-1), "seconds must be >= 0"),
        (lambda: Fault.error(700), "status must be 100..599"),
        (lambda: Fault(FaultKind.RESET, forward=True), "forward applies to"),
    ],
)
def test_bad_faults_are_refused_with_a_clear_message(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


async def test_closing_drops_held_requests(
    upstream: tuple[Upstream, str], http: HttpClient
) -> None:
    async with FaultProxy(upstream[1]) as proxy:
        rule = proxy.add(Fault.hold())
        held = asyncio.create_task(http.get_json(f"{proxy.url}/echo/h"))
        await rule.wait(timeout_s=2)
    with pytest.raises(TransportError):
        await held
    assert upstream[0].processed == []
