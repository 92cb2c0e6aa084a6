"""A fault-injecting control transport: another transport, failing on command, no sockets.

Owns :class:`FaultTransport`, which wraps any control transport (an
:class:`~rollpoint.participant.in_process_control.InProcessControlTransport` in unit tests)
and applies the fault proxy's faults to the calls going through it: the same
:class:`~rollpoint.testing.fault.Fault` values, matched the same way (each call is seen as
the HTTP request it would be: the verb's method and path, its JSON body) and counted by the
same :class:`~rollpoint.testing.fault_proxy.Rule`, so a test written against the proxy
reads the same here. Rules are tried in the order added; a call no rule takes goes through
untouched. What each kind does to a call, as its caller sees it:

- ``drop_reply``: the inner transport serves the call (the participant acts), then the
  caller gets a :class:`~rollpoint.protocol.errors.TransportError`: the reply was lost;
- ``delay``: sent after ``seconds``; one whose caller's timeout ends first is never sent;
- ``reset``: not sent; a TransportError at once;
- ``refuse``: a partition until :meth:`FaultTransport.heal`: this call and every later one
  fail with a TransportError (with ``forward`` the participant gets this one first);
- ``hold``: parked until :meth:`FaultTransport.release` (then sent), or its caller's timeout;
- ``garbage``: answered with ``body``: not JSON is a TransportError, JSON that is not the
  verb's reply is one too (with ``forward`` the participant gets the call first);
- ``error``: answered with ``status`` and ``body``, read as the HTTP client reads a reply
  (a 409 envelope is the typed refusal it names, a bare 500 a TransportError).

It does not know what a test wants to break, and shares no state with a proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel

from rollpoint.protocol.control_verbs import ControlVerb
from rollpoint.protocol.errors import RollpointError, TransportError, error_from_wire
from rollpoint.testing.fault import Fault, FaultKind, ProxiedRequest
from rollpoint.testing.fault_proxy import RuleCommands, Rules
from rollpoint.trainer.control.control_transport import ControlTransport

__all__ = ["FaultTransport"]

R = TypeVar("R", bound=BaseModel)


class FaultTransport(RuleCommands):
    """``inner`` with faults applied to the calls that match a rule (:class:`RuleCommands`:
    a call a removed rule held is sent)."""

    def __init__(self, inner: ControlTransport, *, peer: str = "fault transport") -> None:
        self.inner = inner
        self._peer = peer
        self._rules = Rules()
        self._partitioned = False
        self.requests: Counter[str] = Counter()
        """Calls made, by verb (refused while partitioned included)."""
        self.forwarded = 0
        """Calls the inner transport served."""
        self.faulted: Counter[FaultKind] = Counter()

    # --- rules: add, remove, release, rules (as on the fault proxy) ---------------------

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def partition(self) -> None:
        """Every call fails with a TransportError until :meth:`heal`."""
        self._partitioned = True

    def heal(self) -> None:
        """Undo every fault: rules removed, held calls sent, the partition over."""
        self._rules.clear()
        self._partitioned = False

    def relocated(self, url: str) -> FaultTransport:
        # A proxy fronts one address: the participant served elsewhere is reached without it.
        return FaultTransport(self.inner.relocated(url), peer=self._peer)

    # --- calls -------------------------------------------------------------------------

    async def call(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        self.requests[str(verb.verb)] += 1
        if self._partitioned:
            raise self._lost(verb, "connection refused (partitioned)")
        seen = ProxiedRequest(
            verb.method,
            verb.path,
            "",
            {"content-type": "application/json"},
            request.model_dump_json().encode() if request is not None else b"",
        )
        rule = self._rules.take(seen)
        if rule is None:
            return await self._send(verb, request, timeout_s)
        self.faulted[rule.fault.kind] += 1
        fault = rule.fault
        kind = fault.kind
        if kind is FaultKind.RESET:
            rule._took_effect()
            raise self._lost(verb, "connection reset")
        if kind is FaultKind.DROP_REPLY:
            await self._exchange(verb, request, timeout_s)
            rule._took_effect()
            raise self._lost(verb, "connection closed with no reply (its reply was lost)")
        if kind is FaultKind.REFUSE:
            if fault.forward:
                await self._exchange(verb, request, timeout_s)
            self.partition()
            rule._took_effect()
            raise self._lost(verb, "connection cut (partitioned)")
        if kind is FaultKind.DELAY:
            rule._took_effect()
            if fault.seconds >= timeout_s:
                await asyncio.sleep(timeout_s)
                raise self._lost(verb, f"no answer within {timeout_s:g}s")
            await asyncio.sleep(fault.seconds)
            return await self._send(verb, request, timeout_s - fault.seconds)
        if kind is FaultKind.HOLD:
            rule._took_effect()
            try:
                async with asyncio.timeout(timeout_s):
                    await rule._released.wait()
            except TimeoutError:
                raise self._lost(verb, f"no answer within {timeout_s:g}s") from None
            if self._partitioned:
                raise self._lost(verb, "connection cut (partitioned)")
            return await self._send(verb, request, timeout_s)
        # GARBAGE and ERROR: an answer of the rule's own.
        if fault.forward:
            await self._exchange(verb, request, timeout_s)
        rule._took_effect()
        return self._answer(verb, fault)

    async def _send(
        self, verb: ControlVerb[Any, R], request: BaseModel | None, timeout_s: float
    ) -> R:
        self.forwarded += 1
        return await self.inner.call(verb, request, timeout_s)

    async def _exchange(
        self, verb: ControlVerb[Any, Any], request: BaseModel | None, timeout_s: float
    ) -> None:
        """Send the call and throw away whatever comes back, refusals included."""
        with contextlib.suppress(RollpointError):
            await self._send(verb, request, timeout_s)

    def _answer(self, verb: ControlVerb[Any, R], fault: Fault) -> R:
        """The rule's answer, read as the HTTP client reads a reply."""
        try:
            decoded: Any = orjson.loads(fault.body) if fault.body else None
        except orjson.JSONDecodeError:
            if fault.status >= 400:
                text = fault.body[:200].decode(errors="replace")
                raise error_from_wire(fault.status, text, peer=self._peer) from None
            raise self._lost(verb, "reply is not JSON") from None
        if fault.status >= 400:
            raise error_from_wire(fault.status, decoded, peer=self._peer)
        return verb.parse_reply(decoded)

    def _lost(self, verb: ControlVerb[Any, Any], why: str) -> TransportError:
        return TransportError(f"{self._peer} {verb.verb}: {why}")
