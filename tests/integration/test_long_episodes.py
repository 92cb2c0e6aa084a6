"""Episodes of any realistic size (issue 33, item 5): a tokens-captured episode of ~48k
generated tokens is longer than aiohttp's 512 KiB line limit, and trains like any other;
a reply over ``max_reply_bytes`` fails its row's tries (re-sent fresh, never adopted) and
then its group, naming the size and the cap: never a traceback, and the run ends."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from rollpoint.app import exit_codes
from tests.integration.test_cli_run import rollpoint, train_lines, write_config

pytestmark = pytest.mark.integration

REASONING_TOKENS = 16_000
"""Stand-in reasoning before each of the three tool calls: ~48k generated tokens an episode."""


def _long_episode_config(tmp_path: Path, **overrides: object) -> Path:
    return write_config(
        tmp_path,
        tasks=1,
        group_size=2,
        replicas=1,
        max_turns=8,
        policy={
            "latency_ms": 0,
            "error_rate": 0.0,
            "capture_tokens": "required",
            "tool_turns": 3,
            "reasoning_tokens": REASONING_TOKENS,
            "sampling": {"logprobs": True},
        },
        train={"batch_size": 2},
        **overrides,
    )


def test_a_48k_token_episode_with_its_token_data_trains(tmp_path: Path) -> None:
    result = rollpoint("run", str(_long_episode_config(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = train_lines(tmp_path / "run")
    rows = Counter((line["group_id"], line["row"]) for line in lines)
    assert sorted(row for _, row in rows) == [0, 1] and set(rows.values()) == {1}
    for line in lines:
        generated = sum(len(t["completion_token_ids"]) for t in line["turns"])  # type: ignore[attr-defined]
        assert generated >= 3 * REASONING_TOKENS
    # Each trained row's line is what its reply carried: well over 512 KiB.
    sizes = [len(raw) for raw in (tmp_path / "run" / "train_data.jsonl").read_bytes().splitlines()]
    assert min(sizes) > 512 * 1024


def test_a_reply_over_the_cap_fails_its_row_naming_the_size_and_the_cap(tmp_path: Path) -> None:
    config = _long_episode_config(tmp_path, max_reply_bytes=256 * 1024)
    result = rollpoint("run", str(config))
    # The run ends with its group failed: exit 3, not a crash (rollpoint.app.exit_codes).
    assert result.returncode == exit_codes.GROUPS_FAILED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # Re-sent fresh (never adopted: the stored reply is as long), then the group failed.
    assert "fetching the stored replies" not in result.stderr
    (failed,) = [line for line in result.stderr.splitlines() if "failed: row" in line]
    assert "gave up after" in failed
    assert re.search(r"a reply line of 1\.\d MiB \(\d+ bytes\) is over the 0\.2 MiB", failed)
    assert "(262144 bytes) cap (max_reply_bytes)" in failed
    assert not (tmp_path / "run" / "train_data.jsonl").exists() or not train_lines(tmp_path / "run")
