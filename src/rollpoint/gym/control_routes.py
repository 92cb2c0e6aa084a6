"""The control routes of a participant: every verb under ``/rollpoint/v1/checkpoint``.

Owns the HTTP face of a :class:`~rollpoint.gym.fence.Fence`: one route per verb of
:mod:`rollpoint.protocol.control`, each guarded by the control bearer token and each
parsing its body into the verb's strict request model (a malformed body is a 422 naming
the field, rendered by :func:`rollpoint.http.app.create_app`; nothing changes). It holds
no state and makes no decision: the fence does.

A server mounts it on its app and stops the fence with the app::

    fence = Fence(participant, settings)
    app.include_router(control_router(fence, settings))
    # in the app's lifespan, on shutdown: await fence.aclose()
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.routing import APIRoute

from rollpoint.gym.fence import ControlSettings, Fence
from rollpoint.http.app import error_response
from rollpoint.http.auth import BearerAuth
from rollpoint.protocol.control import (
    CONTROL_PREFIX,
    AckReply,
    AckRequest,
    CommitReply,
    CommitRequest,
    ConfirmReply,
    ConfirmRequest,
    ForgetReply,
    ForgetRequest,
    PrepareReply,
    PrepareRequest,
    RenewReply,
    RenewRequest,
    RestoreReply,
    RestoreRequest,
    ResumeReply,
    ResumeRequest,
    RetireReply,
    RetireRequest,
    StatusReply,
    Verb,
)
from rollpoint.protocol.errors import RollpointError

__all__ = ["ControlSettings", "control_router"]


def _auth_first(auth: BearerAuth) -> type[APIRoute]:
    """A route class that checks the token before FastAPI reads the body, so a caller
    without the token learns nothing about the body's shape (401 comes before 422)."""

    class AuthFirstRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                try:
                    auth.check(request.headers.get("authorization"))
                except RollpointError as exc:
                    return error_response(exc)
                return await handler(request)

            return checked

    return AuthFirstRoute


def control_router(fence: Fence, settings: ControlSettings) -> APIRouter:
    """Every control verb of ``fence``, guarded by ``settings.token``.

    Pass the same settings the fence was built with.
    """
    auth = BearerAuth(settings.token)
    router = APIRouter(
        prefix=CONTROL_PREFIX,
        tags=["checkpoint control"],
        # The dependency documents the scheme in the OpenAPI schema; the route class enforces it.
        dependencies=[Depends(auth)],
        route_class=_auth_first(auth),
    )

    @router.get(f"/{Verb.STATUS}")
    async def status() -> StatusReply:
        return fence.status()

    @router.post(f"/{Verb.PREPARE}")
    async def prepare(body: PrepareRequest) -> PrepareReply:
        return await fence.prepare(body)

    @router.post(f"/{Verb.RENEW}")
    async def renew(body: RenewRequest) -> RenewReply:
        return await fence.renew(body)

    @router.post(f"/{Verb.COMMIT}", response_model=CommitReply)
    async def commit(body: CommitRequest) -> Response:
        reply = await fence.commit(body)
        # Serialised once, here: the reply maps every exported episode, and FastAPI
        # would dump, validate and dump it again inside the snapshot pause.
        return Response(reply.model_dump_json(), media_type="application/json")

    @router.post(f"/{Verb.CONFIRM}")
    async def confirm(body: ConfirmRequest) -> ConfirmReply:
        return await fence.confirm(body)

    @router.post(f"/{Verb.RESUME}")
    async def resume(body: ResumeRequest) -> ResumeReply:
        return await fence.resume(body)

    @router.post(f"/{Verb.RESTORE}")
    async def restore(body: RestoreRequest) -> RestoreReply:
        return await fence.restore(body)

    @router.post(f"/{Verb.RETIRE}")
    async def retire(body: RetireRequest) -> RetireReply:
        return await fence.retire(body)

    @router.post(f"/{Verb.FORGET}")
    async def forget(body: ForgetRequest) -> ForgetReply:
        return await fence.forget(body)

    @router.post(f"/{Verb.ACK}")
    async def ack(body: AckRequest) -> AckReply:
        return await fence.ack(body)

    return router
