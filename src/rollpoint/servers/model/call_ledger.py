"""The model server's call ledger: every policy call of every episode, filed by rollout id.

Owns: one :class:`CallRecord` per proxied call that carried the episode headers (rollout id,
attempt, turn), where a continued attempt's call supersedes an older attempt's calls of the
same or later turns (replies held unapplied at a cut); the index by rollout id (O(1)
lookup, export and release); a change stamp per rollout (so an exporter can reuse what it
built from calls that did not change); and the all-or-nothing install of exported records
on restore.

Each record keeps the call's token data as a packed :class:`TokenTrace` (an episode's
records cost O(its tokens): prompts are stored as the suffix each adds).

Does not own: proxying (the model server), deciding what to keep across a checkpoint (the
fence passes the scope), or reading token data out of replies (the engine adapters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import Field, JsonValue, TypeAdapter, ValidationError

from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import Identifier
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.token_data import TokenSegment, TokenTrace, context_after


class CallRecord(StrictModel):
    """One policy call as the model server saw it."""

    rollout_id: Identifier
    attempt: Annotated[int, Field(ge=0)]
    turn: Annotated[int, Field(ge=0)]
    request_messages: Annotated[int, Field(ge=0)]
    """How many messages the request carried (the conversation length at this turn)."""
    last_message: dict[str, JsonValue] | None
    """The request's last message: the user prompt or the latest tool result."""
    response: dict[str, JsonValue] | None
    """The assistant message the engine returned (assembled from deltas when streamed)."""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_version: int = 0
    latency_s: float = 0.0
    streamed: bool = False
    logprobs: JsonValue = None
    """Engine logprobs of the choice as it sent them, when the engine returned some and no
    token trace holds them (with a trace, its packed logprobs are the record's)."""
    completion_id: str | None = None
    """The engine's id of the completion (its reply's ``id``)."""
    tokens: TokenTrace | None = None
    """Choice 0's token ids and logprobs, streamed or not, with the prompt ids stored as
    the suffix since the rollout's previous call when they extend it. None when the
    engine returned no token data (and in records written before token capture)."""
    segments: list[TokenSegment] | None = None
    """A call continued from a prefix saved at a snapshot: the policy version of each run
    of its completion tokens (prefix first). None for a call decoded in one go (and in
    records written before the generation cut)."""
    continued_tokens: Annotated[int, Field(ge=0)] = 0
    """Completion tokens taken from the saved prefix, not decoded again."""
    regenerated: str | None = None
    """Why a saved prefix of this call was not continued (a refusal of
    :mod:`rollpoint.servers.model.generation_cut`): the call was decoded from scratch."""


_RECORDS = TypeAdapter(list[CallRecord])


def json_form(rec: CallRecord) -> dict[str, Any]:
    """``rec.model_dump(mode="json")``, made cheaply: a record's fields hold JSON values only
    (what the model server parsed, or what :meth:`CallLedger.install` validated), so a copy
    of its field dict is its JSON form, without a walk over every nested value on the data
    path. Nested values are shared with the record: treat them as read-only."""
    form = dict(rec.__dict__)
    tokens = form.get("tokens")
    if tokens is not None:
        # A trace's fields are strings, ints and a bool: its field dict is its JSON form.
        form["tokens"] = dict(tokens.__dict__)
    segments = form.get("segments")
    if segments is not None:
        form["segments"] = [dict(s.__dict__) for s in segments]
    return form


