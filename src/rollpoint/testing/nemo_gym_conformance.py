"""The NeMo-Gym face of the conformance kit: check a server speaks NeMo-Gym's session routes.

Owns :func:`check_nemo_gym`, which drives a resources server the way the ``nemo-gym:``
environment (:mod:`rollpoint.envs.nemo_gym_env`) and NeMo-Gym's own agent do, with the
first row of a task file, and returns a :class:`~rollpoint.testing.conformance.ConformanceReport`;
``rollpoint conformance URL --nemo-gym ROWS.jsonl`` prints it. The shapes are the ones
recorded from NeMo-Gym's public source (``tests/fixtures/nemo_gym/wire.json``):

- ``seed_session``: ``POST /seed_session`` with the row answers 200 with a JSON object and
  sets the session cookie;
- ``tool routes``: each function tool of the row, called with arguments drawn from its
  schema on that session, answers 200;
- ``tool validation``: a tool with required arguments called with none answers FastAPI's
  422 ``{"detail": [...]}`` (rollpoint shows it to the model, as NeMo-Gym's agent does);
- ``unknown route``: ``POST`` to a tool name the server does not have answers 404;
- ``verify``: ``POST /verify`` with the row and a Responses API ``response`` answers 200
  with a numeric ``reward`` and the request's ``responses_create_params`` and ``response``;
- ``close_session``: answers 2xx, or 404 where the server ends sessions at ``/verify`` only;
- ``replay``: two sessions seeded with the same row and given the same calls answer the same
  replies, which ``@replay`` needs (a failure says to use ``@restart``).

It makes real sessions on the server (seeded, called, verified or closed): run it against a
server no training run uses. NeMo-Gym's checkpoint control routes
(``/ng-control/v1/checkpoint/*``) are NeMo-Gym's coordinator's, not checked here.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from rollpoint.envs.nemo_gym_env import read_rows, responses_api_response
from rollpoint.policy.schema_arguments import sample_arguments
from rollpoint.testing.conformance import CaseResult, ConformanceReport

_TIMEOUT_S = 30.0


class _Failed(Exception):
    pass


def _expect(ok: bool, detail: str) -> None:
    if not ok:
        raise _Failed(detail)


class _Server:
    def __init__(self, url: str, row: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.row = row
        self.tools = [
            t
            for t in row["responses_create_params"].get("tools") or ()
            if isinstance(t, dict) and t.get("type", "function") == "function"
        ]

    def session(self) -> httpx.Client:
        return httpx.Client(timeout=_TIMEOUT_S, headers={"content-type": "application/json"})

    def post(self, client: httpx.Client, route: str, body: Any) -> httpx.Response:
        return client.post(f"{self.url}/{route}", content=orjson.dumps(body))

    @contextlib.contextmanager
    def seeded(self) -> Iterator[httpx.Client]:
        """A session seeded with the row, closed on exit."""
        with self.session() as client:
            reply = self.post(client, "seed_session", self.row)
            _expect(reply.status_code == 200, f"/seed_session answered {reply.status_code}")
            yield client

    def arguments(self, tool: dict[str, Any]) -> dict[str, Any]:
        return sample_arguments(
            tool.get("parameters"), random.Random(f"conformance/{tool['name']}")
        )

    # ---- the cases ----------------------------------------------------------------------
    def seed_session(self) -> str:
        with self.session() as client:
            reply = self.post(client, "seed_session", self.row)
            _expect(reply.status_code == 200, f"/seed_session answered {reply.status_code}")
            _expect(isinstance(reply.json(), dict), f"/seed_session body {reply.text[:100]!r}")
            _expect(bool(reply.cookies), "/seed_session set no session cookie")
            return f"200, cookie {', '.join(reply.cookies.keys())}"

    def tool_routes(self) -> str:
        _expect(bool(self.tools), "the row offers no function tools")
        with self.seeded() as client:
            for tool in self.tools:
                reply = self.post(client, tool["name"], self.arguments(tool))
                _expect(
                    reply.status_code == 200,
                    f"/{tool['name']} answered {reply.status_code}: {reply.text[:200]}",
                )
        return f"{len(self.tools)} tool(s) answered 200"

    def tool_validation(self) -> str:
        tool = next((t for t in self.tools if (t.get("parameters") or {}).get("required")), None)
        if tool is None:
            return "no tool has required arguments: nothing to refuse"
        with self.seeded() as client:
            reply = self.post(client, tool["name"], {})
        _expect(reply.status_code == 422, f"/{tool['name']} with no arguments: {reply.status_code}")
        detail = reply.json().get("detail")
        _expect(isinstance(detail, list) and bool(detail), f"422 body {reply.text[:200]!r}")
        return f"/{tool['name']} with no arguments: 422 with detail"

    def unknown_route(self) -> str:
        with self.seeded() as client:
            reply = self.post(client, "rollpoint_conformance_no_such_tool", {})
        _expect(reply.status_code == 404, f"an unknown tool answered {reply.status_code}")
        return "404"

    def verify(self) -> str:
        with self.seeded() as client:
            response = responses_api_response([], "conformance")
            reply = self.post(client, "verify", {**self.row, "response": response})
        _expect(
            reply.status_code == 200, f"/verify answered {reply.status_code}: {reply.text[:200]}"
        )
        body = reply.json()
        reward = body.get("reward")
        _expect(isinstance(reward, int | float), f"/verify reward {reward!r}")
        for key in ("responses_create_params", "response"):
            _expect(key in body, f"/verify did not echo {key!r}")
        return f"200, reward {reward}"

    def close_session(self) -> str:
        with self.seeded() as client:
            reply = self.post(client, "close_session", {})
        if reply.status_code == 404:
            return "not offered (sessions end at /verify)"
        _expect(200 <= reply.status_code < 300, f"/close_session answered {reply.status_code}")
        return str(reply.status_code)

    def replay(self) -> str:
        replies: list[list[str]] = []
        for _ in range(2):
            with self.seeded() as client:
                replies.append(
                    [self.post(client, t["name"], self.arguments(t)).text for t in self.tools]
                )
        _expect(
            replies[0] == replies[1],
            f"the same calls answered {replies[0]!r} and {replies[1]!r}: use @restart",
        )
        return f"{len(self.tools)} call(s) answered alike in two sessions: @replay fits"


def check_nemo_gym(url: str, rows: Path) -> ConformanceReport:
    """Every case against the server at ``url`` with the first row of ``rows``; a
    :class:`~rollpoint.protocol.errors.ConfigError` for a rows file that is not NeMo-Gym's."""
    server = _Server(url, read_rows(rows, f"nemo-gym rows {rows}")[0])
    cases: list[tuple[str, Callable[[], str]]] = [
        ("seed_session", server.seed_session),
        ("tool routes", server.tool_routes),
        ("tool validation", server.tool_validation),
        ("unknown route", server.unknown_route),
        ("verify", server.verify),
        ("close_session", server.close_session),
        ("replay", server.replay),
    ]
    results = []
    for name, run in cases:
        started = time.monotonic()
        try:
            detail, passed = run(), True
        except _Failed as exc:
            detail, passed = str(exc), False
        except httpx.HTTPError as exc:
            detail, passed = f"{type(exc).__name__}: {exc}", False
        results.append(
            CaseResult(name=name, passed=passed, detail=detail, seconds=time.monotonic() - started)
        )
    return ConformanceReport(url=url, participant="NeMo-Gym resources server", cases=results)
