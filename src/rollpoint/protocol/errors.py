"""The one error tree of rollpoint, and its mapping to HTTP.

Every error raised on purpose is a :class:`RollpointError`. Each carries a stable
``code`` (what a client switches on), an HTTP ``status`` (used when it crosses the
wire) and ``retryable`` (whether trying the same thing again later can help). A code
belongs to one class and has one status: the wire takes both from here, never from the
route, and a row that fails (a ``failed`` line of ``/run``) carries the code of the error
that failed it, ``transport`` when the error is retryable::

    RollpointError                  500 internal               (a bug: not one of ours)
    ├── ConfigError                 400 config_invalid         (user input, CLI exit 2)
    ├── LaunchError                 500 launch_failed          (a server could not start)
    ├── TransportError              502 transport_error        retryable (peer down, garbage reply)
    ├── ProtocolError               400 protocol_error         a peer refused a request; the code says why
    │   ├── BadRequestError         400 bad_request
    │   ├── UnauthorizedError       401 unauthorized
    │   ├── NotFoundError           404 not_found
    │   │   └── ModelNotFoundError  404 model_not_found    (OpenAI's code for an unknown model)
    │   ├── UnsupportedMediaTypeError 415 unsupported_media_type (a body that is not UTF-8 JSON)
    │   ├── PayloadTooLargeError    413 payload_too_large      (a control body over its cap)
    │   ├── InvalidPhaseError       409 invalid_phase
    │   ├── CheckpointConflictError 409 checkpoint_conflict
    │   ├── StaleCheckpointError    409 stale_checkpoint
    │   ├── StaleAttemptError       409 stale_attempt
    │   ├── AttemptConflictError    409 attempt_conflict       retryable (another attempt runs here)
    │   ├── IdempotencyConflictError 409 idempotency_conflict (a key reused for another call)
    │   ├── DeadlineExceededError   409 deadline_exceeded      retryable
    │   └── InvalidCheckpointStateError 422 invalid_checkpoint_state
    ├── EpisodeError                422 episode_failed         (a bad rollout is data, not a crash)
    │   ├── EnvironmentMismatchError 422 environment_mismatch (a row for another environment)
    │   ├── EnvironmentRaisedError  500 environment_error     (the environment's code raised)
    │   └── EffectInDoubtError      500 effect_in_doubt        (an effect that may have been made, undecided)
    ├── AttemptCancelledError       409 cancelled              retryable (retired, or the server stopped)
    ├── ToolArgumentError           400 tool_argument_invalid  (told to the model, never on the wire)
    ├── SnapshotError               500 snapshot_failed        retryable (one failed save)
    ├── RunStalledError             500 run_stalled            (no row result for too long)
    ├── RunStuckError               504 run_stuck              (calls waiting on a peer that answers none)
    ├── GroupsFailedError           500 groups_failed          (too many groups failed; CLI exit 3)
    ├── WorkdirBusyError            409 workdir_busy           (another process holds the workdir)
    ├── StorageError                507 storage_failed         (a file could not be written: disk full, I/O, permissions)
    ├── RestoreError                500 restore_refused        (a restore that cannot be exact)
    ├── JournalFormatError          500 journal_unreadable     (a journal segment this rollpoint cannot read)
    └── RunPreemptedError           500 run_preempted          (SIGTERM/SIGINT; CLI exit 143/130)

On the wire every refusal is ``{"error": {"code", "message", "retryable"}}`` with the
error's status; :func:`error_from_wire` turns it back into the same class. On the
OpenAI-compatible routes (``/v1/*``) the same object also carries OpenAI's ``type`` and
``param`` (:meth:`RollpointError.to_openai_wire`), so OpenAI clients raise their own typed
errors and rollpoint's clients still read ``code``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RollpointError(Exception):
    """Base of every error rollpoint raises on purpose."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    param: ClassVar[str | None] = None
    """The request field at fault, for OpenAI's ``error.param`` (None: no one field)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "retryable": self.retryable}}

    def to_openai_wire(self, param: str | None = None) -> dict[str, Any]:
        """The envelope in OpenAI's shape (``message``, ``type``, ``param``, ``code``), plus
        ``retryable``; ``param`` overrides the class's."""
        kind = OPENAI_ERROR_TYPES.get(self.status)
        if kind is None:
            kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": param if param is not None else self.param,
                "code": self.code,
                "retryable": self.retryable,
            }
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (Ray, multiprocessing): keep them picklable.
        return (type(self), (self.message,))


class ConfigError(RollpointError):
    code = "config_invalid"
    status = 400


class LaunchError(RollpointError):
    code = "launch_failed"


class TransportError(RollpointError):
    """The peer could not be reached, or answered something that is not our protocol."""

    code = "transport_error"
    status = 502
    retryable = True


class ProtocolError(RollpointError):
    """A peer understood the request and refused it."""

    code = "protocol_error"
    status = 400


class BadRequestError(ProtocolError):
    code = "bad_request"
    status = 400


class UnauthorizedError(ProtocolError):
    code = "unauthorized"
    status = 401


class NotFoundError(ProtocolError):
    code = "not_found"
    status = 404


class UnsupportedMediaTypeError(ProtocolError):
    """A request body sent without ``Content-Type: application/json`` (or with a charset
    other than UTF-8): the wire takes UTF-8 JSON only."""

    code = "unsupported_media_type"
    status = 415


class PayloadTooLargeError(ProtocolError):
    """A request body over the route's cap (the control routes': ``MAX_CONTROL_BODY_BYTES``):
    refused before it is read whole."""

    code = "payload_too_large"
    status = 413


class ModelNotFoundError(NotFoundError):
    """A model id no engine behind this URL serves."""

    code = "model_not_found"
    status = 404
    param = "model"


