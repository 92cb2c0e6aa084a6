"""The model server as a checkpoint participant: its gate and call ledger behind the fence hooks.

Owns the mapping from the :class:`~rollpoint.participant.participant.Participant` hooks to the model
server's state, and the saved form of its calls (:class:`ModelCallRecord`):

- close / open admission → close / open the admission gate (new calls wait, running
  calls go on; nothing is failed);
- readiness → always ready once the gate is closed: the *generation cut*. A call still
  running is no blocker, because the agent holds a reply that lands during the cut
  unapplied (:meth:`~rollpoint.servers.agent.session_book.SessionBook.hold_reply`) and saves its
  session as before that call; on restore the next attempt makes it again. So a prepare
  never waits for a generation. The running calls are reported in the counts;
- export(scope) → the ledger records of the scope's rollouts, each naming the scoped
  episode it was saved for; capture(scope) → the same in two steps: in the pause a copy of
  a :class:`~rollpoint.participant.state_image.StateImage` of every rollout's dumped calls (the
  ledger reports each change to it), after the pause the scope's records out of the copy;
  install → those records back into the ledger, all or nothing;
- generation cut: capture(scope) also takes, in the pause, the lengths of the output so far
  of every scoped call in flight (O(1) each, :meth:`ModelServer.cut_state`), and after the
  pause saves each as a ``model_prefix`` record (:class:`ModelPrefixRecord`: its token ids,
  logprobs, text, policy versions and digest); an installed prefix not yet continued is
  saved again. install puts the prefixes back on the server, where the replacement call
  of the same turn continues from them (:mod:`rollpoint.servers.model.generation_cut`). Snapshots
  written before the cut have no such records and install as before;
- retire → an attempt with a call running is reported ``cancelled`` (its reply will be
  refused as ``stale_attempt`` and not filed), any other ``unknown``: the model runs no
  episodes; forget → drop the rollouts' ledger records; ack → nothing is held here.

Does not own: the phase machine, retire marks and the ``stale_attempt`` check (the fence:
the server calls :meth:`~rollpoint.participant.fence.Fence.check_attempt`), nor proxying.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, JsonValue, TypeAdapter, ValidationError, model_validator

from rollpoint.participant import (
    Readiness,
    RecordMemo,
    RetireOutcome,
    RetireOutcomeKind,
    StateImage,
    latest_attempts,
)
from rollpoint.protocol.control import JOURNAL
from rollpoint.protocol.errors import InvalidCheckpointStateError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.protocol.model_base import StrictModel
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.servers.model.call_ledger import CallRecord
from rollpoint.servers.model.generation_cut import CallPrefix, FrozenPartial

if TYPE_CHECKING:
    from rollpoint.servers.model.model_server import ModelServer


class ModelCallRecord(StrictModel):
    """One ledger record as a checkpoint saves it."""

    kind: Literal["model_call"] = "model_call"
    episode: EpisodeId
    """The scoped episode it was saved for; the call's own attempt is ``call.attempt``
    (older attempts of a restored rollout are saved with it)."""
    call: CallRecord

    @model_validator(mode="after")
    def _same_rollout(self) -> ModelCallRecord:
        if self.call.rollout_id != self.episode.rollout_id:
            raise ValueError(
                f"a call of rollout {self.call.rollout_id!r} saved for {self.episode.key}"
            )
        return self


class ModelPrefixRecord(StrictModel):
    """The saved prefix of one call in flight at the snapshot."""

    kind: Literal["model_prefix"] = "model_prefix"
    episode: EpisodeId
    prefix: CallPrefix

    @model_validator(mode="after")
    def _same_rollout(self) -> ModelPrefixRecord:
        if self.prefix.rollout_id != self.episode.rollout_id:
            raise ValueError(
                f"a prefix of rollout {self.prefix.rollout_id!r} saved for {self.episode.key}"
            )
        return self


_RECORDS = TypeAdapter(
    list[Annotated[ModelCallRecord | ModelPrefixRecord, Field(discriminator="kind")]]
)
_Calls = tuple[dict[str, Any], ...]
"""One rollout's calls as the ledger dumped them (dicts nobody changes)."""


