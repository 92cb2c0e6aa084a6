"""The in-process face of a fence: control calls made on it directly, no sockets.

Owns :class:`InProcessControlTransport`, a control transport (it satisfies
:class:`rollpoint.trainer.control.control_transport.ControlTransport` by shape: the SDK imports no
trainer module) that calls the same handlers the HTTP routes call
(:func:`rollpoint.participant.fence_verbs.fence_handlers`) and keeps what the wire
guarantees, so a coordinator tested over it meets the participant it meets over HTTP:

- the request goes through JSON and is validated in pydantic's strict mode, as the routes
  read a body (a malformed one is a :class:`~rollpoint.protocol.errors.BadRequestError`
  naming the field, and reaches no fence);
- a refusal is rebuilt from its wire envelope (:func:`~rollpoint.protocol.errors.error_from_wire`),
  so the caller gets the class the HTTP client would; an unexpected exception (a bug) is a
  :class:`~rollpoint.protocol.errors.TransportError`, as a 500 reads over HTTP;
- the reply goes through JSON too and is read by the verb's reply model;
- a call that outlives its timeout, or whose caller is cancelled, keeps running on the
  fence, as a server goes on with a request whose client hung up (:meth:`aclose` waits for
  those).

It does not check the control token (nothing crosses a wire) nor own the fence.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rollpoint.participant.fence import Fence
from rollpoint.participant.fence_verbs import fence_handlers
from rollpoint.protocol.control_verbs import ControlVerb
from rollpoint.protocol.errors import (
    BadRequestError,
    RollpointError,
    TransportError,
    error_from_wire,
)

__all__ = ["InProcessControlTransport"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)


class InProcessControlTransport:
    """Calls ``fence``'s verbs directly; ``peer`` names it in refusals (as a URL would)."""

    def __init__(self, fence: Fence, *, peer: str = "in-process") -> None:
        self.fence = fence
        self._peer = peer
        self._handlers = fence_handlers(fence)
        self._running: set[asyncio.Task[BaseModel]] = set()
        self.calls: list[str] = []
        """Every verb called, in order (what reached the fence, refused or not)."""

    def relocated(self, url: str) -> InProcessControlTransport:
        return self  # no address: the same fence, wherever the roster says it lives

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        body = self._read(verb, request)
        self.calls.append(str(verb.verb))
        task = asyncio.ensure_future(self._handlers[verb.verb](body))
        self._running.add(task)
        task.add_done_callback(self._done)
        try:
            async with asyncio.timeout(timeout_s) as within:
                # Shielded: neither the timeout nor a cancelled caller stops the fence's work.
                reply = await asyncio.shield(task)
        except TimeoutError:
            if within.expired():
                raise TransportError(
                    f"{self._peer} {verb.verb}: no answer within {timeout_s:g}s"
                ) from None
            raise TransportError(f"{self._peer} {verb.verb}: TimeoutError") from None
        except RollpointError as exc:
            raise error_from_wire(exc.status, exc.to_wire(), peer=self._peer) from None
        except Exception as exc:
            log.exception("in-process %s on %s failed", verb.verb, self._peer)
            raise TransportError(f"{self._peer}: HTTP 500: {type(exc).__name__}: {exc}") from exc
        return verb.parse_reply(orjson.loads(reply.model_dump_json()))

    def _done(self, task: asyncio.Task[BaseModel]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that gave up already got its error

    def _read(self, verb: ControlVerb[Any, Any], request: BaseModel | None) -> BaseModel | None:
        """The request as the route reads it: through JSON, strictly, into the verb's model."""
        if verb.request is None:
            if request is not None:
                raise BadRequestError(f"{self._peer}: {verb.verb} takes no body")
            return None
        if request is None:
            raise BadRequestError(f"{self._peer}: the request body is missing")
        try:
            parsed: BaseModel = verb.request.model_validate_json(
                request.model_dump_json(), strict=True
            )
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise BadRequestError(
                f"{self._peer}: invalid field '{where}': {first['msg']}"
            ) from None
        return parsed

    async def aclose(self) -> None:
        """Wait for the calls still running on the fence (their callers gave up)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
