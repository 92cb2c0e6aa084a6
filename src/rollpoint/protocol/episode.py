"""Wire models of the data plane: tasks, ``/run`` rows and their results, tool calls.

Trainer → agent: ``POST /run`` with a :class:`RunRequest` (one or more rows of one prompt
group). The agent streams back one :class:`RowResult` per row as NDJSON, in the order
the rows finish: :class:`RunReply` (finished), :class:`RowFailure` (this row failed; its
siblings keep going) or :class:`RowRefused` (admission closed: the row never ran, keep
its identity and send it again when the gate reopens).

Agent → resources: ``POST /episodes/start``, ``POST /tools/{name}`` with a :class:`ToolCall`,
``POST /episodes/verify``. Agent → model: OpenAI chat completions with the episode headers
of :mod:`rollpoint.protocol.ids`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue

from rollpoint.protocol.ids import EpisodeId, Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.token_data import TokenSegment, TokenTexts, TokenTrace

EnvironmentName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z_][\w.-]*(:[A-Za-z_][\w./@:-]*)?$",
    ),
]
"""An environment reference: a built-in or registered name (``workplace``, ``sandbox``) or an
import path ``package.module:ClassName``; :mod:`rollpoint.envs.registry` resolves it."""


class TaskRow(StrictModel):
    """One dataset row: what the episode is asked to do, and what its verifier needs."""

    task_id: Identifier
    environment: EnvironmentName
    prompt: str
    """The user message that opens the episode."""
    params: dict[str, JsonValue] = Field(default_factory=dict)
    """Environment-specific parameters (the verifier's expectations, a game seed)."""


class RunRow(StrictModel):
    """One row of a prompt group, sent to an agent to play one episode."""

    task: TaskRow
    group_id: Identifier
    row: Annotated[int, Field(ge=0)]
    episode: EpisodeId
    max_turns: Annotated[int, Field(ge=1, le=1024)] = 8


class RunRequest(StrictModel):
    rows: Annotated[list[RunRow], Field(min_length=1, max_length=4096)]


class ModelCall(StrictModel):
    """One policy call of an episode, as the agent saw it."""

    turn: int
    attempt: int
    """The attempt that made the call: calls before a restore keep their old attempt."""
    response: dict[str, JsonValue]
    """The assistant message the policy returned (OpenAI format)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_version: int = 0
    """The version the model server stamped on the reply (``x-rollpoint-policy-version``)."""
    latency_s: float = 0.0
    completion_id: str | None = None
    """The engine's id of the completion (its reply's ``id``), when it gave one."""
    finish_reason: str | None = None
    tokens: TokenTrace | None = None
    """The token ids and logprobs the engine sampled, when token capture is on and the
    engine returned them. Records written before token capture have none."""
    segments: list[TokenSegment] | None = None
    """A call continued after a restore from the prefix saved at a snapshot: the policy
    version of each run of its completion tokens, prefix first (the model server's
    ``x-rollpoint-token-segments`` header). None for a call decoded in one go."""
    token_texts: TokenTexts | None = None
    """With token capture, an engine whose reply has logprobs but no ids: each sampled
    token's text and logprob (``tokens`` is None then). None otherwise."""


class RunReply(StrictModel):
    kind: Literal["finished"] = "finished"
    episode: EpisodeId
    task_id: Identifier
    group_id: Identifier
    row: int
    reward: float
    messages: list[dict[str, JsonValue]]
    """The whole transcript in OpenAI chat format."""
    model_calls: list[ModelCall]
    turns: int
    finish_reason: Literal["final", "max_turns"]


class RowFailure(StrictModel):
    kind: Literal["failed"] = "failed"
    episode: EpisodeId
    group_id: Identifier
    row: int
    code: str
    message: str
    transport: bool
    """True when the failure came from the plumbing (a peer down, a timeout): worth a fresh
    re-send. False for a data failure (the task itself is bad), which fails the group."""


class RowRefused(StrictModel):
    kind: Literal["refused"] = "refused"
    episode: EpisodeId
    group_id: Identifier
    row: int
    reason: str


RowResult = Annotated[RunReply | RowFailure | RowRefused, Field(discriminator="kind")]


class EpisodeStart(StrictModel):
    """Agent → resources: create (or find) the episode's environment state."""

    episode: EpisodeId
    task: TaskRow
    held_calls: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]] = []
    """The ``(turn, call_index)`` keys of the tool calls whose results the agent's session
    already holds (a continued episode: restored from a snapshot, resumed from its turn
    journal). The server refuses the start when its state of the rollout lacks any of them
    (a damaged journal lost them): the turns after would be played on a state without
    their effects. Empty for an episode that starts at its prompt."""


class ToolCall(StrictModel):
    """Agent → resources: one tool call of one turn.

    ``(episode.rollout_id, turn, call_index)`` is the idempotency key: the same key
    returns the first result and never applies a side effect twice.
    """

    episode: EpisodeId
    turn: Annotated[int, Field(ge=0)]
    call_index: Annotated[int, Field(ge=0)]
    arguments: str
    """The raw JSON argument string the model produced (it may be malformed)."""


class ToolResult(StrictModel):
    content: str
    is_error: bool = False
    replayed: bool = False
    """True when this key was seen before and the stored first result was returned."""


class VerifyRequest(StrictModel):
    episode: EpisodeId
    final_message: str | None = None


class VerifyReply(StrictModel):
    reward: float
    detail: dict[str, Any] = Field(default_factory=dict)
