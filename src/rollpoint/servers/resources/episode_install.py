"""Saved episodes made live again: the checks and the rebuilding an install does before it
touches live state.

Owns, for :meth:`~rollpoint.servers.resources.episode_service.ResourcesService.install`,
each record checked against this server's environment (:func:`validate_record`: its fields,
its environment and its task's, the episode it is saved for, no idempotency key twice) and
each episode built from its record (:func:`build_episodes`: the state restored from its
export, or started again from its task when it was saved as one; an external episode
reattached to its outside state, with the calls journaled after its snapshot, or left out
to be restarted). A record that cannot be rebuilt raises
:class:`~rollpoint.protocol.errors.InvalidCheckpointStateError` with every state built so far
closed, so an install changes nothing unless all of it can be made.

Does not own: the live episodes and replacing them (the service,
:mod:`~rollpoint.servers.resources.episode_service`), the record's format
(:mod:`~rollpoint.servers.resources.episode_record`), whether an outside state is still
there (:mod:`~rollpoint.servers.resources.external_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from rollpoint.envs.base import Environment
from rollpoint.envs.registry import environment_matches
from rollpoint.protocol.errors import InvalidCheckpointStateError, RollpointError
from rollpoint.servers.resources.episode_record import EpisodeRecord
from rollpoint.servers.resources.external_state import is_external, reattach
from rollpoint.servers.resources.live_episode import LiveEpisode
from rollpoint.servers.resources.tool_journal import ToolJournal
from rollpoint.tuning.seam import DeferredValue

log = logging.getLogger(__name__)


def validate_record(
    environment: Environment[Any], index: int, record: Mapping[str, Any]
) -> EpisodeRecord:
    """Record ``index`` of an install parsed and checked against this server's environment;
    :class:`InvalidCheckpointStateError` naming it and what is wrong otherwise."""
    packed = record.get("packed_state")
    if isinstance(packed, DeferredValue):
        # Straight from a checkpoint export, not through a file: pack it now.
        try:
            record = {**record, "packed_state": packed.value()}
        except RollpointError as exc:
            raise InvalidCheckpointStateError(f"record {index}: {exc.message}") from None
    try:
        parsed = EpisodeRecord.model_validate(record)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "record"
        raise InvalidCheckpointStateError(f"record {index}: field '{loc}': {err['msg']}") from None
    name = environment.name
    if not (
        environment_matches(parsed.environment, environment)
        and environment_matches(parsed.task.environment, environment)
    ):
        raise InvalidCheckpointStateError(
            f"record {index} (rollout {parsed.rollout_id}) is for {parsed.environment!r};"
            f" this server runs {name!r}"
        )
    if parsed.episode is not None and parsed.episode.rollout_id != parsed.rollout_id:
        raise InvalidCheckpointStateError(
            f"record {index} (rollout {parsed.rollout_id}) is saved for {parsed.episode.key}"
        )
    keys = {(t.turn, t.call_index) for t in parsed.tool_results}
    if len(keys) != len(parsed.tool_results):
        raise InvalidCheckpointStateError(
            f"record {index} (rollout {parsed.rollout_id}) repeats an idempotency key"
        )
    return parsed


def build_episodes(
    environment: Environment[Any],
    tool_journal: ToolJournal | None,
    records: Sequence[EpisodeRecord],
) -> dict[str, LiveEpisode]:
    """The episodes of checked records by rollout id, their states rebuilt; an external
    episode whose state did not survive is left out. A record that cannot be rebuilt raises
    :class:`InvalidCheckpointStateError`, every state built so far closed."""
    built: dict[str, LiveEpisode] = {}
    try:
        for index, record in enumerate(records):
            if is_external(environment) and not record.fresh_start:
                try:
                    external = _reattach(environment, tool_journal, record)
                except RollpointError as exc:
                    # The environment could not tell: never continue on a guess.
                    log.warning("rollout %s restarts: %s", record.rollout_id, exc.message)
                    external = None
                if external is not None:
                    built[record.rollout_id] = external
                continue
            try:
                if record.fresh_start:
                    state = environment.start(record.task)
                else:
                    exported = record.exported_state()
                    state = environment.restore_state(record.task, exported)
            except RollpointError as exc:
                raise InvalidCheckpointStateError(
                    f"record {index} (rollout {record.rollout_id}): {exc.message}"
                ) from None
            results = {(t.turn, t.call_index): t.result for t in record.tool_results}
            fingerprints = {
                (t.turn, t.call_index): t.fingerprint
                for t in record.tool_results
                if t.fingerprint is not None
            }
            built[record.rollout_id] = LiveEpisode(
                record.task, state, results, fingerprints, touched=not record.fresh_start
            )
    except BaseException:
        for episode in built.values():
            environment.close(episode.state)
        raise
    return built


def _reattach(
    environment: Environment[Any], tool_journal: ToolJournal | None, record: EpisodeRecord
) -> LiveEpisode | None:
    """An external episode continued on its live state or a snapshot of it; None: lost."""
    saved = {(t.turn, t.call_index) for t in record.tool_results}
    journaled = (
        []
        if tool_journal is None
        else [j for j in tool_journal.journaled(record.rollout_id) if j.key not in saved]
    )
    found = reattach(
        environment, record.task, record.rollout_id, record.exported_state(), journaled
    )
    if found is None:
        return None
    episode = LiveEpisode(
        record.task,
        found.state,
        {(t.turn, t.call_index): t.result for t in record.tool_results},
        {(t.turn, t.call_index): t.fingerprint for t in record.tool_results if t.fingerprint},
        touched=True,
    )
    episode.attached = found.pending if found.pending else None
    return episode
