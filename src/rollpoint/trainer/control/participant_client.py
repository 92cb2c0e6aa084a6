"""The coordinator's side of the control protocol: one typed client per participant.

Owns the calls only (bodies, per-call timeouts tied to the shared deadline, the
participant's label on a failure). Each goes through a
:class:`~rollpoint.trainer.control.control_transport.ControlTransport`: over HTTP by default
(:class:`~rollpoint.trainer.control.control_transport.HttpControlTransport`), or any other given
(in-process, fault-injecting). A peer's refusal comes back as its typed error; a peer that
is down, too slow, or answers something that is not the protocol is a
:class:`TransportError` naming it. The ordering of calls across participants is the
coordinator's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel

from rollpoint.http.client import HttpClient
from rollpoint.protocol.control import (
    AckReply,
    AckRequest,
    CheckpointReply,
    CheckpointRequest,
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
)
from rollpoint.protocol.control_verbs import (
    ACK,
    CHECKPOINT,
    COMMIT,
    CONFIRM,
    FORGET,
    PREPARE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    STATUS,
    ControlVerb,
)
from rollpoint.protocol.errors import ConfigError, TransportError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.protocol.participant import ParticipantKind
from rollpoint.trainer.control.control_transport import ControlTransport, HttpControlTransport

R = TypeVar("R", bound=BaseModel)

# A reply may arrive a little after the deadline it answers (network, scheduling).
_REPLY_GRACE_S = 5.0


@dataclass(frozen=True)
class ParticipantAddress:
    kind: ParticipantKind
    replica: str
    url: str
    """The server's base URL; control routes live under ``CONTROL_PREFIX``."""

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.replica}"


class ParticipantClient:
    def __init__(
        self,
        address: ParticipantAddress,
        http: HttpClient | None = None,
        *,
        control_timeout_s: float = 30.0,
        transport: ControlTransport | None = None,
    ) -> None:
        """Calls go through ``transport`` when given, else over ``http`` to ``address.url``."""
        if transport is None:
            if http is None:
                raise ConfigError(f"participant client {address.label}: give http or a transport")
            transport = HttpControlTransport(http, address.url)
        self.address = address
        self.transport = transport
        self._timeout_s = control_timeout_s

    @property
    def label(self) -> str:
        return self.address.label

    def relocated(self, url: str) -> ParticipantClient:
        """The same participant served at ``url`` (its replica was restarted on new ports)."""
        return ParticipantClient(
            replace(self.address, url=url),
            control_timeout_s=self._timeout_s,
            transport=self.transport.relocated(url),
        )

    async def _call(
        self, verb: ControlVerb[Any, R], body: BaseModel | None, deadline_ts: float | None
    ) -> R:
        timeout = self._timeout_s
        if deadline_ts is not None:
            timeout = max(0.5, deadline_ts - time.time() + _REPLY_GRACE_S)
        try:
            return await self.transport.call(verb, body, timeout)
        except TransportError as exc:
            raise TransportError(f"{self.label} {verb.verb}: {exc.message}") from None

    async def status(self) -> StatusReply:
        return await self._call(STATUS, None, None)

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareReply:
        body = PrepareRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        return await self._call(PREPARE, body, deadline_ts)

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> RenewReply:
        body = RenewRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        return await self._call(RENEW, body, deadline_ts)

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        scope: list[EpisodeId],
        *,
        wait_for_write: bool = True,
        scope_as_keys: bool = False,
    ) -> CommitReply:
        """``wait_for_write=False``: the reply comes once the state is captured (its
        ``manifest`` is None); :meth:`confirm` collects the manifest after the resume.
        ``scope_as_keys``: send the scope as ``episode_keys`` (feature ``scope-keys``)."""
        body = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            checkpoint_dir=checkpoint_dir,
            episode_ids=[] if scope_as_keys else scope,
            wait_for_write=wait_for_write,
        )
        if scope_as_keys:
            # Set without validating again: keys of EpisodeIds are well-formed, and checking
            # 50k of them cost ~13 ms per participant inside the pause (the server checks).
            body = body.model_copy(update={"episode_keys": [e.key for e in scope]})
        return await self._call(COMMIT, body, deadline_ts)

    async def checkpoint(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        floor: JournalMark | None,
    ) -> CheckpointReply:
        """A journal-mode checkpoint: no admission close (``floor``: the journal mark its
        manifest saves; None keeps the whole journal)."""
        body = CheckpointRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            checkpoint_dir=checkpoint_dir,
            floor=floor,
        )
        return await self._call(CHECKPOINT, body, deadline_ts)

    async def confirm(self, checkpoint_id: str, deadline_ts: float) -> ConfirmReply:
        body = ConfirmRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)
        return await self._call(CONFIRM, body, deadline_ts)

    async def resume(self, checkpoint_id: str) -> ResumeReply:
        return await self._call(RESUME, ResumeRequest(checkpoint_id=checkpoint_id), None)

    async def restore(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        scope: list[EpisodeId],
        source_checkpoint_id: str,
        sources: list[str] | None = None,
    ) -> RestoreReply:
        """``sources``: the replicas whose saved records to install (default: its own)."""
        body = RestoreRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=deadline_ts,
            checkpoint_dir=checkpoint_dir,
            episode_ids=scope,
            source_checkpoint_id=source_checkpoint_id,
            sources=sources,
        )
        return await self._call(RESTORE, body, deadline_ts)

    async def retire(self, episodes: list[EpisodeId]) -> RetireReply:
        return await self._call(RETIRE, RetireRequest(episode_ids=episodes), None)

    async def forget(self, rollout_ids: list[str]) -> ForgetReply:
        return await self._call(FORGET, ForgetRequest(rollout_ids=rollout_ids), None)

    async def ack(self, episodes: list[EpisodeId]) -> AckReply:
        return await self._call(ACK, AckRequest(episode_ids=episodes), None)
