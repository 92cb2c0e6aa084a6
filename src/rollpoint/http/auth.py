"""Bearer tokens: where a server's token comes from, and the check on every request.

Owns loading a token (a file, else an environment variable; there is no default token)
and :class:`BearerAuth`, a FastAPI dependency that accepts a request only when its
``Authorization: Bearer <token>`` matches, compared in constant time. It does not decide
which routes are guarded: the control routes use one token, data routes may use another.
The token is never logged nor echoed in an error.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi import Request

from rollpoint.protocol.errors import ConfigError, UnauthorizedError

CONTROL_TOKEN_ENV = "ROLLPOINT_CONTROL_TOKEN"


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
