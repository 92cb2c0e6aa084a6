"""NDJSON lines read from a stream under a size cap: no line limit but the one asked for.

Owns splitting a reply body into lines as its chunks arrive, and what becomes of a line
longer than the cap: its bytes are read and dropped as they come (memory stays bounded by
the cap, not by the line), and the caller gets an :class:`OversizedLine` naming its size,
the cap and its first :data:`HEAD_BYTES` (enough to say which row it was), in its place.
The lines after it are read as usual: one long reply costs its own row, not its siblings.

Why not aiohttp's ``StreamReader.readline``: it refuses a line longer than the reader's
high-water mark (``LineTooLong``, 512 KiB with the defaults), an unhandled exception that
ended the run; an episode with ~48k generated tokens and their token data is longer than
that (issue 33). Does not own the connection, decoding JSON, or what a caller does with an
oversized line (the dispatcher fails that row: :mod:`rollpoint.trainer.dispatch.dispatcher`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
"""64 MiB: a tokens-captured episode of 48k generated tokens is ~1.5 MiB on the wire."""
HEAD_BYTES = 4096
"""How much of an oversized line is kept: a row result names its episode first."""


@dataclass(frozen=True, slots=True)
class OversizedLine:
    """A line longer than the cap, read and dropped: its size, the cap and its start."""

    size: int
    cap: int
    head: bytes

    def describe(self) -> str:
        return f"a reply line of {_mib(self.size)} is over the {_mib(self.cap)} cap"


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB ({n} bytes)"


def _fill(head: bytes, more: bytes) -> bytes:
    """``head`` grown from ``more`` up to :data:`HEAD_BYTES` (a cap below it drops first)."""
    return head if len(head) >= HEAD_BYTES else head + more[: HEAD_BYTES - len(head)]


async def capped_lines(
    chunks: AsyncIterable[bytes], max_line_bytes: int
) -> AsyncIterator[bytes | OversizedLine]:
    """Yield each non-blank line of ``chunks`` (without its newline), or an
    :class:`OversizedLine` for one longer than ``max_line_bytes``."""
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    partial = bytearray()
    skipped = 0  # > 0: bytes of an oversized line dropped so far
    head = b""
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            start = end + 1
            if skipped:
                head = _fill(head, piece)
                yield OversizedLine(skipped + len(piece), max_line_bytes, head)
                skipped = 0
            elif len(partial) + len(piece) > max_line_bytes:
                head = bytes((partial + piece)[:HEAD_BYTES])
                yield OversizedLine(len(partial) + len(piece), max_line_bytes, head)
                partial.clear()
            else:
                if partial:
                    partial += piece
                    line = bytes(partial)
                    partial.clear()
                else:
                    line = piece
                if line.strip():
                    yield line
        rest = chunk[start:]
        if skipped:
            head = _fill(head, rest)
            skipped += len(rest)
        elif len(partial) + len(rest) > max_line_bytes:
            head = bytes((partial + rest)[:HEAD_BYTES])
            skipped = len(partial) + len(rest)
            partial.clear()
        else:
            partial += rest
    if skipped:
        yield OversizedLine(skipped, max_line_bytes, head)
    elif partial.strip():
        yield bytes(partial)
