"""Restore after a crash: the restore order of docs/design.md#the-restore-order.

Owns choosing what to resume from and putting every piece back:

1. the newest published snapshot that composes with a durable step of the trainer's
   record (the finished queue's committed step ≤ checkpoint step ≤ the snapshot's train step); a corrupt, partial or
   tampered snapshot (a file or a sealed field that does not match, or a train step,
   policy version or committed step that disagrees with its ``trainer.json`` / ``tq.json``)
   is skipped, the reason returned for the console, for the previous one
   (:func:`find_resume_point`); what to do when none is usable is the job's;
2. the config keys the saved state depends on must match (a mismatch names the key);
   ``replicas`` may change (:data:`ELASTIC_CONFIG_KEYS`);
3. every saved replica is placed on a live one (:func:`place`): the replica that saved it
   when that one is live with every participant it needs, otherwise another live replica
   that has them, which installs the records of several saved replicas (an elastic
   N → M restore). Checked before anything is installed: a participant no live replica
   serves is named, and so is one whose state would move but is not ``portable``;
4. the saved ledger's in-flight set must equal saved + restarted + finished episodes
   (a mismatch names the episodes and replicas);
5. the saved attempts are stopped and dropped wherever servers that outlived the trainer
   still run them (retire, forget, retire: servers left running by a trainer killed on its
   own), then every participant the manifest names restores, or none does: any failure goes through
   one cleanup path (retire the next attempts, resume each participant exactly once) and a
   clear error. A live participant the manifest does not name (its replica was down at the
   cut) has nothing to install and is left alone;
6. the ledger moves: saved episodes continue as ``attempt + 1`` on the replica holding
   their restored state (pinned there), restarts start over under new rollout ids (and so
   do tries the saved ledger holds queued for a replica: their state died with its
   servers), finished replies held by an agent are fetched again under their own
   identity (adopted, not rerun); the finished queue puts back what no durable train checkpoint consumed;
   the trainer's record of its steps (:class:`~.step_record.StepRecord`) is checked against
   the checkpoint before anything is installed and cut back to it after (rollpoint's own,
   ``train_data.jsonl``, only to a boundary that verifies: its digest, line count and a
   line end, :mod:`..record.train_data`), else refused unchanged.

:meth:`Restorer.restore_replica` does step 5 alone for one replica restarted mid-run
(:mod:`.replica_recovery` decides what to restore and moves the ledger).

It does not run the job: it hands a :class:`RestoredRun` to the trainer loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import JsonValue

from rollpoint.protocol.control import Phase, StatusReply
from rollpoint.protocol.errors import (
    ConfigError,
    InvalidCheckpointStateError,
    RestoreError,
    RollpointError,
    TransportError,
)
from rollpoint.protocol.ids import MAX_ATTEMPT, EpisodeId
from rollpoint.protocol.manifest import SavedEpisode, SnapshotManifest
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.store.job_identity import FINGERPRINT_KEY as JOB_KEY
from rollpoint.store.job_identity import check_snapshot_job
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR, SnapshotStore
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.record.train_checkpoint import TrainCheckpoint
from rollpoint.trainer.snapshot.publication import (
    FINISHED_QUEUE_FILE,
    LEDGER_FILE,
    TRAINER_FILE,
)
from rollpoint.trainer.snapshot.resumer import Resumer
from rollpoint.trainer.state.finished_queue import (
    FinishedQueue,
    finished_queue_document_from_records,
)
from rollpoint.trainer.state.ledger import RecoveryLedger, RolloutState
from rollpoint.trainer.state.ledger_document import document_from_records
from rollpoint.trainer.step_record import StepRecord
from rollpoint.tuning.collector_pause import collector_paused

log = logging.getLogger(__name__)

PARTICIPANTS_SUBDIR = "participants"
_LIST_LIMIT = 10
_LEASE_POLL_S = 0.1
"""How often a restore waiting for a lapsing lease asks the participants again."""
_LEASE_GRACE_WAIT_S = 10.0
"""The longest a restore waits past its own deadline for a lease it saw lapsing then: a
killed restore's lease outlasts a rerun's deadline by up to the participants' grace
(2 s by default; the conformance kit allows up to 10 s). A lease further out is a
checkpoint still running, and the restore fails at its deadline naming the holders."""
_LEASE_MARGIN_S = 1.0
"""Slack past a lease's lapse for the participant's lease task to reopen it."""
RERUN_REACH = 16
"""How many attempts past a saved one a restore stops before installing: those earlier
reruns of the same snapshot may have started on servers that outlived them."""


@dataclass
class ResumePoint:
    """A snapshot and the train checkpoint it composes with."""

    manifest: SnapshotManifest
    checkpoint: TrainCheckpoint
    ledger_doc: dict[str, Any]
    finished_queue_doc: dict[str, Any]
    trainer_doc: dict[str, Any]


@dataclass
class RestoredRun:
    """What the trainer loop starts from after a restore."""

    snapshot_id: str
    checkpoint: TrainCheckpoint
    ledger: RecoveryLedger
    finished_queue: FinishedQueue
    trainer_doc: dict[str, Any] = field(default_factory=dict)
    """The trainer's counters at the cut (for display; training state is the checkpoint's)."""
    continued: list[EpisodeId] = field(default_factory=list)
    restarted: int = 0
    lost_external: list[str] = field(default_factory=list)
    """Saved episodes of an ``external`` environment whose state did not survive: restarted
    (counted in ``restarted`` too)."""
    adopted: int = 0
    resent: int = 0
    """Tries a journal-mode snapshot held in flight, sent again under their own id and
    attempt to their replica, to continue there from its journals."""
    tq_requeued: int = 0
    placement: dict[str, str] = field(default_factory=dict)
    """Saved replica → the live replica its state went to (differs after an elastic restore)."""


@dataclass(frozen=True)
class Skipped:
    """A snapshot the restore could not use, and why (shown on the console)."""

    snapshot_id: str
    reason: str

    def line(self) -> str:
        return f"skipping snapshot {self.snapshot_id}: {self.reason}"


def find_resume_point(
    store: SnapshotStore, step_record: StepRecord
) -> tuple[ResumePoint | None, list[Skipped]]:
    """The newest usable snapshot that composes with a durable step of ``step_record``
    (or None), and every newer snapshot skipped on the way, with the reason."""
    available = step_record.available()
    skipped: list[Skipped] = []
    try:
        summaries = store.list_snapshots(include_invalid=True)
    except OSError as exc:
        raise RestoreError(
            f"cannot read the snapshot store {store.root}: {exc.strerror or exc}; "
            "fix its permissions or mount, then rerun (nothing was changed)"
        ) from None
    for summary in summaries:
        sid = summary.snapshot_id
        if not summary.valid:
            skipped.append(Skipped(sid, summary.reason or "unusable"))
            continue
        try:
            manifest = store.verify(sid)
            ledger_doc = read_trainer_document(store, sid, LEDGER_FILE)
            finished_queue_doc = read_trainer_document(store, sid, FINISHED_QUEUE_FILE)
            trainer_doc = orjson.loads(store.read_file(sid, TRAINER_FILE))
            committed = int(finished_queue_doc.get("committed_step", 0))
            _cross_check(manifest, trainer_doc, committed)
        except (RollpointError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
            detail = exc.message if isinstance(exc, RollpointError) else str(exc)
            skipped.append(Skipped(sid, detail))
            continue
        for checkpoint in available:
            if committed <= checkpoint.step <= manifest.train_step:
                return ResumePoint(
                    manifest, checkpoint, ledger_doc, finished_queue_doc, trainer_doc
                ), skipped
        steps = ", ".join(str(c.step) for c in available)
        skipped.append(
            Skipped(
                sid,
                f"no train checkpoint between its committed step {committed} and its "
                f"train step {manifest.train_step} (checkpoints: {steps})",
            )
        )
    return None, skipped


def read_trainer_document(store: SnapshotStore, snapshot_id: str, name: str) -> dict[str, Any]:
    """The ledger's or the finished queue's document in a snapshot, kept as a document or as records."""
    what = f"{name} of snapshot {snapshot_id}"
    if store.file_format(snapshot_id, name) == "records":
        join = (
            document_from_records if name == LEDGER_FILE else finished_queue_document_from_records
        )
        with collector_paused():  # as for a document: millions of cycle-free records
            records = store.read_records(snapshot_id, name)
        return join(records, what)
    data = store.read_file(snapshot_id, name)
    with collector_paused():  # the ledger decodes into millions of objects
        doc = orjson.loads(data)
    if not isinstance(doc, dict):
        raise InvalidCheckpointStateError(f"{what} is not a JSON object")
    return doc


def choose_resume_point(store: SnapshotStore, step_record: StepRecord) -> ResumePoint | None:
    """:func:`find_resume_point`, the skipped snapshots logged as warnings."""
    point, skipped = find_resume_point(store, step_record)
    for item in skipped:
        log.warning("%s", item.line())
    return point


def _cross_check(manifest: SnapshotManifest, trainer_doc: Any, committed: int) -> None:
    """The fields the restore trusts, against the digest-checked trainer files they were
    copied from: a manifest that disagrees names the field (an unsealed, older manifest
    is caught here too)."""
    if not isinstance(trainer_doc, dict):
        raise InvalidCheckpointStateError(
            f"{TRAINER_FILE} of snapshot {manifest.snapshot_id} is not an object"
        )
    pairs = [
        ("train_step", manifest.train_step, trainer_doc.get("train_step"), TRAINER_FILE),
        (
            "policy_version",
            manifest.policy_version,
            trainer_doc.get("policy_version"),
            TRAINER_FILE,
        ),
    ]
    if manifest.committed_step is not None:
        pairs.append(("committed_step", manifest.committed_step, committed, FINISHED_QUEUE_FILE))
    for name, in_manifest, in_file, file_name in pairs:
        if in_manifest != in_file:
            raise InvalidCheckpointStateError(
                f"manifest field '{name}' is {in_manifest} but {file_name} says {in_file!r} "
                "(tampered or corrupt)"
            )


ELASTIC_CONFIG_KEYS = frozenset({"replicas"})
"""Config keys saved state does not depend on: a restore may change them (N → M replicas)."""


def check_config(manifest: SnapshotManifest, live: dict[str, JsonValue]) -> None:
    """Refuse a config that makes the snapshot unusable, naming the first key that differs."""
    for key, saved in manifest.config_fingerprint.items():
        if key in ELASTIC_CONFIG_KEYS:
            continue
        if key == JOB_KEY:
            # Not a config key: the job that took it (rollpoint.store.job_identity). A
            # trainer run without one (a library embedding) does not check it.
            if live.get(JOB_KEY) is not None:
                check_snapshot_job(
                    manifest.snapshot_id, manifest.config_fingerprint, str(live[JOB_KEY])
                )
            continue
        now = live.get(key)
        if key == "dataset_content_sha256" and now != saved:
            raise ConfigError(
                f"dataset {live.get('dataset')} is not the dataset snapshot "
                f"{manifest.snapshot_id} was taken with (config key 'dataset_content_sha256', its "
                f"files' sha256, is {now}, was {saved}): put the original back, or start over "
                "with --fresh --force"
            )
        if now != saved:
            raise ConfigError(
                f"config key '{key}' is {now!r} but snapshot {manifest.snapshot_id} was taken with {saved!r}; "
                "change it back, or start over with --fresh --force"
            )


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f" and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


_Live = dict[tuple[str, str, str], StatusReply]
"""Live participants' status by (kind, name, replica)."""


