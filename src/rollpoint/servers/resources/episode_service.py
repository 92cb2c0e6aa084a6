"""The resources server's episodes apart from HTTP: tools with per-episode environment state,
and their idempotency.

Owns :class:`ResourcesService`: the episodes of one replica (by rollout id: the environment
state, the task and the idempotency table ``(rollout_id, turn, call_index) → ToolResult``
with the fingerprint of the call that made it), its freeze (the SDK's
:class:`~rollpoint.participant.AdmissionGate`, which every state-changing call passes), the
start, tool calls, verify and release run on them, and their counts for ``/metrics``. The
environment itself (tools, verifier, state export) is :mod:`rollpoint.envs`; the HTTP
routes are :mod:`~rollpoint.servers.resources.resources_server`; the checkpoint control
routes drive the service through
:class:`~rollpoint.servers.resources.resources_participant.ResourcesParticipant`
(``freeze``/``thaw``, ``export_episodes``, ``install``, ``release``).

Tool calls run through the environment's :class:`~rollpoint.envs.tool_call.ToolRunner`
(made once, when the environment is loaded: it refuses a tool whose signature fits no
convention). One call per episode runs at a time: a call re-sent while
its first try still runs waits for it and replays its result. A plain tool runs on the
event loop, so for it nothing else runs between the idempotency lookup and storing the
result. A tool that leaves the loop (``async def``, or a slow one in a worker thread) lets
other episodes' calls and the control verbs run meanwhile; its episode's saved form stays
the one from before the call until the call's result is stored (a checkpoint waits for
calls in flight anyway, so it sees the call whole or not at all). While frozen, the
routes that change state (start, tools, release) wait at the gate instead of failing
(counted as ``waiting``, then as ``in_flight`` until they return);
verify only reads and is never held. Start, tools and verify of a retired attempt (the
fence's retire marks) are refused with 409 ``stale_attempt`` and apply nothing; the next
attempt of the same rollout is not retired and finds its state and recorded results.

Each tool call gets the call's effects (:class:`~rollpoint.envs.effects.CallEffects`) over
the server's effect store: the store's ``effects/`` folder when the environment declares
effects and the snapshot store is a local path (refused at creation otherwise), in memory
without a snapshot store (:mod:`~rollpoint.servers.resources.effect_records`). An
``external`` environment's episodes save the version of their outside state instead of an
export, and install reattaches to it or leaves the episode out to be restarted
(:mod:`~rollpoint.servers.resources.external_state`).

Each episode's saved form is kept current in a :class:`~rollpoint.participant.state_image.StateImage`
once checkpoints are in use: after a tool call changes an episode, the image's sweep takes
the environment's export (``Environment.capture_state``) between checkpoints, so a
checkpoint's pause copies the image and takes only the exports of episodes changed since
the last sweep. Packing an export (JSON, zlib, base64) is left to the snapshot's writer
thread, so the export must be a copy that later tool calls do not change. The saved form
itself is :class:`~rollpoint.servers.resources.episode_record.EpisodeRecord`; an episode as
the service holds it, and the forms taken of it, are
:class:`~rollpoint.servers.resources.live_episode.LiveEpisode`; the checks and rebuilding of
an install are :mod:`~rollpoint.servers.resources.episode_install`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import orjson

from rollpoint.envs.base import Environment, ToolArgumentError
from rollpoint.envs.effects import CallEffects, EffectCounts, EffectStore, MemoryEffects
from rollpoint.envs.registry import environment_matches
from rollpoint.envs.tool_call import ToolRunner, tool_context
from rollpoint.http.server_metrics import Reading
from rollpoint.participant import (
    AdmissionGate,
    RecordMemo,
    StateImage,
)
from rollpoint.protocol.episode import (
    EpisodeStart,
    ToolCall,
    ToolResult,
    VerifyReply,
    VerifyRequest,
)
from rollpoint.protocol.errors import (
    AttemptCancelledError,
    BadRequestError,
    IdempotencyConflictError,
    InvalidCheckpointStateError,
    NotFoundError,
    ProtocolError,
    RollpointError,
)
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.environment_calls import environment_call
from rollpoint.servers.resources.episode_install import build_episodes, validate_record
from rollpoint.servers.resources.episode_record import (
    EpisodeRecord,
    call_fingerprint,
    episode_records,
)
from rollpoint.servers.resources.external_state import (
    check_external,
    is_external,
    reattach,
    version_of,
)
from rollpoint.servers.resources.final_state_log import FinalStateLog
from rollpoint.servers.resources.live_episode import LiveEpisode
from rollpoint.servers.resources.tool_journal import ToolJournal, replaying
from rollpoint.tuning.seam import DeferredValue

log = logging.getLogger(__name__)

_MAX_NAMED = 10


def _made(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its packed state made: a copy if it was deferred, since a record
    handed out never changes."""
    packed = record["packed_state"]
    if isinstance(packed, DeferredValue):
        return {**record, "packed_state": packed.value()}
    return record


