"""A sandbox's working directory as data: reading it, packing it as a tar archive, unpacking it.

Owns the three moves of the sandbox's state between disk and a snapshot:

- :func:`read_tree`: every regular file under a working directory, by relative POSIX path
  (the copy a checkpoint takes in its pause: bytes, no encoding);
- :func:`pack_tree`: those files as an uncompressed tar, the same bytes for the same files
  (sorted, mtime 0, owner 0, mode 0644), so equal trees give equal archives;
- :func:`unpack_tree`: an archive written back under a new working directory, refusing,
  before anything is written, a member that is not a regular file or a directory (a
  symlink, a hard link, a device) or whose path leaves the working directory (absolute,
  ``..``, a drive).

Byte-exact: a tree read, packed and unpacked has the same paths and the same bytes. Does not
know about tools or tasks (:mod:`sandbox_env.environment`).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath


class TreeError(ValueError):
    """An archive or a tree that cannot be a sandbox's working directory."""


def read_tree(workdir: Path) -> dict[str, bytes]:
    """Every regular file under ``workdir`` by relative path; a symlink is a TreeError (the
    tools never make one, so finding one means something else wrote into the sandbox)."""
    files: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(workdir):
        here = Path(dirpath)
        for name in sorted(dirnames + filenames):
            path = here / name
            rel = path.relative_to(workdir).as_posix()
            if path.is_symlink():
                raise TreeError(f"{rel} is a symlink")
            if path.is_file():
                files[rel] = path.read_bytes()
    return dict(sorted(files.items()))


def pack_tree(files: Mapping[str, bytes]) -> bytes:
    """``files`` as a tar archive: deterministic, so one tree has one archive."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(files):
            data = files[rel]
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _safe_member(member: tarfile.TarInfo) -> str:
    name = member.name
    if not (member.isfile() or member.isdir()):
        kind = "symlink" if member.issym() else "hard link" if member.islnk() else "special file"
        raise TreeError(f"archive member {name!r} is a {kind}")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or ":" in name or not name:
        raise TreeError(f"archive member {name!r} is outside the working directory")
    return path.as_posix()


def unpack_tree(archive: bytes, workdir: Path) -> None:
    """Write ``archive`` under ``workdir`` (which must exist and be empty); TreeError, with
    nothing written, for an unreadable archive or an unsafe member."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            members = tar.getmembers()
            checked = [(member, _safe_member(member)) for member in members]
            for member, rel in checked:
                target = workdir / rel
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                source = tar.extractfile(member)
                if source is None:
                    raise TreeError(f"archive member {rel!r} has no data")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read())
    except tarfile.TarError as exc:
        raise TreeError(f"not a readable tar archive ({exc})") from None
