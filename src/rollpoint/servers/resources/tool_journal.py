"""The resources server's tool journal: every applied tool call, durable before its result leaves.

Owns: the resources server's :class:`~rollpoint.store.journal.Journal` (a folder in the
snapshot store, ``<store>/journal/resources/<name>-<replica>/``), what one ``tool_call``
record holds (the tool, its raw arguments, their fingerprint, the result), answering a
re-issued call from it, and bringing the episode's in-memory state to after that call by
replaying it; and :func:`replaying`, which a tool with effects outside its state checks
(with :func:`recorded_result`, the journaled result it may answer with).

One tool call, under the journal::

    known to the idempotency table? ─ yes ─▶ the table's result (as without a journal)
            │ no
    journaled under (rollout, turn, call index) with the same fingerprint, episode not diverged?
            │ yes                                               │ no
    replay the tool on the episode's state (replaying() True)   run it (the service), then
    same result as recorded? ─ yes ─▶ the recorded result       append it (durable) ─▶ result
            │ no
    warn (environment, tool, episode); the episode continues from the snapshot

Keys: the resources server's idempotency key has no attempt (``(rollout, turn, call
index)``), and a restored episode re-issues its tool calls under the same key (the agent
applies a saved pending response "under the same idempotency keys"), so the journal is
looked up by that key whatever the attempt; the record's journal key names the attempt that
applied it (``tool|r|a<a>|t<t>|c<i>``).

Replay runs the tool again on the state the snapshot (or the episode's start) gave it, so
the state is what it was after the call. A tool whose call also changes something outside
the episode's state (an external log, a payment, an e-mail) must skip that part when
:func:`replaying` is True: the effect happened when the call was journaled. An environment
that ignores it repeats the effect on every replay.

"Continues from the snapshot": when a replay's result differs from the recorded one (the
environment is not deterministic), the episode's state is put back to what it was before
its first replay (the snapshot's state, or the start state when no snapshot held the
episode), that call and every later one of the episode run live on it (and are journaled
again under the new attempt), and no other journaled call of the episode is used. Results
already answered from the journal stay as they were answered: the agent has them; the state
no longer reflects them, exactly as a restore without a journal would leave it.

Does not own: the segment format, group commit or retention (:mod:`rollpoint.store.journal`),
the idempotency table, the gate or the environment (the service).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollpoint.protocol.episode import ToolCall, ToolResult
from rollpoint.protocol.errors import AttemptCancelledError, ConfigError, EpisodeError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.protocol.manifest import JournalMark
from rollpoint.servers.resources.effect_records import EffectRecords, effects_folder
from rollpoint.servers.resources.episode_record import call_fingerprint
from rollpoint.servers.resources.external_state import (
    Journaled,
    is_external,
    next_journaled,
)
from rollpoint.store.journal import Journal, Position
from rollpoint.store.journal_format import journal_key
from rollpoint.store.journal_shipping import (
    Shipping,
    journal_relative,
    journal_url,
    open_store_journal,
)

if TYPE_CHECKING:
    from rollpoint.servers.resources.episode_service import ResourcesService

log = logging.getLogger(__name__)

KIND = "tool_call"
_REPLAYING: ContextVar[tuple[ToolResult | None] | None] = ContextVar(
    "rollpoint_tool_replaying", default=None
)
"""Set while a tool runs as a replay: the recorded result of the call (None when a check
replays calls without one: :func:`replaying_calls`)."""


def replaying() -> bool:
    """True while a tool runs again to rebuild an episode's state from the journal: skip
    effects outside the state (they happened when the call was first applied)."""
    return _REPLAYING.get() is not None


def recorded_result() -> ToolResult | None:
    """While :func:`replaying`, the result the journal holds for the call being replayed
    (else None): a tool whose whole effect is outside the episode's state (an MCP server's
    tool, :mod:`rollpoint.envs.mcp_env`) answers with it instead of calling out again."""
    found = _REPLAYING.get()
    return None if found is None else found[0]


@contextmanager
def replaying_calls() -> Iterator[None]:
    """Run tools inside as a replay from the journal does (:func:`replaying` is True):
    for ``rollpoint conformance --environment``, which checks that a replay gives the
    recorded results."""
    with _replay_mode(None):
        yield


@contextmanager
def _replay_mode(recorded: ToolResult | None) -> Iterator[None]:
    token = _REPLAYING.set((recorded,))
    try:
        yield
    finally:
        _REPLAYING.reset(token)


@dataclass(slots=True)
class ToolJournalCounts:
    journaled: int = 0
    """Tool calls appended since this server started."""
    replayed: int = 0
    """Journaled calls answered with their recorded result, the state rebuilt by replay."""
    diverged: int = 0
    """Episodes whose replay gave another result: continued from the snapshot."""
    recovered: int = 0
    """Tool calls found in the journal when it was opened."""


class ToolJournal:
    """The journal of one resources server; open with :meth:`open`."""

    def __init__(self, journal: Journal, service: ResourcesService) -> None:
        self.journal = journal
        self.shipping: Shipping | None = None
        """Shipping the journal to an fsspec store from this machine's spool (None: the
        store is a local folder, the journal is in it): :mod:`rollpoint.store.journal_shipping`."""
        self._service = service
        self.counts = ToolJournalCounts()
        self._keys: dict[tuple[str, int, int], str] = {}
        """(rollout, turn, call index) -> journal key of the last record of that call."""
        self._calls: dict[str, set[tuple[int, int]]] = {}
        """rollout -> its journaled (turn, call index): what :meth:`catch_up` replays."""
        self._base: dict[str, dict[str, Any]] = {}
        """An episode's exported state before its first replay (what a divergence returns to)."""
        self._diverged: set[str] = set()
        for rec in journal.records_after():
            if rec.kind == KIND:
                self._index(rec.key)
                self.counts.recovered += 1

    @classmethod
    async def open(cls, folder: str, service: ResourcesService, *, window_s: float) -> ToolJournal:
        journal = await asyncio.to_thread(Journal.open, folder, window_s=window_s)
        return await asyncio.to_thread(cls, journal, service)

    @property
    def position(self) -> Position:
        return self.journal.position

    def mark(self) -> JournalMark:
        """Where the journal stands as a cut opens (the commit saves it), after forgetting
        the calls in segments retention deleted (the index keeps what the kept snapshots'
        positions still need)."""
        if self.journal.forget_removed():
            self._keys = {call: key for call, key in self._keys.items() if key in self.journal}
            self._calls = {}
            for rollout_id, turn, index in self._keys:
                self._calls.setdefault(rollout_id, set()).add((turn, index))
        position = self.journal.checkpoint()
        relative = journal_relative("resources", self._service.name, self._service.replica)
        return JournalMark(folder=relative, segment=position.segment, offset=position.offset)

    def _index(self, key: str) -> None:
        # tool|<rollout>|a<attempt>|t<turn>|c<call>: journal_key refuses parts with '|'.
        _, rollout_id, _, turn, call = key.split("|")
        self._keys[(rollout_id, int(turn[1:]), int(call[1:]))] = key
        self._calls.setdefault(rollout_id, set()).add((int(turn[1:]), int(call[1:])))

    def forget_calls(self, rollout_id: str) -> None:
        """Use none of the rollout's journaled calls from now on: they run live (an external
        episode that starts fresh under a rollout id whose outside state is gone)."""
        self._diverged.add(rollout_id)

    def journaled(self, rollout_id: str) -> list[Journaled]:
        """Every journaled call of a rollout, in call order."""
        out = []
        for turn, call in sorted(self._calls.get(rollout_id, ())):
            rec = self.journal.lookup(self._keys[(rollout_id, turn, call)])
            if rec is None:
                continue
            value = rec.value()
            out.append(
                Journaled((turn, call), value["fingerprint"], value["result"], value.get("version"))
            )
        return out

    def _journaled(self, call: ToolCall) -> dict[str, Any] | None:
        key = self._keys.get((call.episode.rollout_id, call.turn, call.call_index))
        rec = None if key is None else self.journal.lookup(key)
        return None if rec is None else dict(rec.value())

    async def call_tool(self, tool_name: str, call: ToolCall) -> ToolResult:
        """One ``POST /tools/{name}``: answered from the journal when it holds the call,
        else applied by the service and journaled before the result is returned."""
        service = self._service
        rollout_id = call.episode.rollout_id
        held = service._episodes.get(rollout_id)
        if held is not None and held.attached:
            answered = await self._answer_attached(tool_name, call)
            if answered is not None:
                return answered
        found = None if rollout_id in self._diverged else self._journaled(call)
        if found is not None and found["fingerprint"] == call_fingerprint(
            tool_name, call.arguments
        ):
            answered = await self._replay(tool_name, call, found)
            if answered is not None:
                return answered
        result = await service.call_tool(tool_name, call)
        self._base.pop(rollout_id, None)  # past its journaled calls: no replay to undo
        if not result.replayed:  # applied now, not answered from the idempotency table
            key = journal_key("tool", rollout_id, call.episode.attempt, call.turn, call.call_index)
            value: dict[str, Any] = {
                "tool": tool_name,
                "arguments": call.arguments,
                "fingerprint": call_fingerprint(tool_name, call.arguments),
                "result": result.model_dump(mode="json"),
            }
            episode = service._episodes.get(rollout_id)
            version = (
                None
                if episode is None
                else episode.versions.pop((call.turn, call.call_index), None)
            )
            if version is not None:
                value["version"] = version  # what a restore checks the reattached state against
            await self.journal.append_json(key, KIND, value)
            self._index(key)
            self.counts.journaled += 1
        return result

    async def catch_up(self, episode: EpisodeId) -> int:
        """Bring a starting episode's state to after every journaled call of its rollout
        that its idempotency table does not hold (an earlier process applied them), in
        order, each replayed as :meth:`call_tool` would: the agent resumes the episode at
        its last journaled turn (:mod:`rollpoint.servers.agent.turn_journal`) and makes
        those calls no more. Returns how many were replayed. A replay that gives another
        result than journaled puts the state back (as in :meth:`call_tool`) and refuses
        the start (:class:`AttemptCancelledError`): the agent's journaled turns no longer
        match the state, so the row starts over, never continued on mismatched state."""
        rollout_id = episode.rollout_id
        if rollout_id in self._diverged:
            return 0
        replayed = 0
        external = is_external(self._service.environment)
        for turn, index in sorted(self._calls.get(rollout_id, ())):
            found = self._journaled(
                ToolCall(episode=episode, turn=turn, call_index=index, arguments="{}")
            )
            if found is None:
                continue
            call = ToolCall(
                episode=episode, turn=turn, call_index=index, arguments=found["arguments"]
            )
            if external:
                # An outside state is never replayed on (its commands ran there once): the
                # install attached the episode to a state that holds these calls, and they
                # are answered; a state that does not hold them cannot continue the turns.
                held = self._service._episodes.get(rollout_id)
                if (
                    held is not None
                    and held.attached
                    and await self._answer_attached(found["tool"], call) is not None
                ):
                    replayed += 1
                    continue
                if held is None or (turn, index) not in held.results:
                    raise AttemptCancelledError(
                        f"episode {episode.key}: the outside state of "
                        f"{self._service.environment.name} does not hold its journaled tool "
                        f"call at turn {turn} (call {index}); it starts over"
                    )
                continue
            answered = await self._replay(found["tool"], call, found)
            if answered is not None:
                replayed += 1
            elif rollout_id in self._diverged:
                raise AttemptCancelledError(
                    f"episode {episode.key}: replaying its journaled tool calls on "
                    f"{self._service.environment.name} gave another result; it starts over"
                )
        return replayed

    async def _answer_attached(self, tool_name: str, call: ToolCall) -> ToolResult | None:
        """An attached external episode asks a call its state already holds: the recorded
        result, nothing run; None when the idempotency table answers it."""
        service = self._service
        rollout_id = call.episode.rollout_id
        service._guard(call.episode)
        async with service.gate.admit():
            service._guard(call.episode)
            episode = service._episode(rollout_id)
            key = (call.turn, call.call_index)
            if key in episode.results or not episode.attached:
                return None
            fingerprint = call_fingerprint(tool_name, call.arguments)
            found = next_journaled(
                service.environment.name, call.episode.key, episode.attached, key, fingerprint
            )
            recorded = ToolResult.model_validate(found.result)
            episode.changing()
            service._image.changed(rollout_id)
            episode.results[key] = recorded
            episode.fingerprints[key] = fingerprint
            self.counts.replayed += 1
            return recorded.model_copy(update={"replayed": True})

    async def _replay(
        self, tool_name: str, call: ToolCall, found: dict[str, Any]
    ) -> ToolResult | None:
        """The recorded result, the episode's state brought to after the call by replaying
        it; None when the call is to run live (already in the table, or the replay diverged)."""
        service = self._service
        env = service.environment
        rollout_id = call.episode.rollout_id
        service._guard(call.episode)
        async with service.gate.admit():
            # Again: the attempt may have been retired while the call waited at the gate.
            service._guard(call.episode)
            episode = service._episode(rollout_id)
            key = (call.turn, call.call_index)
            if key in episode.results:
                return None  # the idempotency table answers it
            if rollout_id not in self._base and not is_external(env):
                self._base[rollout_id] = env.export_state(episode.state)
            episode.changing()
            service._image.changed(rollout_id)
            recorded = ToolResult.model_validate(found["result"])
            with _replay_mode(recorded):
                replayed = await service._run(episode, tool_name, call)
            if (replayed.content, replayed.is_error) != (recorded.content, recorded.is_error):
                self._diverge(tool_name, call)
                return None
            episode.results[key] = recorded
            episode.fingerprints[key] = found["fingerprint"]
            self.counts.replayed += 1
            return recorded.model_copy(update={"replayed": True})

    def _diverge(self, tool_name: str, call: ToolCall) -> None:
        service = self._service
        env = service.environment
        rollout_id = call.episode.rollout_id
        episode = service._episode(rollout_id)
        if is_external(env):
            # The state made from the snapshot went another way than journaled: there is no
            # export to go back to, and it must not be continued on.
            raise EpisodeError(
                f"environment {env.name!r}: replaying tool {tool_name!r} of episode"
                f" {call.episode.key} (turn {call.turn}, call {call.call_index}) on its"
                " restored snapshot gave another result than journaled; it cannot continue"
            )
        log.warning(
            "environment %s: replaying tool %s of episode %s (turn %d, call %d) gave another "
            "result than journaled; the episode continues from the snapshot",
            env.name,
            tool_name,
            call.episode.key,
            call.turn,
            call.call_index,
        )
        env.close(episode.state)
        episode.state = env.restore_state(episode.task, self._base.pop(rollout_id))
        self._diverged.add(rollout_id)
        self.counts.diverged += 1

    async def close(self) -> None:
        if self.shipping is not None:
            await self.shipping.aclose()  # what is left shipped, while the journal is open
        await self.journal.close()


