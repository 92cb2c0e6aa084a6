"""The control transport seam: how one control call reaches one participant.

Owns :class:`ControlTransport`, what :class:`~rollpoint.trainer.control.participant_client.ParticipantClient`
sends its calls through (one verb of :data:`rollpoint.protocol.control_verbs.VERBS`, its
request model, a timeout; back comes the verb's reply model or a typed error), and
:class:`HttpControlTransport`, the one a run uses: the control routes of a server over
:class:`~rollpoint.http.client.HttpClient`, sent to the server's control listener once its
status named one (``control_port``: the same routes on a thread and event loop of their
own, so a data plane at saturation does not delay them; :mod:`rollpoint.participant.control_listener`). Others satisfy the same protocol without
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

import time
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import StatusReply, Verb
from rollpoint.protocol.control_verbs import STATUS, ControlVerb
from rollpoint.protocol.errors import TransportError

__all__ = ["ControlTransport", "HttpControlTransport", "control_url"]

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
    """The control routes of a server at ``url``, over one shared :class:`HttpClient`.

    Its first call reads the server's status at ``url`` (the one call that waits on the
    server's data loop) and, when it names a ``control_port``, sends every call after it
    to that port on ``url``'s host, unless ``url`` reaches the server through a proxy
    (:func:`control_url`). A call there that fails reads the status at ``url`` again: if
    the server was restarted in place, on a new control port, the call is sent there
    (within the same timeout); otherwise the failure is the call's. ``follow_control_port=False`` keeps every call at ``url`` (a
    benchmark's "before")."""

    def __init__(self, http: HttpClient, url: str, *, follow_control_port: bool = True) -> None:
        self._http = http
        self._url = url.rstrip("/")
        self._follow = follow_control_port
        self._target: str | None = None if follow_control_port else self._url
        """Where calls go; None until the first status said."""

    @property
    def target(self) -> str | None:
        """The base URL calls go to (None before the first call)."""
        return self._target

    def relocated(self, url: str) -> HttpControlTransport:
        return HttpControlTransport(self._http, url, follow_control_port=self._follow)

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        deadline = time.monotonic() + timeout_s
        target = self._target
        if target is None:
            raw = await self._send(self._url, STATUS, None, timeout_s)
            target = self._target = control_url(self._url, STATUS.parse_reply(raw))
            if verb.verb is Verb.STATUS:
                return verb.parse_reply(raw)
            timeout_s = _left(deadline)
        try:
            raw = await self._send(target, verb, request, timeout_s)
        except TransportError:
            if target == self._url:
                raise
            # The listener did not answer: the server may have been restarted in place, on
            # a new control port. Read where it is now; if it moved, the call goes there (a
            # listener that is gone ran nothing of it, and every verb is replayable).
            self._target = None
            moved = await self._moved(target, deadline)
            if moved is None:
                raise
            raw = await self._send(moved, verb, request, _left(deadline))
        return verb.parse_reply(raw)

    async def _moved(self, failed: str, deadline: float) -> str | None:
        """Where the control routes are now, if not at ``failed`` (None: same, or unknown)."""
        if deadline - time.monotonic() <= 0:
            return None
        try:
            raw = await self._send(self._url, STATUS, None, _left(deadline))
        except TransportError:
            return None
        target = self._target = control_url(self._url, STATUS.parse_reply(raw))
        return None if target == failed else target

    async def _send(
        self, base: str, verb: ControlVerb[Any, Any], request: BaseModel | None, timeout_s: float
    ) -> Any:
        payload: Any = request.model_dump(mode="json") if request is not None else None
        return await self._http.request_json(
            verb.method, f"{base}{verb.path}", body=payload, timeout_s=timeout_s
        )


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def control_url(url: str, status: StatusReply) -> str:
    """Where the control routes of the server at ``url`` are best reached, given its
    ``status`` read at ``url``: its control listener's port on the same host, or ``url``
    itself when it has none, when ``url`` reaches it through a proxy (the port the server
    says it served on is not ``url``'s: a fault proxy or a gateway must stay in the path),
    or when ``url`` has a path (a proxy serves it; a bare port would go around it)."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if (
        status.control_port is None
        or status.server_port != port
        or parts.hostname is None
        or parts.path not in ("", "/")
    ):
        return url
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{status.control_port}"