class InvalidPhaseError(ProtocolError):
    code = "invalid_phase"
    status = 409


class CheckpointConflictError(ProtocolError):
    code = "checkpoint_conflict"
    status = 409


class StaleCheckpointError(ProtocolError):
    code = "stale_checkpoint"
    status = 409


class StaleAttemptError(ProtocolError):
    code = "stale_attempt"
    status = 409


class AttemptConflictError(ProtocolError):
    """A ``/run`` row for a rollout that holds another attempt on this agent: a plumbing
    race (the old try is still here), so a fresh re-send once it is retired can succeed."""

    code = "attempt_conflict"
    status = 409
    retryable = True


class IdempotencyConflictError(ProtocolError):
    """An idempotency key came back with another call (another tool or other arguments):
    a bug in the caller, refused rather than answered with the first call's result."""

    code = "idempotency_conflict"
    status = 409


class DeadlineExceededError(ProtocolError):
    code = "deadline_exceeded"
    status = 409
    retryable = True


class InvalidCheckpointStateError(ProtocolError):
    code = "invalid_checkpoint_state"
    status = 422


class EpisodeError(RollpointError):
    """An episode could not be played (bad task, verifier failure): data, not a crash."""

    code = "episode_failed"
    status = 422


class EnvironmentMismatchError(EpisodeError):
    """A ``/run`` row whose task is for another environment than the agent serves: the row
    is bad data (it fails its group), not a plumbing fault."""

    code = "environment_mismatch"
    status = 422


class EnvironmentRaisedError(EpisodeError):
    """The environment's own code (a tool, ``start``, ``verify``, ``export_state``) raised
    an exception that is not a :class:`ToolArgumentError`: a bug in the environment, not a
    network fault. The message carries the exception's type and text and the
    environment's frame where it was raised; the traceback is in the resources server's
    log. Not retryable: the same call would raise again, so the row fails its group."""

    code = "environment_error"
    status = 500


class EffectInDoubtError(EpisodeError):
    """An effect outside the episode's state (``ctx.effect``) whose intent was journaled
    but not its result, which the environment's ``reconcile`` did not decide: it may have
    been made. Not retryable: the episode fails rather than make it a second time; the
    message names the environment, the effect and the episode."""

    code = "effect_in_doubt"
    status = 500


class AttemptCancelledError(RollpointError):
    """A running attempt was stopped (retired, or its server stopped) before it finished:
    its row is re-sent fresh, so it is retryable."""

    code = "cancelled"
    status = 409
    retryable = True


class ToolArgumentError(RollpointError):
    """A tool call the environment cannot run: unknown tool, bad or missing arguments.

    Never crosses the wire as an error: the resources server turns its message into a
    ``ToolResult(is_error=True)`` so the model can read it and try again. Its status is
    the one it would have if it did.
    """

    code = "tool_argument_invalid"
    status = 400


class SnapshotError(RollpointError):
    code = "snapshot_failed"
    retryable = True


class RestoreError(RollpointError):
    code = "restore_refused"


class JournalFormatError(RollpointError):
    """A journal segment that is not one, or of a format version this rollpoint cannot read:
    the message names the file (:mod:`rollpoint.store.journal_format`)."""

    code = "journal_unreadable"


class RunStalledError(RollpointError):
    """No row result arrived for the stall timeout (snapshot pauses not counted)."""

    code = "run_stalled"


class RunStuckError(RollpointError):
    """Calls have waited on a peer (the policy engine, a resources server) with none
    answered for the stuck watchdog's stop time: the run took a snapshot and stopped."""

    code = "run_stuck"
    status = 504


class GroupsFailedError(RollpointError):
    """More prompt groups failed than ``failure.max_failed_fraction`` allows: the run took
    a snapshot and stopped early (``rollpoint run`` exits 3, as for a run that ended with
    failed groups). ``failed`` holds group id → reason."""

    code = "groups_failed"

    def __init__(self, message: str, failed: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.failed))


class StorageError(RollpointError):
    """A file the trainer must write durably (train data, a train checkpoint) could not be
    written: the run stops with the path and the reason (disk full, I/O error, permissions)."""

    code = "storage_failed"
    status = 507


class WorkdirBusyError(RollpointError):
    """Another live process holds the workdir's lock: one writer per workdir."""

    code = "workdir_busy"
    status = 409


class RunPreemptedError(RollpointError):
    """The run stopped on a signal; the message says which snapshot holds it."""

    code = "run_preempted"

    def __init__(self, message: str, exit_code: int = 143) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.exit_code))


OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
"""OpenAI's ``error.type`` by status; other 4xx are ``invalid_request_error``, 5xx
``server_error``."""


def _all_subclasses(cls: type[RollpointError]) -> list[type[RollpointError]]:
    out: list[type[RollpointError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class_for(code: str) -> type[RollpointError]:
    """The error class that owns ``code`` (``ProtocolError`` for codes we do not know)."""
    for cls in _all_subclasses(RollpointError):
        if cls.code == code:
            return cls
    return ProtocolError


def error_from_wire(status: int, body: Any, *, peer: str) -> RollpointError:
    """Rebuild the typed error a peer sent; anything off-protocol is a TransportError."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("code"), str):
            cls = error_class_for(err["code"])
            return cls(f"{peer}: {err.get('message', '')}")
        detail = body.get("detail")
        if status == 422 and detail is not None:
            return BadRequestError(f"{peer}: invalid request: {detail}")
    if 400 <= status < 500:
        return ProtocolError(f"{peer}: HTTP {status}: {str(body)[:200]}")
    return TransportError(f"{peer}: HTTP {status}: {str(body)[:200]}")
