"""What a fault is: its kind, the requests it takes, and the request as a rule sees it.

Owns the vocabulary of :mod:`rollpoint.testing.fault_proxy`: :class:`FaultKind` (what
happens to a request a rule takes, and whether the upstream sees it), :class:`RequestMatch`
(method, path prefix or regex, a predicate over headers and body), and :class:`Fault`, the
frozen pair of the two plus the kind's parameters, built by one class method per kind::

    Fault.drop_reply(path="/rollpoint/v1/checkpoint/commit")
    Fault.delay(3.0, path=re.compile(r"/prepare$"), times=None)
    Fault.garbage(path="/x", when=lambda r: r.json()["checkpoint_id"] == "c1")

It does not apply faults (the proxy does) and knows nothing of rollpoint's protocol.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypedDict, Unpack

import orjson

from rollpoint.protocol.errors import ConfigError

DEFAULT_GARBAGE = b"\x00\xff<html>garbage: neither JSON nor the protocol</html>"


class FaultKind(StrEnum):
    """What a rule does to a request it takes, and when it sets the rule's ``hit``."""

    DROP_REPLY = "drop_reply"
    """A lost reply: forwarded, the upstream's whole reply read, then the client connection
    closed with no response. ``hit`` once the reply is thrown away."""
    DELAY = "delay"
    """Forwarded after ``seconds``. ``hit`` when the wait starts."""
    RESET = "reset"
    """Not forwarded: the client connection is reset (RST) at once. ``hit`` then."""
    REFUSE = "refuse"
    """A partition until :meth:`~rollpoint.testing.fault_proxy.FaultProxy.heal`: this connection and every open one are
    cut and the listening socket closes, so new connections are refused. With ``forward``
    the upstream gets the request first (it acts; its reply is lost). ``hit`` once
    partitioned."""
    HOLD = "hold"
    """Parked, not forwarded, until :meth:`~rollpoint.testing.fault_proxy.FaultProxy.release` (then forwarded as is).
    ``hit`` once parked."""
    GARBAGE = "garbage"
    """Answered 200 with ``body`` (by default neither JSON nor the protocol) under a JSON
    content type. With ``forward`` the upstream gets and answers the request first. ``hit``
    as the answer goes out."""
    ERROR = "error"
    """Answered with ``status`` and ``body``. With ``forward`` the upstream gets and answers
    the request first. ``hit`` as the answer goes out."""


_FORWARD_OPTIONAL = frozenset({FaultKind.REFUSE, FaultKind.GARBAGE, FaultKind.ERROR})

PathMatch = str | re.Pattern[str] | None
Predicate = Callable[["ProxiedRequest"], bool]


@dataclass(frozen=True)
class ProxiedRequest:
    """A request as the proxy received it, for matching."""

    method: str
    path: str
    """Decoded path, without the query string."""
    query: str
    headers: Mapping[str, str]
    """Case-insensitive."""
    body: bytes

    def json(self) -> Any:
        """The body decoded as JSON; None when it is empty or not JSON."""
        try:
            return orjson.loads(self.body) if self.body else None
        except orjson.JSONDecodeError:
            return None


@dataclass(frozen=True)
class RequestMatch:
    """Which requests a rule takes; every given part must match."""

    method: str | None = None
    """HTTP method, any case; None matches every method."""
    path: PathMatch = None
    """A path prefix (``str``) or a pattern searched in the path (``re.Pattern``)."""
    when: Predicate | None = None
    """A predicate over the whole request (headers, body); None matches every request."""

    def matches(self, request: ProxiedRequest) -> bool:
        if self.method is not None and request.method.upper() != self.method.upper():
            return False
        if isinstance(self.path, str) and not request.path.startswith(self.path):
            return False
        if isinstance(self.path, re.Pattern) and self.path.search(request.path) is None:
            return False
        return self.when is None or bool(self.when(request))

    def describe(self) -> str:
        path = self.path.pattern if isinstance(self.path, re.Pattern) else self.path
        parts = [
            self.method or "*",
            f"{path or '/'}{'' if isinstance(self.path, re.Pattern) else '*'}",
        ]
        if self.when is not None:
            parts.append(f"when {getattr(self.when, '__name__', 'predicate')}")
        return " ".join(parts)


class Target(TypedDict, total=False):
    """The requests a rule built by a :class:`Fault` factory takes (see :class:`RequestMatch`)."""

    method: str | None
    path: PathMatch
    when: Predicate | None
    times: int | None
    """How many requests; 1 by default, None for every one."""


@dataclass(frozen=True)
class Fault:
    """One kind of failure and the requests it applies to; build with the class methods."""

    kind: FaultKind
    match: RequestMatch = field(default_factory=RequestMatch)
    times: int | None = 1
    """Requests the rule takes before it stops matching; None takes every one."""
    seconds: float = 0.0
    """``delay`` only: how long to wait before forwarding."""
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    forward: bool = False
    """``refuse``, ``garbage``, ``error``: the upstream gets the request first."""

    def __post_init__(self) -> None:
        if self.times is not None and self.times < 1:
            raise ConfigError(f"fault {self.kind}: times must be >= 1 or None, got {self.times}")
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ConfigError(f"fault {self.kind}: seconds must be >= 0, got {self.seconds}")
        if not 100 <= self.status <= 599:
            raise ConfigError(f"fault {self.kind}: status must be 100..599, got {self.status}")
        if self.forward and self.kind not in _FORWARD_OPTIONAL:
            raise ConfigError(f"fault {self.kind}: forward applies to refuse, garbage and error")

    @classmethod
    def drop_reply(cls, **target: Unpack[Target]) -> Fault:
        return cls._of(FaultKind.DROP_REPLY, target)

    @classmethod
    def delay(cls, seconds: float, **target: Unpack[Target]) -> Fault:
        return cls._of(FaultKind.DELAY, target, seconds=seconds)

    @classmethod
    def reset(cls, **target: Unpack[Target]) -> Fault:
        return cls._of(FaultKind.RESET, target)

    @classmethod
    def refuse(cls, *, forward: bool = False, **target: Unpack[Target]) -> Fault:
        return cls._of(FaultKind.REFUSE, target, forward=forward)

    @classmethod
    def hold(cls, **target: Unpack[Target]) -> Fault:
        return cls._of(FaultKind.HOLD, target)

    @classmethod
    def garbage(
        cls, *, body: bytes = DEFAULT_GARBAGE, forward: bool = False, **target: Unpack[Target]
    ) -> Fault:
        return cls._of(FaultKind.GARBAGE, target, body=body, forward=forward)

    @classmethod
    def error(
        cls,
        status: int,
        body: bytes | str | Mapping[str, Any] = b"",
        *,
        forward: bool = False,
        **target: Unpack[Target],
    ) -> Fault:
        if isinstance(body, Mapping):
            raw, content_type = orjson.dumps(dict(body)), "application/json"
        elif isinstance(body, str):
            raw, content_type = body.encode(), "text/plain; charset=utf-8"
        else:
            raw, content_type = body, "application/octet-stream"
        return cls._of(
            FaultKind.ERROR,
            target,
            status=status,
            body=raw,
            content_type=content_type,
            forward=forward,
        )

    @classmethod
    def _of(cls, kind: FaultKind, target: Target, **params: Any) -> Fault:
        match = RequestMatch(target.get("method"), target.get("path"), target.get("when"))
        return cls(kind, match, target.get("times", 1), **params)
