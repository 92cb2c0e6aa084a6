"""The scripted policy behind a call counter: the source of truth for policy calls in a test.

Owns serving the scripted policy app on loopback (in a thread of the test process) with a
middleware that counts every chat completion received, and how many are being answered right
now. A run pointed at it (``policy.base_url``) makes exactly the calls counted here, whatever
happens to its own processes, so a test can count work re-done across a kill and a rerun.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from tests.support.live_server import serve_app


@dataclass
class PolicyCalls:
    total: int = 0
    """Chat completions received."""
    in_flight: int = 0
    """Received and not yet answered in full."""
    authorizations: set[str] = field(default_factory=set)
    """Every ``Authorization`` header the calls carried."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.total, self.in_flight


class _Counter:
    def __init__(self, app: ASGIApp, calls: PolicyCalls) -> None:
        self._app = app
        self._calls = calls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self._app(scope, receive, send)
            return
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        with self._calls.lock:
            self._calls.total += 1
            self._calls.in_flight += 1
            self._calls.authorizations.add(auth)
        try:
            await self._app(scope, receive, send)
        finally:
            with self._calls.lock:
                self._calls.in_flight -= 1


@contextmanager
def counting_policy(*, latency_ms: float, seed: int = 0) -> Iterator[tuple[str, PolicyCalls]]:
    """The policy's ``/v1`` URL and its counter, while it serves."""
    app = create_policy_app(PolicySettings(seed=seed, latency_ms=latency_ms, error_rate=0.0))
    calls = PolicyCalls()
    app.add_middleware(_Counter, calls=calls)
    with serve_app(app) as url:
        yield f"{url}/v1", calls