def _local_folder(service: ResourcesService, snapshot_root: str | None, why: str) -> str:
    root = snapshot_root
    if root is None or "://" in root:
        raise ConfigError(
            f"resources server {service.name}/{service.replica}: {why} needs a local "
            f"snapshot store path, got {root!r} (fsspec stores are not journaled yet)"
        )
    return journal_url(root, journal_relative("resources", service.name, service.replica))


def check_effect_store(service: ResourcesService, snapshot_root: str | None) -> EffectRecords:
    """Where the server records its environment's effects
    (:mod:`~rollpoint.servers.resources.effect_records`); ConfigError naming the server and
    the environment when the store cannot hold them (not a local path)."""
    root = snapshot_root
    name = service.environment.name
    if root is None or "://" in root:
        raise ConfigError(
            f"resources server {service.name}/{service.replica}: environment {name!r} declares"
            f" effects: it needs a local snapshot store path, got {root!r} (effects are"
            " recorded there, shared by every replica)"
        )
    return EffectRecords(effects_folder(root))


async def open_tool_journal(
    service: ResourcesService, snapshot_root: str | None, *, window_s: float
) -> ToolJournal:
    if snapshot_root is None:
        raise ConfigError(
            f"resources server {service.name}/{service.replica}: journal needs a snapshot store"
        )
    relative = journal_relative("resources", service.name, service.replica)
    folder = journal_url(snapshot_root, relative)
    journal, shipping = await open_store_journal(snapshot_root, relative, window_s=window_s)
    opened = await asyncio.to_thread(ToolJournal, journal, service)
    opened.shipping = shipping
    log.info(
        "resources server %s/%s: tool journal %s holds %d calls",
        service.name,
        service.replica,
        folder,
        opened.counts.recovered,
    )
    return opened
