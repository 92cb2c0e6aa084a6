"""The install: every participant restores a snapshot's records, or none does
(docs/design.md#the-restore-order, steps 3 and 4).

Owns, for :class:`~rollpoint.trainer.restore.restorer.Restorer`, the part of a restore
that talks to the participants (:class:`Installer`):

- who installs what: each participant of a live replica that received saved replicas
  (:class:`~rollpoint.trainer.restore.restore_checks.Placement`) loads their records; a
  live participant the manifest does not name (its replica was down at the cut) has
  nothing to install and is left alone;
- waiting for a lease a killed trainer's checkpoint left on servers that outlived it;
- stopping and dropping the saved attempts wherever those servers still run them
  (retire, forget, retire), and the attempts an earlier rerun of the same snapshot may
  have started (:data:`RERUN_REACH`);
- the restore itself, all or none: any failure goes through one cleanup path (retire the
  next attempts, resume each participant exactly once) and a clear error;
- the episodes of an ``external`` environment whose state did not survive, handed back
  to be restarted.

Does not own: the checks made before (:mod:`~rollpoint.trainer.restore.restore_checks`)
nor the ledger's moves after (the restorer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollpoint.protocol.control import Phase, StatusReply
from rollpoint.protocol.errors import RestoreError, RollpointError, TransportError
from rollpoint.protocol.ids import MAX_ATTEMPT, EpisodeId
from rollpoint.protocol.manifest import SavedEpisode, SnapshotManifest
from rollpoint.protocol.participant import CheckpointMode, ParticipantKind
from rollpoint.store.snapshot_store import SNAPSHOTS_DIR
from rollpoint.trainer.control.participant_client import ParticipantClient
from rollpoint.trainer.restore.restore_checks import Placement, list_names
from rollpoint.trainer.snapshot.resumer import Resumer

log = logging.getLogger(__name__)

PARTICIPANTS_SUBDIR = "participants"
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


@dataclass(frozen=True)
class _Target:
    """One participant's part of a restore: whose records it installs, and which episodes."""

    client: ParticipantClient
    sources: list[str]
    scope: list[EpisodeId]


class Installer:
    """Installs a snapshot's records into ``participants`` (every live one a restore
    reaches): :meth:`install`."""

    def __init__(self, participants: list[ParticipantClient]) -> None:
        self._participants = participants

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

    async def install(
        self,
        manifest: SnapshotManifest,
        placement: Placement,
        episodes: list[SavedEpisode],
        deadline_s: float,
    ) -> set[str]:
        """Restore every planned participant or none: one cleanup path on any failure.
        ``episodes``: the saved episodes whose sessions are installed, where ``placement`` says.
        Returns the rollouts an ``external`` resources server could not continue (their
        state did not survive): the caller restarts them."""
        plan = self._plan(manifest, placement, episodes)
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
                list_names(sorted(gone)),
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
                    list_names([c.label for c in done_with]),
                    published,
                )
                await Resumer().resume_all(published, done_with)
                continue
            shown = list_names(
                [f"{c.label} ({r.phase.value} for {r.checkpoint_id})" for c, r in held]
            )
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
