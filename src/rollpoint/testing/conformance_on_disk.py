"""The conformance kit's one look at files: what a commit wrote, checked on disk.

Owns :func:`written` (the manifest a commit that waited for its write must return) and
:func:`manifest_on_disk`, which, when the kit runs where it can read the snapshot root
(``Trial.local_root``), reads the participant's state folder back, verifies it as the
store does and compares its ``manifest.json`` with the reply's. Used by the ``commit``
and ``detached-write`` cases of :mod:`rollpoint.testing.conformance_cases`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from pydantic import ValidationError

from rollpoint.protocol.control import CommitReply
from rollpoint.protocol.errors import RollpointError
from rollpoint.protocol.manifest import ParticipantManifest
from rollpoint.store.participant_state import verify_participant_state
from rollpoint.testing.conformance_probe import CaseFailed, check

__all__ = ["manifest_on_disk", "written"]


def written(reply: CommitReply, verb: str) -> ParticipantManifest:
    check(reply.manifest is not None, f"{verb}: a commit that waits for its write has no manifest")
    assert reply.manifest is not None
    return reply.manifest


async def manifest_on_disk(root: Path, reply: CommitReply, manifest: ParticipantManifest) -> str:
    folder = root / reply.checkpoint_dir / reply.state_dir

    def read() -> tuple[bytes, ParticipantManifest]:
        raw = (folder / "manifest.json").read_bytes()
        verified = verify_participant_state(
            str(folder),
            kind=manifest.kind.value,
            instance=manifest.instance,
            checkpoint_id=manifest.checkpoint_id,
            root=str(root),
        )
        return raw, verified

    try:
        manifest_raw, _ = await asyncio.to_thread(read)
    except OSError as exc:
        raise CaseFailed(f"commit: {exc.filename} not readable: {exc.strerror}") from None
    except RollpointError as exc:
        raise CaseFailed(f"commit: the state on disk does not verify: {exc.message}") from None
    try:
        on_disk = ParticipantManifest.model_validate(orjson.loads(manifest_raw))
    except (orjson.JSONDecodeError, ValidationError) as exc:
        reason = str(exc).splitlines()[0]
        raise CaseFailed(f"commit: {folder}/manifest.json is not a manifest: {reason}") from None
    check(on_disk == manifest, f"commit: {folder}/manifest.json differs from the reply's")
    return " (manifest and records checked on disk)"
