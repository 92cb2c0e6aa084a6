"""FastAPI application factory shared by every rollpoint server.

Owns: JSON rendering (orjson), the error envelope (every :class:`RollpointError` becomes
``{"error": {code, message, retryable}}`` with its status; a malformed body becomes a 422
whose message names the field, one that cannot be decoded a 400 ``bad_request``), and
``GET /healthz``, and the data token in front of the data routes when one is given
(:class:`rollpoint.http.auth.DataRouteGuard`). Servers add their own routes.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.telemetry import TelemetryConfig
from starlette.exceptions import HTTPException

from rollpoint.http.auth import guard_data_routes
from rollpoint.protocol.errors import BadRequestError, RollpointError

log = logging.getLogger(__name__)


class JsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: RollpointError) -> JsonResponse:
    return JsonResponse(err.to_wire(), status_code=err.status)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid field '{loc}': {first.get('msg', 'invalid')}{more}"


_NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
"""FastAPI's native OpenTelemetry off. With it on, every request asks the global
OpenTelemetry providers whether one is configured: ~4 % of a model server's busy time
under serial proxied calls (a py-spy profile, docs/PERFORMANCE.md session 8). rollpoint
reports through the trainer's Prometheus ``/metrics``, each server's ``/rollpoint/v1/stats``
and the logs."""


def create_app(title: str, *, data_token: str | None = None, **kwargs: Any) -> FastAPI:
    """A FastAPI app with rollpoint's envelope; ``data_token`` guards every route but the
    control routes (which carry their own token) and the health and schema pages."""
    app = FastAPI(
        title=title, default_response_class=JsonResponse, telemetry=_NO_TELEMETRY, **kwargs
    )
    guard_data_routes(app, data_token)

    @app.exception_handler(RollpointError)
    async def _rollpoint_error(_: Request, exc: RollpointError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        body = {
            "error": {
                "code": "bad_request",
                "message": _validation_message(exc),
                "retryable": False,
            }
        }
        return JsonResponse(body, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        # FastAPI answers a body it cannot decode (say, not UTF-8) with a bare 400 of its
        # own; every refusal of ours carries the envelope. Others (404/405 of an unknown
        # route) keep FastAPI's shape.
        if exc.status_code == 400:
            return error_response(BadRequestError(f"the request body: {exc.detail}"))
        return await http_exception_handler(request, exc)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": title}

    return app
