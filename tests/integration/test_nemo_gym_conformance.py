"""``rollpoint conformance URL --nemo-gym ROWS``: NeMo-Gym's session routes checked on a server
that speaks them (the stand-in of NeMo-Gym's counter server, a real process on loopback:
NeMo-Gym itself needs Python 3.12) and on one that does not answer them as recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.nemo_gym_stand_in import ROWS, counter_server

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def conformance(url: str, rows: Path) -> tuple[int, dict[str, dict[str, object]]]:
    done = subprocess.run(
        [sys.executable, "-m", "rollpoint", "conformance", url, "--nemo-gym", str(rows), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    return done.returncode, {c["name"]: c for c in report["cases"]}


def test_a_server_speaking_nemo_gyms_session_routes_passes_every_case() -> None:
    with counter_server() as url:
        code, cases = conformance(url, ROWS)
    assert code == 0, cases
    assert set(cases) == {
        "seed_session",
        "tool routes",
        "tool validation",
        "unknown route",
        "verify",
        "close_session",
        "replay",
    }
    assert "cookie" in str(cases["seed_session"]["detail"])


def test_tools_the_server_does_not_route_fail_their_case(tmp_path: Path) -> None:
    row = json.loads(ROWS.read_text().splitlines()[0])
    row["responses_create_params"]["tools"].append(
        {"type": "function", "name": "decrement_counter", "parameters": {"type": "object"}}
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    with counter_server() as url:
        code, cases = conformance(url, rows)
    assert code == 1
    assert not cases["tool routes"]["passed"]
    assert "/decrement_counter answered 404" in str(cases["tool routes"]["detail"])
    assert cases["seed_session"]["passed"] and cases["verify"]["passed"]


def test_a_rows_file_that_is_not_nemo_gyms_is_one_line_and_exit_2(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollpoint",
            "conformance",
            "http://127.0.0.1:9",
            "--nemo-gym",
            str(rows),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "not a NeMo-Gym row" in done.stderr and "Traceback" not in done.stderr