class CallLedger:
    """Call records indexed by rollout id; records of one rollout stay in call order."""

    def __init__(self) -> None:
        self._by_rollout: dict[str, list[CallRecord]] = {}
        self._json: dict[str, list[dict[str, Any]]] = {}
        """JSON forms of each rollout's records, dumped once each (records only append)."""
        self._stamps: dict[str, int] = {}
        """Each rollout's change stamp: the value of ``_clock`` at its last change."""
        self._clock = 0
        self._count = 0
        self._observer: Callable[[str], None] | None = None

    def observe(self, observer: Callable[[str], None]) -> None:
        """Call ``observer(rollout_id)`` whenever a rollout's records change from now on
        (a checkpoint participant keeps its saved form current with it)."""
        self._observer = observer

    @property
    def count(self) -> int:
        """Records held, across every rollout."""
        return self._count

    def __len__(self) -> int:
        return self._count

    def rollout_ids(self) -> list[str]:
        """The rollouts with records."""
        return list(self._by_rollout)

    def stamp(self, rollout_id: str) -> int | None:
        """A number that changes whenever the rollout's records change and is never given
        to another state of them (None while it has none): equal stamps, same records."""
        return self._stamps.get(rollout_id)

    def _changed(self, rollout_id: str) -> None:
        self._clock += 1
        self._stamps[rollout_id] = self._clock
        if self._observer is not None:
            self._observer(rollout_id)

    def record(self, rec: CallRecord) -> None:
        self._changed(rec.rollout_id)
        calls = self._by_rollout.get(rec.rollout_id)
        if calls is None:
            calls = self._by_rollout[rec.rollout_id] = [rec]
        else:
            self._supersede(rec, calls)
            calls.append(rec)
        self._count += 1
        # Dumped now, on the data path: a checkpoint exports every call made since the
        # last one inside its pause (~25 µs a dump, ~1,000 calls in 5 s at 200 calls/s).
        self._dump_new(rec.rollout_id, calls)

    def _dump_new(self, rollout_id: str, calls: list[CallRecord]) -> list[dict[str, Any]]:
        dumped = self._json.setdefault(rollout_id, [])
        dumped.extend(json_form(rec) for rec in calls[len(dumped) :])
        return dumped

    def _supersede(self, rec: CallRecord, calls: list[CallRecord]) -> None:
        """Drop older attempts' calls from ``rec.turn`` on: a continued attempt starts at
        the saved turn, so those replies were never applied (a cut held them), and the
        ledger keeps one call per turn of the episode as played."""
        dropped = 0
        while calls and calls[-1].attempt < rec.attempt and calls[-1].turn >= rec.turn:
            calls.pop()
            dropped += 1
        if dropped:
            self._count -= dropped
            dumped = self._json.get(rec.rollout_id)
            if dumped is not None:
                del dumped[len(calls) :]

    def context_before(self, rollout_id: str, turn: int) -> list[int] | None:
        """The rollout's token sequence before its call of ``turn`` (the last earlier
        call's prompt and completion), the base a new call's prompt is chained on."""
        earlier = (r.tokens for r in self._by_rollout.get(rollout_id, ()) if r.turn < turn)
        return context_after(earlier)

    def calls(self, rollout_id: str) -> list[CallRecord]:
        """The records of one rollout, oldest first (empty for an unknown rollout)."""
        return list(self._by_rollout.get(rollout_id, ()))

    def export(self, rollout_ids: Iterable[str]) -> list[dict[str, Any]]:
        """JSON-ready records of these rollouts (unknown ids contribute nothing)."""
        out: list[dict[str, Any]] = []
        for rollout_id in dict.fromkeys(rollout_ids):
            out.extend(self.calls_json(rollout_id))
        return out

    def calls_json(self, rollout_id: str) -> list[dict[str, Any]]:
        """The JSON forms of one rollout's records, oldest first; each record is dumped once
        however many checkpoints export it. Treat the dicts as read-only."""
        calls = self._by_rollout.get(rollout_id)
        if not calls:
            return []
        return list(self._dump_new(rollout_id, calls))

    def install(self, records: Iterable[Any]) -> list[str]:
        """Replace the records of every rollout named in ``records``; all or nothing.

        Installing the same export twice gives the same ledger. Returns the rollout ids
        installed. A malformed record raises :class:`InvalidCheckpointStateError` and
        changes nothing.
        """
        try:
            parsed = _RECORDS.validate_python(list(records))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidCheckpointStateError(
                f"call ledger record {where}: {first['msg']}"
            ) from None
        grouped: dict[str, list[CallRecord]] = {}
        for rec in parsed:
            grouped.setdefault(rec.rollout_id, []).append(rec)
        for rollout_id, calls in grouped.items():
            self._count -= len(self._by_rollout.get(rollout_id, ()))
            self._by_rollout[rollout_id] = calls
            self._json.pop(rollout_id, None)
            self._changed(rollout_id)
            self._count += len(calls)
        return list(grouped)

    def release(self, rollout_ids: Iterable[str]) -> int:
        """Drop the records of these rollouts; returns how many records were dropped."""
        dropped = 0
        for rollout_id in rollout_ids:
            calls = self._by_rollout.pop(rollout_id, None)
            self._json.pop(rollout_id, None)
            self._stamps.pop(rollout_id, None)
            if self._observer is not None:
                self._observer(rollout_id)
            if calls is not None:
                dropped += len(calls)
        self._count -= dropped
        return dropped
