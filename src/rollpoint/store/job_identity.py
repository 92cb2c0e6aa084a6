"""One job per store: the job's identity, chosen at its fresh start, on the workdir and the store.

Owns ``<workdir>/.rollpoint-job`` and ``<snapshot root>/job.json``: each holds the job's
:class:`JobIdentity` (a random id, the workdir it was made for, when). :func:`claim_job`
runs at a job's start, after the workdir lock and before the snapshot store is opened (its
opening cleans folders left by a crash, which must never be another job's): a workdir
without an identity gets a new one (a fresh start; a workdir of a run older than this also
gets one); a store without one gets the workdir's. A store or a workdir naming another job
is refused in one line naming both jobs and their workdirs, before anything is written.
The id also goes into every snapshot's sealed config fingerprint (key ``job_id``), so a
snapshot says which job took it even in a store whose ``job.json`` was lost, a resume
refuses another job's snapshot, and retention (:meth:`SnapshotStore._prune
<rollpoint.store.snapshot_store.SnapshotStore>`) never prunes one.

Why (issue 33): a second job pointed at the first one's ``snapshot.store`` skipped the
first's snapshots, started over, and its retention pruned all of them.

``--fresh --force`` keeps the workdir's identity (as it keeps the lock file): the store's
older snapshots are that job's own, and retention ages them out as before. Two jobs started
at the same instant on one new object store may both find no ``job.json`` (an object store
has no exclusive create); the fingerprint check at resume still keeps them from using each
other's snapshots.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.model_base import StrictModel
from rollpoint.store.filesystem import filesystem_for, normalize_location

JOB_FILE = ".rollpoint-job"
"""In the workdir: kept through ``--fresh --force``, like the lock file."""
STORE_JOB_FILE = "job.json"
FINGERPRINT_KEY = "job_id"

log = logging.getLogger("rollpoint.store")
JOB_IDENTITY_VERSION = 1


class JobIdentity(StrictModel):
    schema_version: int = JOB_IDENTITY_VERSION
    job_id: str
    workdir: str
    created_at: float

    def describe(self) -> str:
        return f"job {self.job_id} (workdir {self.workdir})"


def _parse(data: bytes, where: str) -> JobIdentity:
    try:
        identity = JobIdentity.model_validate_json(data)
    except ValidationError:
        raise ConfigError(
            f"{where} is not a rollpoint job identity; restore it, or move it away"
        ) from None
    if identity.schema_version != JOB_IDENTITY_VERSION:
        raise ConfigError(
            f"{where}: job identity version {identity.schema_version} is not one this "
            f"rollpoint reads ({JOB_IDENTITY_VERSION})"
        )
    return identity


def read_workdir_job(workdir: Path) -> JobIdentity | None:
    path = workdir / JOB_FILE
    try:
        return _parse(path.read_bytes(), str(path))
    except FileNotFoundError:
        return None


def read_store_job(root: str) -> JobIdentity | None:
    fs = filesystem_for(normalize_location(root))
    path = fs.join(normalize_location(root), STORE_JOB_FILE)
    if not fs.exists(path):
        return None
    return _parse(fs.read_bytes(path), path)


def _write_workdir_job(workdir: Path, identity: JobIdentity) -> None:
    path = workdir / JOB_FILE
    temp = workdir / f".{JOB_FILE}.{os.getpid()}.tmp"
    temp.write_bytes(identity.model_dump_json().encode())
    os.replace(temp, path)


def _write_store_job(root: str, identity: JobIdentity) -> None:
    location = normalize_location(root)
    fs = filesystem_for(location)
    fs.makedirs(location)
    fs.publish_bytes(fs.join(location, STORE_JOB_FILE), identity.model_dump_json().encode())


def claim_job(workdir: Path, root: str) -> JobIdentity:
    """This workdir's job identity (made when it has none), checked against the store's
    (:func:`stamp_store` names the job in a store that names none). Refuses another
    job's store."""
    ours = read_workdir_job(workdir)
    theirs = read_store_job(root)
    if ours is None and theirs is not None and Path(theirs.workdir) == workdir.resolve():
        # This workdir's own store; its identity file was lost (or the workdir remade).
        ours = theirs
        _write_workdir_job(workdir, ours)
    if ours is None:
        ours = JobIdentity(
            job_id="job-" + uuid.uuid4().hex[:16],
            workdir=str(workdir.resolve()),
            created_at=time.time(),
        )
        # Written first: this locked workdir is this job's, refused store or not, and a
        # refusal names the id the next try will have too.
        _write_workdir_job(workdir, ours)
        if theirs is not None:
            refuse_other_job(root, theirs, ours)
    elif theirs is not None and theirs.job_id != ours.job_id:
        refuse_other_job(root, theirs, ours)
    return ours


def stamp_store(root: str, identity: JobIdentity) -> None:
    """Name this job in a store that names none yet: once its snapshots are known to be
    this job's (a resume checked them), or it starts fresh."""
    try:
        if read_store_job(root) is None:
            _write_store_job(root, identity)
    except OSError as exc:
        # Every snapshot still carries the job id in its sealed fingerprint: the store's
        # own record is the faster check, not the only one.
        log.warning(
            "could not write %s in %s (%s): the snapshots still name the job",
            STORE_JOB_FILE,
            root,
            exc,
        )


def refuse_other_job(root: str, theirs: JobIdentity, ours: JobIdentity) -> None:
    raise ConfigError(
        f"snapshot store {root} belongs to {theirs.describe()}, not to this "
        f"{ours.describe()}: give each job its own snapshot.store"
    )


def check_store_snapshots(root: str, others: Mapping[str, str], ours: JobIdentity) -> None:
    """Refuse a store holding snapshots of other jobs (``others``: snapshot id → job),
    naming them; a store whose ``job.json`` was lost is told apart this way."""
    if others:
        first = next(iter(others))
        jobs = ", ".join(sorted(set(others.values())))
        raise ConfigError(
            f"snapshot store {root} holds {len(others)} snapshot(s) of job {jobs} "
            f"(snapshot {first}), not of this {ours.describe()}: give each job its own "
            "snapshot.store"
        )


def check_snapshot_job(snapshot_id: str, fingerprint: Mapping[str, object], ours: str) -> None:
    """Refuse a snapshot another job took (one without the key predates job identities)."""
    theirs = fingerprint.get(FINGERPRINT_KEY)
    if theirs is not None and theirs != ours:
        raise ConfigError(
            f"snapshot {snapshot_id} was taken by job {theirs}, not by this job {ours}: "
            "give each job its own snapshot.store"
        )
