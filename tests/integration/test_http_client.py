"""The data-plane client's connection cap, against a real local HTTP server.

With ``limit_per_host`` the client keeps at most that many connections to one server and
queues the rest; the queue does not count against a call's timeout (an agent capping its
calls to the model server must not time calls out for waiting their turn), the wire does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from rollpoint.http.client import HttpClient
from rollpoint.protocol.errors import TransportError

pytestmark = pytest.mark.integration


@dataclass
class SlowServer:
    url: str
    open_now: int = 0
    most_open: int = 0


@pytest.fixture
async def slow_server() -> AsyncIterator[SlowServer]:
    server = SlowServer(url="")

    async def slow(request: web.Request) -> web.Response:
        server.open_now += 1
        server.most_open = max(server.most_open, server.open_now)
        try:
            await asyncio.sleep(float(request.query.get("s", "0.1")))
            return web.json_response({"ok": True})
        finally:
            server.open_now -= 1

    app = web.Application()
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{port}/slow"
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_a_capped_client_holds_at_most_that_many_calls_open_and_queues_the_rest(
    slow_server: SlowServer,
) -> None:
    async with HttpClient(limit_per_host=2, timeout_s=5) as client:
        replies = await asyncio.gather(*(client.get_json(slow_server.url) for _ in range(6)))
    assert replies == [{"ok": True}] * 6
    assert slow_server.most_open == 2


async def test_time_in_the_queue_does_not_count_against_the_timeout_the_wire_does(
    slow_server: SlowServer,
) -> None:
    async with HttpClient(limit_per_host=1, timeout_s=5) as client:
        # Five calls of 0.2 s each through one connection: the last waits ~0.8 s, well past
        # its 0.5 s timeout, yet only its 0.2 s on the wire counts.
        calls = [client.get_json(f"{slow_server.url}?s=0.2", timeout_s=0.5) for _ in range(5)]
        assert await asyncio.gather(*calls) == [{"ok": True}] * 5
        with pytest.raises(TransportError, match="Timeout"):
            await client.get_json(f"{slow_server.url}?s=1.0", timeout_s=0.3)
    # Without a cap the timeout bounds the whole call, as before.
    async with HttpClient(timeout_s=5) as uncapped:
        with pytest.raises(TransportError, match="Timeout"):
            await uncapped.get_json(f"{slow_server.url}?s=1.0", timeout_s=0.3)