def _named(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_MAX_NAMED])
    return shown + (f" and {len(ids) - _MAX_NAMED} more" if len(ids) > _MAX_NAMED else "")


def _parse_arguments(raw: str) -> dict[str, Any] | ToolResult:
    # Some engines send "" for a tool without parameters: that means no arguments.
    if not raw.strip():
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return ToolResult(content=f"arguments are not valid JSON: {exc}", is_error=True)
    if not isinstance(value, dict):
        kind = type(value).__name__
        return ToolResult(content=f"arguments must be a JSON object, got {kind}", is_error=True)
    return value


class ResourcesService:
    """The episodes of one resources server, apart from HTTP.

    ``freeze``/``thaw`` and the async methods must be called on the server's event loop;
    ``export``, ``install`` and ``release`` are plain calls for the checkpoint participant.
    """

    def __init__(
        self,
        environment: Environment[Any],
        *,
        name: str = "resources",
        replica: str = "replica-0",
        final_states: FinalStateLog | None = None,
    ) -> None:
        self.environment = environment
        self.final_states = final_states
        """Set: every verified episode's state is appended there before the reply."""
        self.name = name
        self.replica = replica
        self._episodes: dict[str, LiveEpisode] = {}
        check_external(environment)
        self.tools = ToolRunner(environment)
        """Each tool's calling convention, found now: a tool that fits none is refused here."""
        self.gate = AdmissionGate()
        """Start, tool calls and release pass it; a freeze closes it (they wait, none fails)."""
        self.tool_calls = 0
        """Tool calls applied (each idempotency key once)."""
        self.tool_replays = 0
        """Tool calls answered from the idempotency table: a known key, nothing applied."""
        self.conflicts: Counter[str] = Counter()
        """409 refusals of start and tool calls, by error code (:meth:`counting_conflicts`)."""
        self.attempt_guard: Callable[[EpisodeId], None] | None = None
        """Raises :class:`StaleAttemptError` for a retired attempt (the fence's check)."""
        self.effect_store: EffectStore = MemoryEffects()
        """Where ``ctx.effect`` records effects: in memory until the server's journal is
        open (:mod:`~rollpoint.servers.resources.effect_records`)."""
        self.effect_counts = EffectCounts()
        self.tool_journal: ToolJournal | None = None
        """Set when tool calls are journaled: an external episode's install reads the
        calls journaled after its snapshot."""
        self.lost: list[str] = []
        """External episodes the last install could not continue (restarted instead)."""
        self._memo = RecordMemo()
        """An unchanged entry's record is handed out again as the same object: a snapshot's
        writer references it without encoding it (:mod:`rollpoint.participant.record_memo`)."""
        self._image: StateImage[dict[str, Any]] = StateImage(
            self._image_entry, lambda: list(self._episodes), name="episodes"
        )

    # ---- counters and the freeze gate ----------------------------------------------------
    @contextlib.contextmanager
    def counting_conflicts(self) -> Iterator[None]:
        """Count a 409 raised inside by its code (``rollpoint_resources_conflicts_total``).

        The start and tool routes run in it, so every 409 they answer is counted, whichever
        check raised it: retired attempts, and any conflict a later check adds."""
        try:
            yield
        except ProtocolError as exc:
            if exc.status == 409:
                self.conflicts[exc.code] += 1
            raise

    def readings(self) -> list[Reading]:
        """What ``/metrics`` shows, read at each scrape."""
        out = [
            Reading(
                "rollpoint_resources_tool_calls", "Tool calls applied", self.tool_calls, "counter"
            ),
            Reading(
                "rollpoint_resources_tool_replays",
                "Tool calls answered from the idempotency table (nothing applied)",
                self.tool_replays,
                "counter",
            ),
            Reading("rollpoint_resources_episodes", "Live episodes", len(self._episodes)),
            Reading(
                "rollpoint_resources_tool_calls_in_flight",
                "Tool calls running",
                self.gate.in_flight,
            ),
        ]
        counts = self.effect_counts
        for outcome, value in (
            ("made", counts.made),
            ("answered", counts.answered),
            ("reconciled", counts.reconciled),
            ("in_doubt", counts.in_doubt),
        ):
            out.append(
                Reading(
                    "rollpoint_resources_effects",
                    "ctx.effect calls by outcome: made, answered from its record, decided by"
                    " reconcile, failed in doubt",
                    value,
                    "counter",
                    {"outcome": outcome},
                )
            )
        doc = "Episode starts and tool calls refused with 409, by code"
        # One series even before the first refusal, so a dashboard's query names a live metric.
        for code in sorted({"stale_attempt", *self.conflicts}):
            out.append(
                Reading(
                    "rollpoint_resources_conflicts",
                    doc,
                    self.conflicts[code],
                    "counter",
                    {"code": code},
                )
            )
        return out

    @property
    def episode_count(self) -> int:
        return len(self._episodes)

    @property
    def in_flight(self) -> int:
        """State-changing calls past the gate and not finished."""
        return self.gate.in_flight

    @property
    def waiting(self) -> int:
        """Calls held at the gate by a freeze."""
        return self.gate.waiting

    @property
    def frozen(self) -> bool:
        return not self.gate.is_open

    def rollout_ids(self) -> list[str]:
        return list(self._episodes)

    def freeze(self) -> None:
        """Hold every state-changing call at the gate until :meth:`thaw`; idempotent."""
        self.gate.close()

    def thaw(self) -> None:
        """Let held calls through; idempotent."""
        self.gate.open()

    async def wait_changed(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until the in-flight count, the waiting count or the freeze changes; False
        when ``timeout`` passed first. Check the condition you want before calling."""
        return await self.gate.wait_changed(timeout)

    def _guard(self, episode: EpisodeId) -> None:
        if self.attempt_guard is not None:
            self.attempt_guard(episode)

    def _episode(self, rollout_id: str) -> LiveEpisode:
        episode = self._episodes.get(rollout_id)
        if episode is None:
            raise NotFoundError(f"no episode for rollout {rollout_id!r} (start it first)")
        return episode

    # ---- the data plane --------------------------------------------------------------------
    async def start(self, request: EpisodeStart) -> bool:
        """Create the episode's state; False when the rollout already has state."""
        self._guard(request.episode)
        async with self.gate.admit():
            # Again: the attempt may have been retired while the call waited at the gate.
            self._guard(request.episode)
            return self._start(request)

    def check_held(self, request: EpisodeStart) -> None:
        """Refuse a continued episode whose state here lacks a tool call the agent holds the
        result of (:attr:`EpisodeStart.held_calls`): a damaged tool journal lost it, or the
        server restarted empty. Its later turns would be played on a state without that
        call's effect, so the row starts over (:class:`AttemptCancelledError`, retryable),
        never continued."""
        if not request.held_calls:
            return
        episode = self._episode(request.episode.rollout_id)
        missing = sorted(set(request.held_calls) - episode.results.keys())
        if missing:
            shown = ", ".join(f"turn {t} call {i}" for t, i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise AttemptCancelledError(
                f"episode {request.episode.key}: {self.environment.name} does not hold the "
                f"tool calls its agent has results of ({shown}{more}): its state or journal "
                "lost them; it starts over"
            )

    def _start(self, request: EpisodeStart) -> bool:
        task, rollout_id = request.task, request.episode.rollout_id
        if not environment_matches(task.environment, self.environment):
            raise BadRequestError(
                f"task {task.task_id} is for {task.environment!r};"
                f" this server runs {self.environment.name!r}"
            )
        existing = self._episodes.get(rollout_id)
        if existing is not None:
            if existing.task != task:
                raise BadRequestError(
                    f"rollout {rollout_id!r} was started with task {existing.task.task_id},"
                    f" not this version of task {task.task_id}"
                )
            return False
        with environment_call(self.environment, "start", rollout_id):
            state = self.environment.start(task)
        # The task's JSON is made here, once, so a checkpoint does not make it in its pause.
        episode = LiveEpisode(task=task, state=state, task_json=task.model_dump(mode="json"))
        if is_external(self.environment) and self.tool_journal is not None:
            self._attach_started(episode, rollout_id)
        self._episodes[rollout_id] = episode
        self._image.changed(rollout_id)
        return True

    def _attach_started(self, episode: LiveEpisode, rollout_id: str) -> None:
        """An external episode started again from its task under a rollout id that has
        journaled calls (a row sent again after a crash, no snapshot holding its
        episode): continued on its outside state if that is at the last journaled
        version, else started fresh with none of its journaled calls used."""
        assert self.tool_journal is not None
        journaled = self.tool_journal.journaled(rollout_id)
        if not journaled:
            return
        try:
            found = reattach(self.environment, episode.task, rollout_id, {}, journaled)
        except RollpointError as exc:
            log.warning("rollout %s starts fresh: %s", rollout_id, exc.message)
            found = None
        if found is None or not found.pending:
            self.tool_journal.forget_calls(rollout_id)
            return
        self.environment.close(episode.state)
        episode.state, episode.attached, episode.touched = found.state, found.pending, True

    async def call_tool(self, tool_name: str, call: ToolCall) -> ToolResult:
        """Run one tool call once per idempotency key; a known key replays the first result
        if the call is the same, and is :class:`IdempotencyConflictError` if it is not."""
        self._guard(call.episode)
        async with self.gate.admit():
            # Again: the attempt may have been retired while the call waited at the gate.
            self._guard(call.episode)
            episode = self._episode(call.episode.rollout_id)
            # One call per episode at a time: a call re-sent while its first try runs
            # waits here, then finds its result. Woken together, the waiters run one by
            # one, and the first to leave the loop makes the others wait again.
            while episode.busy is not None:
                await episode.busy.wait()
            return await self._apply(episode, tool_name, call)

    async def _apply(self, episode: LiveEpisode, tool_name: str, call: ToolCall) -> ToolResult:
        """A tool call past the gate (counted in flight until it returns), with no other
        call of the episode running."""
        key = (call.turn, call.call_index)
        fingerprint = call_fingerprint(tool_name, call.arguments)
        stored = episode.results.get(key)
        if stored is not None:
            first = episode.fingerprints.get(key)
            if first is not None and first != fingerprint:
                raise IdempotencyConflictError(
                    f"idempotency key (rollout {call.episode.rollout_id!r}, turn {call.turn}, "
                    f"call {call.call_index}) was first used for another call (another tool "
                    f"or other arguments); this call to {tool_name!r} was not run"
                )
            self.tool_replays += 1
            return stored.model_copy(update={"replayed": True})
        self.tool_calls += 1
        rollout_id = call.episode.rollout_id
        on_loop = self.tools.runs_on_loop(tool_name)
        busy = None
        if not on_loop:
            # The call will give up the loop while it changes the state: until its result
            # is stored, the image keeps the entry from before it (never one exported from
            # a state the call is changing in another thread).
            episode.saved_while_busy = self._image_entry(rollout_id)
            episode.busy = busy = asyncio.Event()
        # For a tool on the loop nothing awaits between here and storing the result, so no
        # export sees the new state or result with the old record.
        episode.changing()
        self._image.changed(rollout_id)  # even if the tool raises half-way
        try:
            with environment_call(self.environment, f"tool {tool_name!r}", rollout_id):
                result = await self._run(episode, tool_name, call)
                if is_external(self.environment):
                    # Read while this call still holds the episode: no other call's change in it.
                    episode.versions = {
                        key: version_of(self.environment, episode.state, rollout_id)
                    }
            episode.results[key] = result
            episode.fingerprints[key] = fingerprint
        finally:
            if busy is not None:
                episode.saved_while_busy = episode.busy = None
                busy.set()
                self._image.changed(rollout_id)  # remade from the state after the call
                if episode.dropped:
                    self.environment.close(episode.state)
        return result

    async def _run(self, episode: LiveEpisode, tool_name: str, call: ToolCall) -> ToolResult:
        arguments = _parse_arguments(call.arguments)
        if isinstance(arguments, ToolResult):
            return arguments
        where: dict[str, Any] = {
            "rollout_id": call.episode.rollout_id,
            "attempt": call.episode.attempt,
            "task_id": episode.task.task_id,
            "turn": call.turn,
            "call_index": call.call_index,
        }
        effects = CallEffects(
            self.environment,
            episode.state,
            self.effect_store,
            tool=tool_name,
            loop=asyncio.get_running_loop(),
            counts=self.effect_counts,
            replaying=replaying,
            **where,
        )
        context = partial(tool_context, self.environment.name, tool_name, effects=effects, **where)
        try:
            content = await self.tools.call(episode.state, tool_name, arguments, context)
        except ToolArgumentError as exc:
            return ToolResult(content=exc.message, is_error=True)
        return ToolResult(content=content)

    def verify(self, request: VerifyRequest) -> VerifyReply:
        self._guard(request.episode)
        episode = self._episode(request.episode.rollout_id)
        rollout_id = request.episode.rollout_id
        with environment_call(self.environment, "verify", rollout_id):
            reply = self.environment.verify(episode.state, episode.task, request.final_message)
        if self.final_states is not None:
            with environment_call(self.environment, "export_state", rollout_id):
                final = self.environment.export_state(episode.state)
            self.final_states.append(
                request.episode, episode.task.task_id, self.environment.name, final
            )
        return reply

    async def release_when_thawed(self, rollout_ids: Iterable[str]) -> int:
        async with self.gate.admit():
            return self.release(rollout_ids)

    # ---- checkpoint side -------------------------------------------------------------------
    def release(self, rollout_ids: Iterable[str]) -> int:
        """Drop the state of these rollouts; unknown ids are skipped. Returns how many had state."""
        released = 0
        for rollout_id in rollout_ids:
            episode = self._episodes.pop(rollout_id, None)
            if episode is not None:
                self._close(episode)
                self._image.changed(rollout_id)
                released += 1
        return released

    def _close(self, episode: LiveEpisode) -> None:
        """Close an episode's state now, or when the call running on it ends."""
        if episode.busy is not None:
            episode.dropped = True
        else:
            self.environment.close(episode.state)

    def export(self, rollout_ids: Iterable[str]) -> list[dict[str, Any]]:
        """One :class:`EpisodeRecord` (as JSON data) per rollout; NotFoundError if one is missing.

        Exports the live state: for callers that know no call is running on these
        rollouts (tests, tools); a checkpoint goes through :meth:`capture`."""
        ids = list(dict.fromkeys(rollout_ids))
        missing = [r for r in ids if r not in self._episodes]
        if missing:
            raise NotFoundError(f"no episode to export for rollouts {_named(missing)}")
        return [self._record(r).model_dump(mode="json") for r in ids]

    def export_episodes(self, scope: Iterable[EpisodeId]) -> list[dict[str, Any]]:
        """One record per scoped episode whose rollout has state here, naming the episode,
        its state packed: plain JSON data, for callers that use the records in memory.

        Rollouts without state here add nothing (they were not live on this server).
        """
        return [_made(r) for r in episode_records(self._image.capture_now(), scope)]

    async def capture(self, scope: Iterable[EpisodeId]) -> Callable[[], list[dict[str, Any]]]:
        """A checkpoint's export in two steps: now (in the pause) a copy of the state
        image, taking the exports of the episodes changed since its last sweep; later, in
        the snapshot writer's thread, the scope's records out of the copy. A record's
        ``packed_state`` may be a :class:`DeferredValue` the writer makes;
        :meth:`install` takes such records as they are, any other reader in memory uses
        :meth:`export_episodes` or calls :meth:`DeferredValue.value`."""
        image = await self._image.capture()
        return partial(episode_records, image, scope, self._memo)

    def keep_current(self) -> None:
        """Keep every episode's saved form current from now on (see :class:`StateImage`)."""
        self._image.keep_current()

    async def aclose(self) -> None:
        await self._image.aclose()

    def _image_entry(self, rollout_id: str) -> dict[str, Any] | None:
        """The state image's entry of a rollout (:meth:`LiveEpisode.image_entry`), or None
        without state here."""
        episode = self._episodes.get(rollout_id)
        if episode is None:
            return None
        return episode.image_entry(self.environment, rollout_id)

    def _record(self, rollout_id: str, saved_for: EpisodeId | None = None) -> EpisodeRecord:
        return self._episodes[rollout_id].record(self.environment, rollout_id, saved_for)

    def install(
        self, records: Sequence[Mapping[str, Any]], scope: Iterable[EpisodeId] | None = None
    ) -> list[str]:
        """Install exported episodes, all or nothing; returns their rollout ids.

        Records come back from a snapshot file, or straight from an export in memory (a
        deferred ``packed_state`` is made here). Every record is checked and its state
        rebuilt before live state is touched; any problem raises
        :class:`InvalidCheckpointStateError` and changes nothing. With
        ``scope``, only the records of its rollouts are installed (all are checked). An
        installed episode replaces live state of the same rollout: after a restore the
        snapshot is the truth.
        """
        parsed = [validate_record(self.environment, i, record) for i, record in enumerate(records)]
        if scope is not None:
            wanted = {e.rollout_id for e in scope}
            parsed = [r for r in parsed if r.rollout_id in wanted]
        counts = Counter(r.rollout_id for r in parsed)
        duplicates = sorted(r for r, n in counts.items() if n > 1)
        if duplicates:
            raise InvalidCheckpointStateError(f"records repeat rollouts {_named(duplicates)}")
        built = build_episodes(self.environment, self.tool_journal, parsed)
        self.lost = [r.rollout_id for r in parsed if r.rollout_id not in built]
        if self.lost:
            log.warning(
                "%s/%s: %d external episodes restart (their state did not survive): %s",
                self.name,
                self.replica,
                len(self.lost),
                _named(self.lost),
            )
        for rollout_id, episode in built.items():
            old = self._episodes.get(rollout_id)
            if old is not None:
                self._close(old)
            self._episodes[rollout_id] = episode
            self._image.changed(rollout_id)
        log.info("%s/%s: installed %d episodes", self.name, self.replica, len(built))
        return list(built)
