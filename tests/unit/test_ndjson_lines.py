"""NDJSON lines under a cap: lines of any size up to it, in chunks split anywhere; a longer
line is dropped (never held) and reported with its size, and the lines after it still come."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollpoint.http.ndjson_lines import HEAD_BYTES, OversizedLine, capped_lines


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def _read(data: bytes, size: int, cap: int) -> list[bytes | OversizedLine]:
    return [line async for line in capped_lines(_chunks(data, size), cap)]


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
async def test_a_line_longer_than_aiohttps_512_kib_limit_comes_whole(chunk: int) -> None:
    long = b'{"x":"' + b"a" * (2 * 1024 * 1024) + b'"}'
    data = b'{"a":1}\n' + long + b"\n\n" + b'{"b":2}'
    assert await _read(data, chunk, 64 * 1024 * 1024) == [b'{"a":1}', long, b'{"b":2}']


@pytest.mark.parametrize("chunk", [1, 5, 100, 1 << 16])
async def test_a_line_over_the_cap_is_reported_with_its_size_and_the_lines_after_it_come(
    chunk: int,
) -> None:
    big = b'{"episode":"r-7",' + b"z" * 10_000 + b"}"
    data = b"short\n" + big + b"\nafter\n" + big
    lines = await _read(data, chunk, 1000)
    assert lines[0] == b"short" and lines[2] == b"after"
    for oversized in (lines[1], lines[3]):
        assert isinstance(oversized, OversizedLine)
        assert oversized.size == len(big) and oversized.cap == 1000
        assert oversized.head == big[:HEAD_BYTES]
        assert "over the 0.0 MiB (1000 bytes) cap" in oversized.describe()


async def test_a_line_exactly_at_the_cap_is_kept() -> None:
    assert await _read(b"x" * 50 + b"\n", 3, 50) == [b"x" * 50]
    (over,) = await _read(b"x" * 51 + b"\n", 3, 50)
    assert isinstance(over, OversizedLine) and over.size == 51
