"""FastAPI application factory shared by every rollpoint server.

Owns: JSON rendering (orjson), the error envelope (every :class:`RollpointError` becomes
``{"error": {code, message, retryable}}`` with the status the error tree gives its code,
and no other: a malformed body is a 400 ``bad_request`` whose message names the field, as
is one that cannot be decoded; on the OpenAI-compatible routes, ``/v1/*``, the envelope
also carries OpenAI's ``type`` and ``param``, and an unknown ``/v1`` route is a 404 in that
shape too), the strict reading of a request body (:func:`strict_json_body`: UTF-8 JSON
with its content type, validated in pydantic's strict mode), the OpenAPI document saying
so (a bad body is a 400 envelope, not FastAPI's 422), ``GET /healthz``, and the data token
in front of the data routes when one is given (:class:`rollpoint.http.auth.DataRouteGuard`).
Servers add their own routes.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.telemetry import TelemetryConfig
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from rollpoint.http.auth import guard_data_routes
from rollpoint.protocol.errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RollpointError,
    UnsupportedMediaTypeError,
)

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)


class JsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


OPENAI_PREFIX = "/v1/"
"""Routes under it speak OpenAI's API: their errors take OpenAI's shape."""


def error_response(
    err: RollpointError, path: str = "", *, param: str | None = None
) -> JsonResponse:
    """The envelope of ``err`` with its class's status; OpenAI's shape when ``path`` is an
    OpenAI route. The status is never chosen here: one code, one status, set in the tree."""
    openai = path.startswith(OPENAI_PREFIX)
    body = err.to_openai_wire(param) if openai else err.to_wire()
    return JsonResponse(body, status_code=err.status)


def _validation_field(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "body"
    return ".".join(str(p) for p in errors[0].get("loc", ()) if p != "body") or "body"


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid field '{_validation_field(exc)}': {errors[0].get('msg', 'invalid')}{more}"


async def strict_json_body(
    request: Request, model: type[ModelT], *, max_bytes: int | None = None
) -> ModelT:
    """The request's body as ``model``, read the way the wire is documented.

    - ``Content-Type`` must be ``application/json`` (a ``charset`` parameter, if any,
      ``utf-8``): otherwise :class:`UnsupportedMediaTypeError` (415) saying what was sent;
    - the bytes must be UTF-8 (no UTF-16, no byte order mark) and one complete JSON value:
      otherwise :class:`BadRequestError` (400) saying so (a truncated body is named as such);
    - the value is validated in pydantic's strict mode, so nothing is coerced (no string to
      number or bool, no bool to int, no float to int; a JSON integer is still a number
      for a float field): a bad field is :class:`RequestValidationError`, answered as a
      :class:`BadRequestError` (400) naming it;
    - with ``max_bytes``, a body longer than that is :class:`PayloadTooLargeError` (413),
      refused by its ``Content-Length`` or, sent chunked, as soon as it grows past the cap
      (never read whole).
    """
    _check_json_content_type(request.headers.get("content-type"))
    raw = await request.body() if max_bytes is None else await _capped_body(request, max_bytes)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"the request body is not UTF-8 (byte {exc.start}): JSON on this wire must be UTF-8"
        ) from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise BadRequestError("the request body starts with a byte order mark; send plain UTF-8")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors and errors[0]["type"] == "json_invalid":
            detail = str(errors[0].get("ctx", {}).get("error", "invalid JSON"))
            hint = " (truncated?)" if detail.startswith("EOF") else ""
            raise BadRequestError(
                f"the request body is not valid JSON{hint}: {detail} ({len(raw)} bytes)"
            ) from None
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


async def _capped_body(request: Request, max_bytes: int) -> bytes:
    def too_large(size: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the request body is {size}, over the {max_bytes} bytes this route takes"
        )

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(f"{int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_json_content_type(header: str | None) -> None:
    if header is None or not header.strip():
        raise UnsupportedMediaTypeError(
            "the request has no Content-Type; send the JSON body as 'application/json'"
        )
    media_type, *params = (part.strip() for part in header.split(";"))
    if media_type.lower() != "application/json":
        raise UnsupportedMediaTypeError(
            f"the request's Content-Type is {media_type!r}; send the JSON body as "
            "'application/json'"
        )
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() != "utf-8":
            raise UnsupportedMediaTypeError(
                f"the request's charset is {value.strip()!r}; JSON on this wire must be UTF-8"
            )


_ENVELOPE_SCHEMA: dict[str, Any] = {
    "title": "ErrorEnvelope",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "retryable"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "retryable": {"type": "boolean"},
            },
        }
    },
}


def _with_error_envelope(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document, changed in place) saying what the wire does
    with a body that does not match its model. FastAPI documents a 422 in its own
    ``{"detail": [...]}`` shape; here that is ``bad_request``, with its one status (400)
    and the error envelope."""
    bad_request = {
        "description": "bad_request: the body does not match the request model",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
    }
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            responses = operation.get("responses", {}) if isinstance(operation, dict) else {}
            if responses.pop("422", None) is not None:
                responses.setdefault(str(BadRequestError.status), bad_request)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for fastapi_shape in ("HTTPValidationError", "ValidationError"):
        schemas.pop(fastapi_shape, None)
    schemas["ErrorEnvelope"] = _ENVELOPE_SCHEMA
    return schema


_NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}
"""FastAPI's native OpenTelemetry off. With it on, every request asks the global
OpenTelemetry providers whether one is configured: ~4 % of a model server's busy time
under serial proxied calls (a py-spy profile, docs/log/performance-2026.md session 8). rollpoint
reports through the trainer's Prometheus ``/metrics``, each server's ``/rollpoint/v1/stats``
and the logs."""


def create_app(title: str, *, data_token: str | None = None, **kwargs: Any) -> FastAPI:
    """A FastAPI app with rollpoint's envelope; ``data_token`` guards every route but the
    control routes (which carry their own token) and the health and schema pages."""
    app = FastAPI(
        title=title, default_response_class=JsonResponse, telemetry=_NO_TELEMETRY, **kwargs
    )
    guard_data_routes(app, data_token)
    build_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_error_envelope(build_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RollpointError)
    async def _rollpoint_error(request: Request, exc: RollpointError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        # A body that does not match the route's model is a bad request like any other
        # (400, bad_request's one status), with the field named.
        err = BadRequestError(_validation_message(exc))
        return error_response(err, request.url.path, param=_validation_field(exc))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The caller hung up before its body was read (a trainer stopped or killed, a
        # timeout on its side): nothing was done and nobody reads an answer. One line, not
        # the server's "Exception in ASGI application" traceback.
        log.info(
            "%s %s: the client went away before its request was read",
            request.method,
            request.url.path,
        )
        return Response(status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        # FastAPI answers a body it cannot decode (say, not UTF-8) with a bare 400 of its
        # own; every refusal of ours carries the envelope. Others (404/405 of an unknown
        # route) keep FastAPI's shape, but on OpenAI's routes, where clients expect theirs.
        path = request.url.path
        if exc.status_code == 400:
            return error_response(BadRequestError(f"the request body: {exc.detail}"), path)
        if exc.status_code == 404 and path.startswith(OPENAI_PREFIX):
            unknown = NotFoundError(f"no route {request.method} {path}")
            return error_response(unknown, path)
        return await http_exception_handler(request, exc)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": title}

    return app
