"""A stand-in for NeMo-Gym's stateful counter resources server, speaking its wire on loopback.

NeMo-Gym needs Python 3.12 or later, so its servers cannot run next to rollpoint here. This
server answers the routes of NeMo-Gym's ``example_session_state_mgmt`` resources server as
recorded from NeMo-Gym's public source (``tests/fixtures/nemo_gym/wire.json`` names the files
and the commit): a session per cookie (the cookie NeMo-Gym's session middleware sets),
``/seed_session`` with the task row (its ``initial_count``), the tools
``/increment_counter`` (``{"count": int}`` → ``{"success": true}``) and
``/get_counter_value`` (→ ``{"count": int}``), ``/verify`` (the row plus a Responses API
``response`` → the same with ``reward``: 1.0 when ``expected_count`` is the counter) and
``/close_session``; a body that does not validate is FastAPI's 422 ``{"detail": [...]}``.
``/verify`` and ``/close_session`` end the session, as in NeMo-Gym.

It also keeps what the tests count from (the environment's own state): every increment it
applied, in order, by session, at ``GET /stand-in/log`` (a route NeMo-Gym's server does not
have). ``python -m rollpoint.testing.nemo_gym_counter --port 8011`` runs it (``--port 0``: a free
port, said on stdout as ``port N``) (the example of
docs/environments.md, "NeMo-Gym").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
from typing import Any

import orjson
from aiohttp import web

COOKIE = "StatefulCounterResourcesServer___example_session_state_mgmt_resources_server"
"""The cookie NeMo-Gym's session middleware names ``<server class>___<config name>``."""


def _missing(field: str, body: Any) -> web.Response:
    detail = [{"type": "missing", "loc": ["body", field], "msg": "Field required", "input": body}]
    return web.json_response({"detail": detail}, status=422)


def _int_type(field: str, value: Any) -> web.Response:
    detail = [
        {
            "type": "int_type",
            "loc": ["body", field],
            "msg": "Input should be a valid integer",
            "input": value,
        }
    ]
    return web.json_response({"detail": detail}, status=422)


class CounterServer:
    """The counter's sessions and the log of every increment applied."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.log: list[dict[str, Any]] = []

    def session(self, request: web.Request) -> tuple[str, bool]:
        """The request's session id, and whether it is new (the reply sets the cookie)."""
        known = request.cookies.get(COOKIE)
        if known:
            return known, False
        return secrets.token_hex(16), True

    @staticmethod
    async def body(request: web.Request) -> Any:
        raw = await request.read()
        return orjson.loads(raw) if raw else {}

    def reply(self, data: Any, session: str, new: bool) -> web.Response:
        response = web.json_response(data)
        if new:
            response.set_cookie(COOKIE, session, httponly=True, samesite="Lax")
        return response

    async def seed_session(self, request: web.Request) -> web.Response:
        session, new = self.session(request)
        body = await self.body(request)
        if not isinstance(body, dict) or "initial_count" not in body:
            return _missing("initial_count", body)
        if type(body["initial_count"]) is not int:
            return _int_type("initial_count", body["initial_count"])
        self.counters.setdefault(session, body["initial_count"])
        return self.reply({}, session, new)

    async def increment_counter(self, request: web.Request) -> web.Response:
        session, new = self.session(request)
        body = await self.body(request)
        if not isinstance(body, dict) or "count" not in body:
            return _missing("count", body)
        if type(body["count"]) is not int:
            return _int_type("count", body["count"])
        self.counters[session] = self.counters.get(session, 0) + body["count"]
        self.log.append({"session": session, "count": body["count"]})
        return self.reply({"success": True}, session, new)

    async def get_counter_value(self, request: web.Request) -> web.Response:
        session, new = self.session(request)
        return self.reply({"count": self.counters.setdefault(session, 0)}, session, new)

    async def verify(self, request: web.Request) -> web.Response:
        session, new = self.session(request)
        body = await self.body(request)
        for field in ("responses_create_params", "response", "expected_count"):
            if not isinstance(body, dict) or field not in body:
                return _missing(field, body)
        reward = 0.0
        if session in self.counters:
            reward = float(body["expected_count"] == self.counters.pop(session))
        return self.reply({**body, "reward": reward}, session, new)

    async def close_session(self, request: web.Request) -> web.Response:
        session, new = self.session(request)
        self.counters.pop(session, None)
        return self.reply({}, session, new)

    async def stand_in_log(self, request: web.Request) -> web.Response:
        return web.json_response({"increments": self.log, "counters": self.counters})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/seed_session", self.seed_session)
        app.router.add_post("/increment_counter", self.increment_counter)
        app.router.add_post("/get_counter_value", self.get_counter_value)
        app.router.add_post("/verify", self.verify)
        app.router.add_post("/close_session", self.close_session)
        app.router.add_get("/stand-in/log", self.stand_in_log)
        return app


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:``port`` (0: a free one) until cancelled; says ``port N`` once up."""
    runner = web.AppRunner(CounterServer().app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"port {bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8011, help="0: a free port")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port))


if __name__ == "__main__":
    main()
