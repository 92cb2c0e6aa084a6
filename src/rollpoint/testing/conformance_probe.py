"""The conformance kit's probe: raw HTTP to one participant's control routes.

Owns how the kit talks to a participant and judges one reply: :class:`Probe` sends a
verb (with the right token, another one or none; a body as JSON or as raw bytes) and
returns the :class:`Reply` as it came off the wire; :func:`expect_ok` and
:func:`expect_refused` turn a reply into the verb's reply model or the refusal's message,
or raise :class:`CaseFailed` with a one-line reason. :class:`Trial` is one case's context:
the probe, fresh ``conformance-`` ids and folders it remembers for cleanup, and the steps
cases share (prepare until prepared, a refusal that must change nothing).

It knows the protocol's wire shapes (:mod:`rollpoint.protocol.control`), nothing of how
rollpoint's own servers implement them. The cases are in
:mod:`rollpoint.testing.conformance_cases`; running them is
:mod:`rollpoint.testing.conformance`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from rollpoint.protocol.control import Phase, PrepareReply, StatusReply, Verb
from rollpoint.protocol.control_verbs import VERBS

M = TypeVar("M", bound=BaseModel)

ID_PREFIX = "conformance-"
"""Every checkpoint and rollout id the kit uses starts with this."""
DEADLINE_S = 10.0
"""How far ahead the deadline of an ordinary call is."""


class CaseFailed(Exception):
    """A case's expectation did not hold; the message is the one-line reason."""


# --- the probe ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One control reply as it came off the wire."""

    verb: str
    status: int
    body: Any
    """Decoded JSON, or None when the body was not JSON."""
    text: str

    @property
    def error(self) -> dict[str, Any] | None:
        err = self.body.get("error") if isinstance(self.body, dict) else None
        return err if isinstance(err, dict) else None

    @property
    def code(self) -> str | None:
        code = self.error.get("code") if self.error else None
        return code if isinstance(code, str) else None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.status} {self.code}: {str(self.error.get('message'))[:160]}"
        return f"{self.status} {self.text[:160]!r}"


class Probe:
    """Raw HTTP to one participant's control routes, with its token unless told otherwise."""

    def __init__(self, client: httpx.AsyncClient, url: str, token: str) -> None:
        self._client = client
        self._base = url.rstrip("/")
        self.token = token
        self.authorization = f"Bearer {token}"

    async def send(
        self,
        verb: Verb,
        body: Any = None,
        *,
        authorization: str | None = "",
        content_type: str | None = "application/json",
    ) -> Reply:
        """``GET status``, or ``POST verb`` with ``body`` as JSON (bytes are sent as they are).

        ``authorization`` "" sends the right token, None sends no header, else that value;
        ``content_type`` None sends no ``Content-Type``.
        """
        headers = {} if content_type is None else {"content-type": content_type}
        if authorization is not None:
            headers["authorization"] = authorization or self.authorization
        spec = VERBS[verb]
        url = f"{self._base}{spec.path}"
        if spec.request is None:
            resp = await self._client.request(spec.method, url, headers=headers)
        else:
            content = body if isinstance(body, bytes) else orjson.dumps(body)
            resp = await self._client.request(spec.method, url, content=content, headers=headers)
        try:
            decoded: Any = orjson.loads(resp.content) if resp.content else None
        except orjson.JSONDecodeError:
            decoded = None
        return Reply(str(verb), resp.status_code, decoded, resp.text)

    async def status(self) -> StatusReply:
        return expect_ok(await self.send(Verb.STATUS), StatusReply)


