"""The control verbs as one table: each verb's HTTP method, route, request and reply model.

Owns :data:`VERBS` (and one typed :class:`ControlVerb` constant per verb), the single list
that the participant's routes (:mod:`rollpoint.participant.control_routes`), the trainer's
client (:mod:`rollpoint.trainer.control.participant_client`), its transports, the conformance kit and
the fuzzer all iterate, so a verb added to the protocol is added in one place. It does not
own the models themselves nor what each verb does (:mod:`rollpoint.protocol.control` says
that, the fence does it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from rollpoint.protocol.control import (
    CONTROL_PREFIX,
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
    Verb,
)
from rollpoint.protocol.errors import TransportError

__all__ = [
    "ACK",
    "CHECKPOINT",
    "COMMIT",
    "CONFIRM",
    "FORGET",
    "PREPARE",
    "RENEW",
    "RESTORE",
    "RESUME",
    "RETIRE",
    "STATUS",
    "VERBS",
    "ControlVerb",
]

Q = TypeVar("Q", bound=BaseModel, covariant=True)
R = TypeVar("R", bound=BaseModel, covariant=True)


@dataclass(frozen=True)
class ControlVerb(Generic[Q, R]):
    """One row of the table: a verb, how it travels over HTTP, and its two models."""

    verb: Verb
    method: Literal["GET", "POST"]
    request: type[Q] | None
    """The body's model; None for a verb that takes no body (``status``)."""
    reply: type[R]

    @property
    def path(self) -> str:
        """The route, ``CONTROL_PREFIX/<verb>``."""
        return f"{CONTROL_PREFIX}/{self.verb}"

    def parse_reply(self, raw: Any) -> R:
        """A decoded JSON reply as the verb's reply model; one that is not the protocol is
        a :class:`TransportError` naming the first bad field (every transport reads its
        replies with this, so a garbled reply reads the same over any of them)."""
        try:
            return self.reply.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise TransportError(f"reply is not the protocol ({where}: {first['msg']})") from None


# Status takes no body; BaseModel stands for "no request model" in the type.
STATUS: ControlVerb[BaseModel, StatusReply] = ControlVerb(Verb.STATUS, "GET", None, StatusReply)
PREPARE = ControlVerb(Verb.PREPARE, "POST", PrepareRequest, PrepareReply)
RENEW = ControlVerb(Verb.RENEW, "POST", RenewRequest, RenewReply)
COMMIT = ControlVerb(Verb.COMMIT, "POST", CommitRequest, CommitReply)
CONFIRM = ControlVerb(Verb.CONFIRM, "POST", ConfirmRequest, ConfirmReply)
RESUME = ControlVerb(Verb.RESUME, "POST", ResumeRequest, ResumeReply)
RESTORE = ControlVerb(Verb.RESTORE, "POST", RestoreRequest, RestoreReply)
RETIRE = ControlVerb(Verb.RETIRE, "POST", RetireRequest, RetireReply)
FORGET = ControlVerb(Verb.FORGET, "POST", ForgetRequest, ForgetReply)
ACK = ControlVerb(Verb.ACK, "POST", AckRequest, AckReply)
CHECKPOINT = ControlVerb(Verb.CHECKPOINT, "POST", CheckpointRequest, CheckpointReply)

VERBS: dict[Verb, ControlVerb[BaseModel, BaseModel]] = {
    v.verb: v
    for v in (
        STATUS,
        PREPARE,
        RENEW,
        COMMIT,
        CONFIRM,
        RESUME,
        RESTORE,
        RETIRE,
        FORGET,
        ACK,
        CHECKPOINT,
    )
}
"""Every control verb, in :class:`~rollpoint.protocol.control.Verb` order."""
