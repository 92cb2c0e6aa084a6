"""The restore's checks: what is refused before anything is installed
(docs/design.md#the-restore-order, step 2).

Owns:

- the config check (:func:`check_config`): the config keys the saved state depends on must
  match, a mismatch names the key; ``replicas`` may change (:data:`ELASTIC_CONFIG_KEYS`);
- the placement of saved replicas onto live ones (:func:`place`, :class:`Placement`): the
  replica that saved it when that one is live with every participant it needs, otherwise
  another live replica that has them, which installs the records of several saved replicas
  (an elastic N → M restore); a participant no live replica serves is named, and so is one
  that changed checkpoint mode or whose state would move but is not ``portable``
  (:func:`check_modes`);
- the cut (:func:`check_cut`): the saved ledger's in-flight set must equal saved +
  restarted + finished episodes, a mismatch names the episodes and replicas.

Every refusal names what is wrong, at most ten items of a kind (:func:`list_names`).

Does not own: installing (:class:`~rollpoint.trainer.restore.installer.Installer`) nor
moving the ledger (:class:`~rollpoint.trainer.restore.restorer.Restorer`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from pydantic import JsonValue

from rollpoint.protocol.control import StatusReply
from rollpoint.protocol.errors import ConfigError, RestoreError
from rollpoint.protocol.manifest import SnapshotManifest
from rollpoint.store.job_identity import FINGERPRINT_KEY as JOB_KEY
from rollpoint.store.job_identity import check_snapshot_job
from rollpoint.trainer.state.ledger import RecoveryLedger

_LIST_LIMIT = 10


def list_names(items: list[str]) -> str:
    """The first ten of ``items`` and how many more: a refusal or a warning stays one line."""
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f" and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


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


Live = dict[tuple[str, str, str], StatusReply]
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


def place(manifest: SnapshotManifest, live: Live) -> Placement:
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
            f"snapshot {manifest.snapshot_id} needs participants that are not live: {list_names(missing)} "
            "(and no live replica serves all of its replica's participants); nothing was installed"
        )
    return Placement(target_of)


def check_modes(manifest: SnapshotManifest, live: Live, placement: Placement) -> None:
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
            f"snapshot {manifest.snapshot_id}: participants changed checkpoint mode: {list_names(changed)}; "
            "nothing was installed"
        )
    if fixed:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} cannot move state that is not portable: {list_names(fixed)}; "
            "run with the replica count it was taken with, or start over with --fresh --force; "
            "nothing was installed"
        )


def check_cut(manifest: SnapshotManifest, ledger: RecoveryLedger) -> None:
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
        problems.append(f"in flight in the ledger but not saved: {list_names(only_ledger)}")
    if only_manifest:
        problems.append(f"saved but not in flight in the ledger: {list_names(only_manifest)}")
    if moved:
        problems.append(f"on another replica: {list_names(moved)}")
    if problems:
        raise RestoreError(
            f"snapshot {manifest.snapshot_id} does not match its ledger: {'; '.join(problems)}"
        )
