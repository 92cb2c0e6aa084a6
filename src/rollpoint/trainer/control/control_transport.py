"""The control transport seam: how one control call reaches one participant.

Owns :class:`ControlTransport`, what :class:`~rollpoint.trainer.control.participant_client.ParticipantClient`
sends its calls through (one verb of :data:`rollpoint.protocol.control_verbs.VERBS`, its
request model, a timeout; back comes the verb's reply model or a typed error), and
:class:`HttpControlTransport`, the one a run uses: the control routes of a server over
:class:`~rollpoint.http.client.HttpClient`. Others satisfy the same protocol without
importing this module: :class:`rollpoint.participant.in_process_control.InProcessControlTransport`
(a fence called directly, no sockets) and
:class:`rollpoint.testing.fault_transport.FaultTransport` (faults injected around another).

Every transport keeps the wire's contract: a peer's refusal is its typed
:class:`~rollpoint.protocol.errors.ProtocolError`; a peer that is down, too slow, or answers
something that is not the protocol is a :class:`~rollpoint.protocol.errors.TransportError`
(the client adds the participant's label). It does not own the bodies, the timeouts (the
client ties them to the shared deadline) nor the order of calls (the coordinator's).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control_verbs import ControlVerb

__all__ = ["ControlTransport", "HttpControlTransport"]

R = TypeVar("R", bound=BaseModel)


class ControlTransport(Protocol):
    """One participant's control plane, reached somehow."""

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        """Send ``request`` (None for ``status``) and return the verb's reply; raise the
        peer's typed refusal, or :class:`TransportError` when no reply came within
        ``timeout_s`` or it is not the protocol."""
        ...

    def relocated(self, url: str) -> ControlTransport:
        """The same participant served at ``url`` (its replica was restarted on new ports);
        a transport that reaches its participant without an address returns itself."""
        ...


class HttpControlTransport:
    """The control routes of a server at ``url``, over one shared :class:`HttpClient`."""

    def __init__(self, http: HttpClient, url: str) -> None:
        self._http = http
        self._url = url.rstrip("/")

    def relocated(self, url: str) -> HttpControlTransport:
        return HttpControlTransport(self._http, url)

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        payload: Any = request.model_dump(mode="json") if request is not None else None
        raw = await self._http.request_json(
            verb.method, f"{self._url}{verb.path}", body=payload, timeout_s=timeout_s
        )
        return verb.parse_reply(raw)
