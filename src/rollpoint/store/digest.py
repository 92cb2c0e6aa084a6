"""Content digests of snapshot files: sha256, computed in one streaming pass.

Owns how a file's digest is computed (block size, hex form) so that writers and
verifiers agree. It does not decide what a mismatch means; callers name the file and
raise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

from rollpoint.store.filesystem import Filesystem

BLOCK_BYTES = 8 << 20
"""Read and write granularity: large enough for disk speed, small enough to bound memory."""


class Digest(NamedTuple):
    sha256: str
    bytes: int


def digest_bytes(data: bytes) -> Digest:
    return Digest(hashlib.sha256(data).hexdigest(), len(data))


def digest_file(fs: Filesystem, path: str) -> Digest:
    """The digest of a whole file, read block by block."""
    hasher = hashlib.sha256()
    size = 0
    with fs.open_read(path) as stream:
        for block in iter_blocks(stream):
            hasher.update(block)
            size += len(block)
    return Digest(hasher.hexdigest(), size)


def iter_blocks(stream: BinaryIO) -> Iterator[bytes]:
    while block := stream.read(BLOCK_BYTES):
        yield block