@dataclass(frozen=True)
class Placement:
    """Where each saved replica's state is installed: on the replica that saved it when
    that one is live with every participant it needs, otherwise on another live replica
    that has them (the least loaded, ties by name)."""

    target_of: dict[str, str]
    """Saved replica → the live replica that installs its records."""

    def sources(self, target: str) -> list[str]:
        return sorted(s for s, t in self.target_of.items() if t == target)

    @property
    def moved(self) -> dict[str, str]:
        return {s: t for s, t in self.target_of.items() if s != t}


def place(manifest: SnapshotManifest, live: _Live) -> Placement:
    """Place every saved replica on a live one, or refuse naming what no replica serves."""
    needs: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for p in manifest.participants:
        needs[p.replica].add((p.kind.value, p.name))
    offers: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for kind, name, replica in live:
        offers[replica].add((kind, name))
    target_of = {s: s for s in sorted(needs) if needs[s] <= offers.get(s, set())}
    load = Counter(target_of.values())
    anywhere = set().union(*offers.values())
    missing: list[str] = []
    for source in sorted(set(needs) - set(target_of)):
        fits = [r for r in sorted(offers) if needs[source] <= offers[r]]
        if not fits:
            # Name what no replica serves; failing that, what its own replica lacks.
            lacking = needs[source] - anywhere or needs[source] - offers.get(source, set())
            missing += [f"{kind} '{name}' of {source}" for kind, name in sorted(lacking)]
            continue
        target = min(fits, key=lambda r: (load[r], r))
        target_of[source] = target
        load[target] += 1
    if missing:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} needs participants that are not live: {_names(missing)} "
            "(and no live replica serves all of its replica's participants); nothing was installed"
        )
    return Placement(target_of)


