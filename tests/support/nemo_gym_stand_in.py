"""The NeMo-Gym counter stand-in (:mod:`rollpoint.testing.nemo_gym_counter`) as a real process
on a free loopback port, for the tests of the ``nemo-gym:`` adapter and its conformance check."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROWS = Path(__file__).parents[1] / "fixtures" / "nemo_gym" / "counter_rows.jsonl"


@contextmanager
def counter_server() -> Iterator[str]:
    """Start the stand-in; yield its base URL; stop it on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollpoint.testing.nemo_gym_counter", "--port", "0"],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().split()
        assert line[:1] == ["port"], f"the stand-in did not start: {line}"
        yield f"http://127.0.0.1:{line[1]}"
    finally:
        proc.terminate()
        proc.wait(30)


def server_log(url: str) -> dict[str, Any]:
    """Every increment the stand-in applied (by session) and its live counters."""
    reply = httpx.get(f"{url}/stand-in/log", timeout=10)
    reply.raise_for_status()
    log: dict[str, Any] = reply.json()
    return log