def expect_ok(reply: Reply, model: type[M]) -> M:
    """The reply parsed as ``model``; :class:`CaseFailed` unless it is a 200 of that shape."""
    if reply.status != 200:
        raise CaseFailed(f"{reply.verb}: expected 200, got {reply.describe()}")
    try:
        return model.model_validate(reply.body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise CaseFailed(
            f"{reply.verb}: the 200 reply is not a {model.__name__} ({where}: {first['msg']})"
        ) from None


def expect_refused(reply: Reply, status: int, code: str) -> str:
    """The refusal's message; :class:`CaseFailed` unless it is ``status`` + ``code`` in the
    error envelope."""
    if reply.status != status or reply.code != code:
        raise CaseFailed(f"{reply.verb}: expected {status} {code}, got {reply.describe()}")
    err = reply.error or {}
    if not isinstance(err.get("message"), str) or not isinstance(err.get("retryable"), bool):
        raise CaseFailed(
            f"{reply.verb}: {status} {code} is not the error envelope "
            '{"error": {"code", "message", "retryable"}}'
        )
    return str(err["message"])


def check(condition: bool, reason: str) -> None:
    if not condition:
        raise CaseFailed(reason)


def deadline(seconds: float = DEADLINE_S) -> float:
    return time.time() + seconds


# --- one case's context -------------------------------------------------------------------


@dataclass
class Trial:
    """What one case runs with: the probe, fresh ids and folders, and what to clean up."""

    probe: Probe
    run_tag: str
    case: str
    snapshot_dir: str
    lease_grace_s_hint: float | None
    local_root: Path | None
    checkpoint_ids: list[str] = field(default_factory=list)
    rollout_ids: list[str] = field(default_factory=list)

    def cid(self, label: str = "") -> str:
        """A fresh checkpoint id, remembered so the runner resumes it after the case."""
        cid = f"{ID_PREFIX}{self.run_tag}-{self.case}{'-' + label if label else ''}"
        self.checkpoint_ids.append(cid)
        return cid

    def rollout(self) -> str:
        rid = f"{ID_PREFIX}{self.run_tag}-{self.case}-r{len(self.rollout_ids)}"
        self.rollout_ids.append(rid)
        return rid

    def folder(self, label: str = "") -> str:
        return f"{self.snapshot_dir}/{self.run_tag}/{self.case}{'-' + label if label else ''}"

    async def prepare(self, cid: str, due: float | None = None) -> PrepareReply:
        """Prepare ``cid``; :class:`CaseFailed` unless the participant is prepared."""
        due = deadline() if due is None else due
        body = {"checkpoint_id": cid, "deadline_ts": due}
        reply = expect_ok(await self.probe.send(Verb.PREPARE, body), PrepareReply)
        if reply.phase is not Phase.PREPARED:
            shown = ", ".join(reply.report.blockers[:5])
            raise CaseFailed(
                f"prepare {cid}: phase {reply.phase}, not prepared "
                f"({reply.report.blocker_count} blocker(s): {shown}); the participant must "
                "be quiet (no episode in flight) while the kit runs"
            )
        check(reply.checkpoint_id == cid, f"prepare {cid}: reply names {reply.checkpoint_id}")
        check(reply.report.ready, f"prepare {cid}: phase prepared but report.ready is false")
        check(
            reply.lease_expires_at >= due,
            f"prepare {cid}: lease_expires_at {reply.lease_expires_at:.3f} is before the "
            f"deadline {due:.3f}",
        )
        return reply

    async def commit(self, cid: str, folder: str, scope: list[dict[str, Any]]) -> Reply:
        body = {
            "checkpoint_id": cid,
            "deadline_ts": deadline(),
            "checkpoint_dir": folder,
            "episode_ids": scope,
        }
        return await self.probe.send(Verb.COMMIT, body)

    async def phase_is(self, phase: Phase, cid: str | None) -> StatusReply:
        status = await self.probe.status()
        check(
            (status.phase, status.checkpoint_id) == (phase, cid),
            f"status: expected phase {phase} checkpoint {cid}, "
            f"got {status.phase} checkpoint {status.checkpoint_id}",
        )
        return status

    async def unchanged(self, before: StatusReply, after_what: str) -> None:
        """:class:`CaseFailed` if status moved since ``before``: a refusal changes nothing."""
        now = await self.probe.status()
        changed = [
            f"{name} {getattr(before, name)!r} -> {getattr(now, name)!r}"
            for name in ("phase", "checkpoint_id", "lease_expires_at", "counts", "retired_rollouts")
            if getattr(before, name) != getattr(now, name)
        ]
        check(not changed, f"after {after_what} the status changed: {'; '.join(changed)}")

    async def refused(
        self,
        verb: Verb,
        body: Any,
        status: int,
        code: str,
        *,
        content_type: str | None = "application/json",
    ) -> str:
        """Send, expect the refusal, and check the participant's status did not move."""
        before = await self.probe.status()
        reply = await self.probe.send(verb, body, content_type=content_type)
        message = expect_refused(reply, status, code)
        await self.unchanged(before, f"a refused {verb}")
        return message