def _check_modes(manifest: SnapshotManifest, live: _Live, placement: Placement) -> None:
    """Each participant keeps its checkpoint mode, and state moves only where it may."""
    changed: list[str] = []
    fixed: list[str] = []
    for p in manifest.participants:
        target = placement.target_of[p.replica]
        now = live[(p.kind.value, p.name, target)]
        if now.mode != p.mode:
            changed.append(
                f"{p.kind.value} '{p.name}' of {p.replica} was {p.mode}, is now {now.mode}"
            )
        if target != p.replica and not now.portable:
            fixed.append(f"{p.kind.value} '{p.name}' ({now.mode}) of {p.replica} onto {target}")
    if changed:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id}: participants changed checkpoint mode: {_names(changed)}; "
            "nothing was installed"
        )
    if fixed:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} cannot move state that is not portable: {_names(fixed)}; "
            "run with the replica count it was taken with, or start over with --fresh --force; "
            "nothing was installed"
        )


@dataclass(frozen=True)
class _Target:
    """One participant's part of a restore: whose records it installs, and which episodes."""

    client: ParticipantClient
    sources: list[str]
    scope: list[EpisodeId]


class Restorer:
    def __init__(self, participants: list[ParticipantClient]) -> None:
        self._participants = participants

    async def restore(
        self,
        point: ResumePoint,
        *,
        step_record: StepRecord,
        deadline_s: float = 30.0,
        continue_episodes: bool = True,
    ) -> RestoredRun:
        """``continue_episodes=False`` is ``recovery: restart``: the saved episodes start over
        from their prompts (their sessions are not installed); the rest is the same.
        ``step_record``: the trainer's record of its steps (the one ``point`` was found in):
        checked against the point's checkpoint before anything is installed, cut back to
        it once everything is."""
        manifest = point.manifest
        await asyncio.to_thread(step_record.check, point.checkpoint)
        placement = await self._check_topology(manifest)
        ledger = RecoveryLedger.from_document(
            point.ledger_doc, what=f"ledger of snapshot {manifest.snapshot_id}"
        )
        _check_cut(manifest, ledger)
        finished_queue = FinishedQueue.from_document(
            point.finished_queue_doc, what=f"the finished queue of snapshot {manifest.snapshot_id}"
        )
        saved = manifest.episodes if continue_episodes else []
        lost = await self._install(manifest, self._plan(manifest, placement, saved), deadline_s)
        run = RestoredRun(
            snapshot_id=manifest.snapshot_id,
            checkpoint=point.checkpoint,
            ledger=ledger,
            finished_queue=finished_queue,
            trainer_doc=point.trainer_doc,
            placement=placement.target_of,
        )
        # A queued try pinned to a replica waits for state (a session, a held reply) that
        # lived only in the servers that crashed: it is not in this snapshot, so start over.
        for record in list(ledger.live_records()):
            if record.state is RolloutState.QUEUED and record.replica is not None:
                ledger.abandon(record.rollout_id)
                run.restarted += 1
        for episode in manifest.episodes:
            if not continue_episodes or episode.rollout_id in lost:
                ledger.abandon(episode.rollout_id)
                run.restarted += 1
                if episode.rollout_id in lost:
                    run.lost_external.append(episode.rollout_id)
                continue
            pin = placement.target_of[episode.replica]
            record = ledger.continue_attempt(episode.rollout_id, pin=pin)
            run.continued.append(EpisodeId(rollout_id=record.rollout_id, attempt=record.attempt))
        for restart in manifest.restarts:
            ledger.abandon(restart.rollout_id)
            run.restarted += 1
        for finished in manifest.finished:
            holder = placement.target_of.get(finished.replica, finished.replica)
            ledger.requeue(finished.rollout_id, keep_replica=True, pin=holder)
            run.adopted += 1
        # A journal-mode snapshot saved no episode: its tries in flight go back under their
        # own identity to the replica whose journals hold their turns (docs/design.md
        # "Pause-free snapshots"); a row finished there is only verified again.
        for journaled in manifest.journaled:
            holder = placement.target_of.get(journaled.replica, journaled.replica)
            ledger.requeue(journaled.rollout_id, keep_replica=True, pin=holder)
            run.resent += 1
        run.tq_requeued = finished_queue.rewind(point.checkpoint.step)
        await asyncio.to_thread(step_record.cut_back, point.checkpoint)
        return run

    async def restore_replica(
        self,
        manifest: SnapshotManifest,
        replica: str,
        episodes: list[EpisodeId],
        *,
        deadline_s: float = 30.0,
    ) -> set[str]:
        """Install ``replica``'s saved state (the saved attempts in ``episodes``, plus the
        finished replies its agent held) into its restarted servers, all or nothing.
        Returns the rollouts an ``external`` environment could not continue (to start over).

        The restorer's participants are that replica's; the trainer moves its ledger."""
        live = await self._live()
        placement = Placement({replica: replica})
        saved = [p for p in manifest.participants if p.replica == replica]
        missing = [
            f"{p.kind.value} '{p.name}'"
            for p in saved
            if (p.kind.value, p.name, replica) not in live
        ]
        if missing:
            raise RestoreError(
                f"{replica} restarted without {_names(missing)} of snapshot {manifest.snapshot_id}"
            )
        only = manifest.model_copy(update={"participants": saved})
        _check_modes(only, live, placement)
        wanted = {e.key for e in episodes}
        chosen = [e for e in manifest.episodes if f"{e.rollout_id}#{e.attempt}" in wanted]
        return await self._install(only, self._plan(only, placement, chosen), deadline_s)

    async def _live(self) -> _Live:
        replies = await asyncio.gather(
            *(p.status() for p in self._participants), return_exceptions=True
        )
        return {
            (r.kind.value, r.name, r.replica): r
            for r in replies
            if not isinstance(r, BaseException)
        }

    async def _check_topology(self, manifest: SnapshotManifest) -> Placement:
        live = await self._live()
        placement = place(manifest, live)
        _check_modes(manifest, live, placement)
        for source, target in sorted(placement.moved.items()):
            log.warning(
                "snapshot %s: the state of %s is restored onto %s",
                manifest.snapshot_id,
                source,
                target,
            )
        return placement

    def _plan(
        self, manifest: SnapshotManifest, placement: Placement, saved: list[SavedEpisode]
    ) -> list[_Target]:
        """Who installs what: each participant of a live replica that received saved
        replicas loads their records; its scope is their saved episodes in ``saved``."""
        kinds: dict[str, set[ParticipantKind]] = defaultdict(set)
        for p in manifest.participants:
            kinds[p.replica].add(p.kind)
        plan = []
        for client in self._participants:
            target = client.address.replica
            sources = [s for s in placement.sources(target) if client.address.kind in kinds[s]]
            if not sources:
                continue  # its replica was down at the cut, or is new: nothing to install
            scope = [
                EpisodeId(rollout_id=e.rollout_id, attempt=e.attempt)
                for e in saved
                if e.replica in sources
            ]
            plan.append(_Target(client, sources, scope))
        return plan

    async def _install(
        self, manifest: SnapshotManifest, plan: list[_Target], deadline_s: float
    ) -> set[str]:
        """Restore every planned participant or none: one cleanup path on any failure.
        Returns the rollouts an ``external`` resources server could not continue (their
        state did not survive): the caller restarts them."""
        restore_id = f"restore-{int(time.time() * 1000)}"
        directory = f"{SNAPSHOTS_DIR}/{manifest.snapshot_id}/{PARTICIPANTS_SUBDIR}"
        clients = [t.client for t in plan]
        await self._await_leases(clients, time.time() + deadline_s, manifest.checkpoint_id)
        deadline = time.time() + deadline_s  # a wait for a lease does not shorten the install
        saved = sorted({e for t in plan for e in t.scope}, key=lambda e: e.key)
        if saved:
            await self._clear_for_install(saved, clients)

        def send(t: _Target) -> Awaitable[Any]:
            return t.client.restore(
                restore_id,
                deadline,
                directory,
                t.scope,
                manifest.checkpoint_id,
                # Omitted for its own replica: what every participant has understood.
                None if t.sources == [t.client.address.replica] else t.sources,
            )

        results: list[Any] = await asyncio.gather(*(send(t) for t in plan), return_exceptions=True)
        # A reply lost on the wire is asked for once more before the deadline: a
        # participant answers the same restore again with the reply it gave (the fence
        # remembers it), and a whole rerun would otherwise fail on one dropped reply.
        lost = [i for i, r in enumerate(results) if isinstance(r, TransportError)]
        if lost and time.time() < deadline:
            again = await asyncio.gather(*(send(plan[i]) for i in lost), return_exceptions=True)
            for i, reply in zip(lost, again, strict=True):
                results[i] = reply
        failed = [
            f"{c.label}: {r.message if isinstance(r, RollpointError) else repr(r)}"
            for c, r in zip(clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            await self._clean_up(restore_id, plan)
            raise RestoreError(
                f"restore of snapshot {manifest.snapshot_id} failed, nothing kept: {'; '.join(failed)}"
            )
        gone = _lost_external(manifest, plan, results)
        if gone:
            # Their sessions were installed and wait for attempts that will not come: retire
            # those attempts (best effort: a session left waiting holds memory, nothing else).
            doomed = [e.next_attempt() for t in plan for e in t.scope if e.rollout_id in gone]
            await asyncio.gather(*(c.retire(doomed) for c in clients), return_exceptions=True)
            log.warning(
                "snapshot %s: %d episodes of an external environment restart from their"
                " task (their external state did not survive): %s",
                manifest.snapshot_id,
                len(gone),
                _names(sorted(gone)),
            )
        await Resumer().resume_all(restore_id, clients)
        return gone

    async def _await_leases(
        self, clients: list[ParticipantClient], deadline: float, published: str
    ) -> None:
        """Wait, until ``deadline`` at most, for every participant to be idle.

        A trainer killed in the middle of a snapshot leaves the servers that outlive it (a
        trainer killed on its own, ``rollpoint serve``) in that checkpoint's phase, refusing
        any other checkpoint id, until its lease lapses: the deadline it was given plus the
        grace. Only the lease ends a checkpoint whose coordinator stopped answering: nothing
        tells a participant that coordinator is gone rather than slow, so the restore waits
        for the lease instead of resuming a checkpoint it did not start. Past ``deadline``
        it fails naming the holders; nothing is installed.

        A rerun that starts within the grace of a killed restore sees a lease that lapses
        after its own deadline (that restore's deadline plus the grace), though the holder
        is surely gone: the first lease seen lapsing within ``_LEASE_GRACE_WAIT_S`` of
        ``deadline`` moves the limit to just past that lapse. The limit is set once, so a
        lease someone keeps renewing cannot hold a restore forever.

        A participant held by the cut of ``published`` (the snapshot being restored) is
        resumed at once instead: that snapshot was published, so its trainer was done with
        it, and the workdir lock says that trainer is gone. A graceful stop leaves exactly
        that (its final snapshot holds the participants until it is published, then the
        trainer exits): its rerun waited a whole lease for nothing."""
        warned = False
        limit: float | None = None
        resumed = False
        while True:
            replies = await asyncio.gather(*(c.status() for c in clients), return_exceptions=True)
            held = [
                (c, r)
                for c, r in zip(clients, replies, strict=True)
                if isinstance(r, StatusReply) and r.phase is not Phase.IDLE
            ]
            if not held:
                return
            done_with = [c for c, r in held if r.checkpoint_id == published]
            if done_with and not resumed:
                resumed = True  # once: a resume that fails leaves the lease to reopen it
                log.info(
                    "restore: %s still held by the cut of snapshot %s, which its trainer "
                    "published before it stopped: resumed",
                    _names([c.label for c in done_with]),
                    published,
                )
                await Resumer().resume_all(published, done_with)
                continue
            shown = _names([f"{c.label} ({r.phase.value} for {r.checkpoint_id})" for c, r in held])
            lapses = max(r.lease_expires_at or 0.0 for _, r in held)
            if limit is None:
                reachable = lapses <= deadline + _LEASE_GRACE_WAIT_S
                limit = max(deadline, lapses + _LEASE_MARGIN_S) if reachable else deadline
            left = limit - time.time()
            if left <= 0:
                raise RestoreError(
                    f"restore not started: {shown} still held by a checkpoint of a coordinator "
                    f"that went away (its lease lapses at {lapses:.1f}, in "
                    f"{max(lapses - time.time(), 0.0):.1f}s); nothing was installed"
                )
            if not warned:
                warned = True
                log.warning(
                    "restore waits for %s: a checkpoint of the trainer that stopped; "
                    "its lease lapses in %.1fs",
                    shown,
                    max(lapses - time.time(), 0.0),
                )
            await asyncio.sleep(min(_LEASE_POLL_S, left))

    async def _clear_for_install(
        self, saved: list[EpisodeId], clients: list[ParticipantClient]
    ) -> None:
        """Make room for the saved attempts on servers that may still run them.

        Servers can outlive the trainer that took the snapshot (a trainer killed on its
        own, its servers left running, as with ``rollpoint serve``): they still run its
        attempts of the saved episodes, from past the cut, and the continuations of a rerun
        of the same snapshot killed before it published another. Retire stops them all (an
        agent cancels a live session at or under its mark); forget drops what they left (a
        resources server's state of the rollout, and the marks a failed restore's cleanup
        left on the next attempts, which would refuse the continued ones); a second retire
        marks the saved attempts again, so a call of theirs still on the wire is refused.
        The continued attempts are above those marks. On fresh servers all three find
        nothing to stop or drop."""
        rollout_ids = sorted({e.rollout_id for e in saved})
        # And every attempt an earlier rerun may have started from this same snapshot: a
        # rerun killed before it published a newer one left its continuations (the saved
        # attempts + 1, or further along a chain of reruns) running on these servers, and
        # this restore continues them under those numbers again (chaos trial 412: "rollout
        # ... is running here as ...#1"; or two sessions of one attempt, and its effects
        # lost). The high marks go with the forget that follows.
        reach = [
            EpisodeId(rollout_id=e.rollout_id, attempt=min(e.attempt + RERUN_REACH, MAX_ATTEMPT))
            for e in saved
        ]

        async def each(call: Callable[[ParticipantClient], Awaitable[object]]) -> None:
            await asyncio.gather(*(call(p) for p in clients), return_exceptions=True)

        await each(lambda p: p.retire(reach))
        await each(lambda p: p.forget(rollout_ids))
        await each(lambda p: p.retire(saved))

    async def _clean_up(self, restore_id: str, plan: list[_Target]) -> None:
        """The one cleanup path: the next attempts can never run, then each participant
        is resumed exactly once."""
        next_attempts = sorted(
            {e.next_attempt() for t in plan for e in t.scope}, key=lambda e: e.key
        )
        if next_attempts:
            await asyncio.gather(
                *(p.retire(next_attempts) for p in self._participants), return_exceptions=True
            )
        # The saves' one resume path: callees last, one retry each, a lease for the rest.
        await Resumer().resume_all(restore_id, [t.client for t in plan])


def _check_cut(manifest: SnapshotManifest, ledger: RecoveryLedger) -> None:
    """The saved ledger's in-flight tries must be exactly the snapshot's saved, restarted,
    finished and journaled episodes, each on the same replica."""
    in_ledger = {f"{r.rollout_id}#{r.attempt}": r.replica for r in ledger.in_flight()}
    listed: dict[str, str] = {}
    for group in (manifest.episodes, manifest.restarts, manifest.finished, manifest.journaled):
        for e in group:
            listed[f"{e.rollout_id}#{e.attempt}"] = e.replica
    only_ledger = sorted(f"{k} on {v}" for k, v in in_ledger.items() if k not in listed)
    only_manifest = sorted(f"{k} on {v}" for k, v in listed.items() if k not in in_ledger)
    moved = sorted(
        f"{k} (ledger {in_ledger[k]}, manifest {v})"
        for k, v in listed.items()
        if k in in_ledger and in_ledger[k] != v
    )
    problems = []
    if only_ledger:
        problems.append(f"in flight in the ledger but not saved: {_names(only_ledger)}")
    if only_manifest:
        problems.append(f"saved but not in flight in the ledger: {_names(only_manifest)}")
    if moved:
        problems.append(f"on another replica: {_names(moved)}")
    if problems:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} does not match its ledger: {'; '.join(problems)}"
        )


def _lost_external(manifest: SnapshotManifest, plan: list[_Target], results: list[Any]) -> set[str]:
    """Scoped rollouts an ``external`` resources participant did not restore (its reply's
    ``restored`` lists the next attempts it made ready)."""
    external = {
        p.replica
        for p in manifest.participants
        if p.kind is ParticipantKind.RESOURCES and p.mode is CheckpointMode.EXTERNAL
    }
    lost: set[str] = set()
    for target, reply in zip(plan, results, strict=True):
        if target.client.address.kind is not ParticipantKind.RESOURCES:
            continue
        if not external.intersection(target.sources):
            continue
        restored = {e.rollout_id for e in reply.restored}
        lost |= {e.rollout_id for e in target.scope if e.rollout_id not in restored}
    return lost
