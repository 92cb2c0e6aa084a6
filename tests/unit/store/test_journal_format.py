"""The journal's on-disk format: round trip, checksums, torn tails at every byte, golden files."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpoint.protocol.errors import JournalFormatError
from rollpoint.store.journal_format import (
    FORMAT_VERSION,
    HEADER,
    Damage,
    Frame,
    SegmentHeader,
    decode_header,
    encode_header,
    encode_record,
    scan_frames,
    segment_name,
    segment_number,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "journal"

GOLDEN_RECORDS = [
    (
        "model|r-0001|a0|t0|c0",
        "policy_call",
        orjson.dumps({"tokens": [1, 2, 3], "logprobs": [-0.5, -0.25, -1.0]}),
        True,
    ),
    ("resources|r-0001|a0|t0|c0", "tool_call", b'{"result":"ok"}', False),
    ("agent|r-0001|a0|t1", "turn", orjson.dumps({"text": "caf\u00e9"}), True),
]
"""What tests/golden/journal/segment_v1.rpj holds (README.md there says how it was made)."""


def _segment(
    records: list[tuple[str, str, bytes, bool]], number: int = 1, prev_end: int = 0
) -> bytes:
    frames = [encode_record(k, kind, p, json=j) for k, kind, p, j in records]
    return encode_header(SegmentHeader(segment=number, prev_end=prev_end)) + b"".join(frames)


def _frames(data: bytes) -> list[Frame | Damage]:
    return list(scan_frames(data, HEADER, len(data)))


def test_records_round_trip() -> None:
    data = _segment(GOLDEN_RECORDS)
    frames = _frames(data)
    assert [
        (f.key, f.kind, f.payload, f.json) for f in frames if isinstance(f, Frame)
    ] == GOLDEN_RECORDS
    assert decode_header(data, "x") == SegmentHeader(segment=1, prev_end=0)
    ends = [f.end for f in frames if isinstance(f, Frame)]
    assert ends[-1] == len(data)


@pytest.mark.parametrize("offset", [0, 4, 8, 9, 20, -1])
def test_a_flipped_bit_anywhere_in_a_record_fails_its_checksum(offset: int) -> None:
    data = bytearray(_segment(GOLDEN_RECORDS[:2]))
    first_end = HEADER + len(encode_record(*GOLDEN_RECORDS[0][:3], json=True))
    at = (first_end + offset) if offset >= 0 else len(data) + offset
    data[at] ^= 0x10
    frames = _frames(bytes(data))
    assert isinstance(frames[0], Frame)
    assert isinstance(frames[1], Damage) and frames[1].offset == first_end
    assert len(frames) == 2


def test_nothing_after_a_damaged_record_is_trusted() -> None:
    data = bytearray(_segment(GOLDEN_RECORDS))
    data[HEADER + 12] ^= 0xFF  # inside the first record's body
    frames = _frames(bytes(data))
    assert frames == [Damage(HEADER, "record checksum mismatch")]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=30), st.binary(max_size=300)),
        min_size=1,
        max_size=5,
    )
)
def test_a_torn_last_record_is_cut_at_every_byte_offset(records: list[tuple[str, bytes]]) -> None:
    whole = _segment([(key, "k", payload, False) for key, payload in records])
    last_start = len(whole) - len(encode_record(records[-1][0], "k", records[-1][1]))
    for cut in range(last_start, len(whole)):
        frames = list(scan_frames(whole[:cut], HEADER, cut))
        kept = [f for f in frames if isinstance(f, Frame)]
        assert [(f.key, f.payload) for f in kept] == records[:-1]
        if cut > last_start:
            assert isinstance(frames[-1], Damage) and frames[-1].offset == last_start
        else:
            assert not any(isinstance(f, Damage) for f in frames)


def test_zero_filled_tail_is_damage_not_records() -> None:
    data = _segment(GOLDEN_RECORDS[:1]) + bytes(4096)
    frames = _frames(data)
    assert isinstance(frames[0], Frame) and isinstance(frames[1], Damage)
    assert "impossible record length 0" in frames[1].reason


def test_segment_names() -> None:
    assert segment_name(7) == "segment-0000000007.rpj"
    assert segment_number("segment-0000000007.rpj") == 7
    assert segment_number("segment-0000000007.rpj.untrusted") is None
    assert segment_number("segment-7.rpj") is None


# --- golden files ---------------------------------------------------------------------------


def test_golden_v1_reads_back_and_encodes_to_the_same_bytes() -> None:
    golden = (GOLDEN / "segment_v1.rpj").read_bytes()
    assert decode_header(golden, "segment_v1.rpj") == SegmentHeader(1, 0, FORMAT_VERSION)
    frames = _frames(golden)
    assert [
        (f.key, f.kind, f.payload, f.json) for f in frames if isinstance(f, Frame)
    ] == GOLDEN_RECORDS
    assert _segment(GOLDEN_RECORDS) == golden, (
        "the format changed: bump FORMAT_VERSION, add a migration"
    )


def test_golden_torn_tail_keeps_the_whole_records() -> None:
    torn = (GOLDEN / "segment_v1_torn.rpj").read_bytes()
    frames = _frames(torn)
    assert [f.key for f in frames if isinstance(f, Frame)] == [r[0] for r in GOLDEN_RECORDS[:2]]
    assert isinstance(frames[-1], Damage)


def test_golden_newer_version_is_refused_naming_the_file() -> None:
    path = GOLDEN / "segment_v99_newer.rpj"
    with pytest.raises(JournalFormatError) as info:
        decode_header(path.read_bytes(), str(path))
    message = str(info.value)
    assert str(path) in message and "format version 99" in message and "\n" not in message


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda d: b"NOTAJRNL" + d[8:], "bad magic"),
        (lambda d: d[:10], "shorter than its 28-byte header"),
        (lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:], "header checksum mismatch"),
    ],
)
def test_damaged_headers_are_refused_naming_the_file(damage: object, says: str) -> None:
    data = damage(_segment(GOLDEN_RECORDS))  # type: ignore[operator]
    with pytest.raises(JournalFormatError, match=says) as info:
        decode_header(data, "/j/segment-0000000001.rpj")
    assert "/j/segment-0000000001.rpj" in str(info.value)


def test_journal_keys_are_one_stable_string_and_refuse_ambiguous_parts() -> None:
    from rollpoint.protocol.errors import BadRequestError
    from rollpoint.store.journal_format import journal_key

    assert journal_key("model", "r7f3a", 0, 3, 1) == "model|r7f3a|a0|t3|c1"
    assert journal_key("agent", "r7f3a", 2, 3) == "agent|r7f3a|a2|t3"
    with pytest.raises(BadRequestError, match=r"rollout id 'r7\|x' is not an identifier"):
        journal_key("model", "r7|x", 0, 0, 0)
    with pytest.raises(BadRequestError, match="turn -1"):
        journal_key("model", "r7", 0, -1, 0)
    with pytest.raises(BadRequestError, match="participant kind"):
        journal_key("mo|del", "r7", 0, 0, 0)
