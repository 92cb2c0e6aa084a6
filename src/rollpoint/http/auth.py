"""Bearer tokens: where a server's token comes from, and the check on every request.

Owns loading a token (a file, else an environment variable; there is no default token),
:class:`BearerAuth`, a FastAPI dependency that accepts a request only when its
``Authorization: Bearer <token>`` matches, compared in constant time, and
:class:`DataRouteGuard`, the middleware that puts the data token (``$ROLLPOINT_DATA_TOKEN``,
optional) in front of every route but the control routes and the health, metrics and schema
pages.
The control routes use the control token, data routes (``/run``, tools, chat) their own, so
a holder of one cannot call the other. A token is never logged nor echoed in an error.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.errors import ConfigError, UnauthorizedError

CONTROL_TOKEN_ENV = "ROLLPOINT_CONTROL_TOKEN"
DATA_TOKEN_ENV = "ROLLPOINT_DATA_TOKEN"
"""Optional: when set, a server's data routes need it and its outbound data calls send it."""
POLICY_API_KEY_ENV = "ROLLPOINT_POLICY_API_KEY"
"""Optional: the engine's key (``policy.api_key``) a model server sends upstream. Secrets
reach server processes by environment, never on their command line."""


def load_token(env_var: str = CONTROL_TOKEN_ENV, file: Path | None = None) -> str:
    """The configured token: the file's content when ``file`` is given, else ``$env_var``.

    Surrounding whitespace is stripped. Nothing configured (or only whitespace) is a
    :class:`ConfigError`: a server must not start unguarded.
    """
    if file is not None:
        try:
            token = file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"token file {file} is empty")
        return token
    token = os.environ.get(env_var, "").strip()
    if not token:
        what = "control token" if env_var == CONTROL_TOKEN_ENV else "token"
        raise ConfigError(f"no {what} configured: set {env_var} or pass a token file")
    return token


class BearerAuth:
    """FastAPI dependency: ``Depends(BearerAuth(token))`` refuses a wrong token with 401."""

    def __init__(self, token: str) -> None:
        if not token.strip():
            raise ConfigError("an empty bearer token guards nothing; configure a real token")
        self._expected = token.encode()

    def __repr__(self) -> str:
        return "BearerAuth(token=<redacted>)"

    def check(self, authorization: str | None) -> None:
        """Raise :class:`UnauthorizedError` unless ``authorization`` carries the token."""
        scheme, _, presented = (authorization or "").partition(" ")
        # compare_digest on bytes: a str with non-ASCII characters would raise TypeError.
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self._expected
        )
        if not ok:
            raise UnauthorizedError("missing or wrong bearer token")

    async def __call__(self, request: Request) -> None:
        self.check(request.headers.get("authorization"))


def data_token() -> str | None:
    """The data-plane token from ``$ROLLPOINT_DATA_TOKEN``; None when unset (data routes open)."""
    return os.environ.get(DATA_TOKEN_ENV, "").strip() or None


# Open without the data token: liveness probes, Prometheus scrapes (counts only, see
# rollpoint.http.server_metrics) and the API's own description.
_OPEN_PATHS = frozenset(
    {"/healthz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)


class DataRouteGuard:
    """ASGI middleware: every HTTP request outside the control prefix and the open pages
    must carry the data token, else 401 in the error envelope before the body is read.

    Pure ASGI rather than ``BaseHTTPMiddleware``: a streamed ``/run`` reply passes through
    untouched, with no extra task per request on the data plane's hot path.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._auth = BearerAuth(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path or path in _OPEN_PATHS or path.startswith(CONTROL_PREFIX):
            await self.app(scope, receive, send)
            return
        authorization = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None
        )
        try:
            self._auth.check(authorization)
        except UnauthorizedError as exc:
            # OpenAI's routes answer in OpenAI's shape (see rollpoint.http.app).
            wire = exc.to_openai_wire() if path.startswith("/v1/") else exc.to_wire()
            body = orjson.dumps(wire)
            await send(
                {
                    "type": "http.response.start",
                    "status": exc.status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def guard_data_routes(app: FastAPI, token: str | None) -> None:
    """Put ``token`` in front of ``app``'s data routes; None leaves them open."""
    if token is not None:
        app.add_middleware(DataRouteGuard, token=token)