class ModelParticipant:
    """The :class:`~rollpoint.participant.participant.Participant` of one model server."""

    kind = ParticipantKind.MODEL
    mode = CheckpointMode.TURN
    portable = True
    """Its call records are plain data: they restore onto any replica's model server."""

    def __init__(self, server: ModelServer) -> None:
        self._server = server
        ledger = server.ledger
        self._image: StateImage[_Calls] = StateImage(
            lambda rollout_id: tuple(ledger.calls_json(rollout_id)) or None,
            ledger.rollout_ids,
            name="model calls",
        )
        ledger.observe(self._image.changed)
        self._memo = RecordMemo()
        """A call's record is the same object while its dump and attempt are: a snapshot's
        writer then references it without encoding it (:mod:`rollpoint.participant.record_memo`)."""

    @property
    def name(self) -> str:
        return self._server.settings.name

    @property
    def features(self) -> tuple[str, ...]:
        base = ("admission-gate", "call-ledger", "generation-cut")
        return (*base, JOURNAL) if self._server.settings.journal else base

    def journal_mark(self) -> JournalMark | None:
        """The call journal's position as the cut opens (None without a journal)."""
        journal = self._server.journal
        return None if journal is None else journal.mark()

    @property
    def replica(self) -> str:
        return self._server.settings.replica

    async def close_admission(self) -> None:
        self._server.gate.close()

    async def open_admission(self) -> None:
        self._server.gate.open()

    def readiness(self) -> Readiness:
        # Running calls do not block the cut (see the module docstring): closing the gate
        # (the fence does it before it asks) is all the model server has to do.
        return Readiness(ready=True, counts=self.stats())

    async def wait_changed(self, timeout: float) -> None:  # noqa: ASYNC109
        await self._server.gate.wait_changed(timeout)

    async def export(self, scope: Sequence[EpisodeId]) -> list[dict[str, JsonValue]]:
        return (await self.capture(scope))()

    async def capture(self, scope: Sequence[EpisodeId]) -> Callable[[], list[dict[str, JsonValue]]]:
        image = await self._image.capture()
        attempts = latest_attempts(scope)
        cut = self._server.cut_state(attempts)
        engine = self._server.settings.engine
        memo = self._memo

        def build() -> list[dict[str, JsonValue]]:
            records = [*_call_records(image, scope, memo), *_prefix_records(cut, attempts, engine)]
            memo.rotate()
            return records

        return build

    def keep_current(self) -> None:
        self._image.keep_current()

    async def aclose(self) -> None:
        await self._image.aclose()

    async def install(
        self, records: list[dict[str, JsonValue]], scope: list[EpisodeId]
    ) -> list[EpisodeId]:
        parsed = _parse(records)
        wanted = {r: EpisodeId(rollout_id=r, attempt=a) for r, a in latest_attempts(scope).items()}
        ledger = self._server.ledger
        installed = set(
            ledger.install(
                r.call
                for r in parsed
                if isinstance(r, ModelCallRecord) and r.episode.rollout_id in wanted
            )
        )
        prefixes = self._server.prefixes
        for rollout_id in wanted:
            prefixes.pop(rollout_id, None)
        for r in parsed:
            if isinstance(r, ModelPrefixRecord) and r.episode.rollout_id in wanted:
                prefixes[r.episode.rollout_id] = r.prefix
        # After a restore the snapshot is the truth: a scoped rollout saved without calls
        # has none, whatever this ledger held for it.
        ledger.release(r for r in wanted if r not in installed)
        return [wanted[r].next_attempt() for r in sorted(installed)]

    def retire(self, marks: dict[str, int]) -> list[RetireOutcome]:
        outcomes: list[RetireOutcome] = []
        for rollout_id, mark in marks.items():
            running = [a for a in self._server.running.attempts(rollout_id) if a <= mark]
            if not running:
                outcomes.append(_outcome(rollout_id, mark, RetireOutcomeKind.UNKNOWN))
            outcomes.extend(_outcome(rollout_id, a, RetireOutcomeKind.CANCELLED) for a in running)
        return outcomes

    def forget(self, rollout_ids: list[str]) -> list[str]:
        ledger = self._server.ledger
        for rollout_id in rollout_ids:
            self._server.prefixes.pop(rollout_id, None)
        return [r for r in dict.fromkeys(rollout_ids) if ledger.release([r])]

    def ack(self, episodes: list[EpisodeId]) -> list[EpisodeId]:
        return []

    def stats(self) -> dict[str, int]:
        server = self._server
        out = {
            "in_flight": server.gate.in_flight,
            "waiting": server.gate.waiting,
            "recorded_calls": server.ledger.count,
            "calls_total": server.calls_total,
        }
        if server.journal is not None:
            out["journal_read_ms"] = server.journal.journal.read_back_ms
        return out


def _call_records(
    image: Mapping[str, _Calls], scope: Sequence[EpisodeId], memo: RecordMemo | None = None
) -> list[dict[str, JsonValue]]:
    """The records of the scope's rollouts out of a captured image, each saved for the
    rollout's highest scoped attempt (runs in the writer's thread, on the copy)."""
    records: list[dict[str, JsonValue]] = []
    for rollout_id, attempt in latest_attempts(scope).items():
        calls = image.get(rollout_id)
        if calls:
            saved_for: dict[str, JsonValue] = {"rollout_id": rollout_id, "attempt": attempt}
            if memo is None:
                records.extend(_call_record(saved_for, c) for c in calls)
            else:
                records.extend(
                    memo.record(c, attempt, partial(_call_record, saved_for, c)) for c in calls
                )
    return records


def _call_record(saved_for: dict[str, JsonValue], call: dict[str, Any]) -> dict[str, JsonValue]:
    return {"kind": "model_call", "episode": saved_for, "call": call}


def _prefix_records(
    cut: Sequence[FrozenPartial | CallPrefix], attempts: Mapping[str, int], engine: str
) -> list[dict[str, JsonValue]]:
    """The saved prefixes (in the writer's thread: slicing and packing the token lists)."""
    records: list[dict[str, JsonValue]] = []
    for item in cut:
        prefix = item if isinstance(item, CallPrefix) else item.prefix(engine)
        if prefix is None:
            continue
        saved_for: dict[str, JsonValue] = {
            "rollout_id": prefix.rollout_id,
            "attempt": attempts[prefix.rollout_id],
        }
        records.append(
            {"kind": "model_prefix", "episode": saved_for, "prefix": prefix.model_dump(mode="json")}
        )
    return records


def _parse(records: list[Any]) -> list[ModelCallRecord | ModelPrefixRecord]:
    try:
        return _RECORDS.validate_python(records)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidCheckpointStateError(f"model call record {where}: {first['msg']}") from None


def _outcome(rollout_id: str, attempt: int, kind: RetireOutcomeKind) -> RetireOutcome:
    return RetireOutcome(episode=EpisodeId(rollout_id=rollout_id, attempt=attempt), outcome=kind)
