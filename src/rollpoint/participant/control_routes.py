"""The control routes of a participant: every verb under ``/rollpoint/v1/checkpoint``.

Owns the HTTP face of a :class:`~rollpoint.participant.fence.Fence`: one route per row of
:data:`rollpoint.protocol.control_verbs.VERBS` (its method, path, request and reply model),
each calling the verb's handler of :mod:`rollpoint.participant.fence_verbs`, each guarded by the control bearer token and each
reading its body with :func:`rollpoint.http.app.strict_json_body` into the verb's request
model, in pydantic's strict mode: ``application/json`` in UTF-8 only (415 otherwise), a
body that is not JSON or is cut short is a 400 saying so, and a malformed field (a string
for a number, a number or string for a bool) is a 400 naming it; nothing changes. FastAPI's
own body parsing (lax: it would coerce ``"1"`` to ``1``) never runs for these routes: the
route class calls the endpoint with the strictly parsed body, and the signatures only
document the bodies in the OpenAPI schema. It holds no state and makes no decision: the
fence does.

A server mounts it on its app and stops the fence with the app::

    fence = Fence(participant, settings)
    mount_control_routes(app, fence, settings)
    # in the app's lifespan, on shutdown: await fence.aclose()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from rollpoint.http.app import error_response, strict_json_body
from rollpoint.http.auth import BearerAuth
from rollpoint.participant.control_settings import ControlSettings
from rollpoint.participant.fence import Fence
from rollpoint.participant.fence_verbs import VerbHandler, fence_handlers
from rollpoint.protocol.control import MAX_CONTROL_BODY_BYTES, StatusReply, Verb
from rollpoint.protocol.control_verbs import VERBS, ControlVerb
from rollpoint.protocol.errors import RollpointError

__all__ = ["ControlSettings", "mount_control_routes"]


def _control_route(auth: BearerAuth, bodies: dict[str, type[BaseModel]]) -> type[APIRoute]:
    """A route class that checks the token before the body is read, so a caller without
    the token learns nothing about the body's shape (401 comes before 415 and 400),
    then reads the body strictly (``bodies``: request model by route path) and calls the
    endpoint with it. A refusal raised here or by the fence is rendered by the app's
    error handlers, as from any route."""

    class ControlRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            model = bodies.get(self.path)
            endpoint = self.endpoint

            async def checked(request: Request) -> Response:
                try:
                    auth.check(request.headers.get("authorization"))
                except RollpointError as exc:
                    return error_response(exc)
                if model is None:  # status: no body
                    status = await endpoint()
                    assert isinstance(status, StatusReply), "status replies with its model"
                    # The port this request reached, as this server's socket says: a
                    # client that dialled another (a proxy's) keeps its URL for control.
                    server = request.scope.get("server")
                    port = server[1] if server and isinstance(server[1], int) else None
                    status = status.model_copy(update={"server_port": port})
                    return Response(status.model_dump_json(), media_type="application/json")
                body = await strict_json_body(request, model, max_bytes=MAX_CONTROL_BODY_BYTES)
                reply = await endpoint(body)
                if isinstance(reply, Response):
                    return reply
                assert isinstance(reply, BaseModel), "a control verb replies with its model"
                # Serialised once, here: a commit's reply maps every exported episode, and
                # FastAPI would dump, validate and dump it again inside the snapshot pause.
                return Response(reply.model_dump_json(), media_type="application/json")

            return checked

    return ControlRoute


def _endpoint(verb: ControlVerb[BaseModel, BaseModel], handler: VerbHandler) -> Callable[..., Any]:
    """The route's endpoint for ``verb``: calls its handler. Its signature (the request
    model as ``body``) only documents the body in the OpenAPI schema; the route class reads
    the body itself."""
    if verb.request is None:

        async def endpoint() -> BaseModel:
            return await handler(None)

        parameters: list[inspect.Parameter] = []
    else:

        async def endpoint(body: BaseModel) -> BaseModel:  # type: ignore[misc]
            return await handler(body)

        parameters = [
            inspect.Parameter(
                "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=verb.request
            )
        ]
    endpoint.__name__ = endpoint.__qualname__ = str(verb.verb)
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        parameters, return_annotation=verb.reply
    )
    return endpoint


def mount_control_routes(
    app: FastAPI,
    fence: Fence,
    settings: ControlSettings,
    *,
    handlers: Mapping[Verb, VerbHandler] | None = None,
) -> None:
    """Register every control verb of ``fence`` on ``app``, guarded by ``settings.token``.

    Pass the same settings the fence was built with. ``handlers``: what each verb calls
    (default: the fence's own, :func:`~rollpoint.participant.fence_verbs.fence_handlers`, on the
    loop serving ``app``; the control listener passes its cross-thread ones). The routes go on the app's own router,
    not through ``include_router``: FastAPI >= 0.165 builds an included router's routes on
    its first request, inside the first prepare's pause, and its build silences a pydantic
    warning with ``warnings.catch_warnings()``, which races when several servers share a
    process (the tests do). Routes added here are built now, once, in the caller's thread.
    """
    auth = BearerAuth(settings.token)
    bodies = {v.path: v.request for v in VERBS.values() if v.request is not None}
    route_class = _control_route(auth, bodies)
    if handlers is None:
        handlers = fence_handlers(fence)
    for verb in VERBS.values():
        app.router.add_api_route(
            verb.path,
            _endpoint(verb, handlers[verb.verb]),
            methods=[verb.method],
            response_model=verb.reply,
            tags=["checkpoint control"],
            # The dependency documents the scheme in the OpenAPI schema; the route class
            # enforces it.
            dependencies=[Depends(auth)],
            route_class_override=route_class,
        )
