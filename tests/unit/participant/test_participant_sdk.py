"""The participant SDK's public surface (``rollpoint.participant``), and the servers using it."""

from __future__ import annotations

import ast
import math
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

import rollpoint.participant
from rollpoint.http.app import create_app
from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.participant import Participant, close_control_plane, control_fence, mount_participant
from rollpoint.protocol.control import CONTROL_PREFIX
from rollpoint.protocol.errors import ConfigError
from tests.unit.participant.fake_participant import FakeParticipant

SDK = Path(rollpoint.participant.__file__).parent
SDK_MODULES = {
    "admission_gate",
    "checkpoint_write",
    "control_listener",
    "control_mount",
    "control_routes",
    "control_settings",
    "episode_scope",
    "fence",
    "fence_hold",
    "fence_lease",
    "fence_verbs",
    "in_process_control",
    "journal_checkpoint",
    "participant",
    "phase_table",
    "readiness_checks",
    "ready_queue",
    "resumed_ids",
    "retire_marks",
    "record_memo",
    "state_folders",
    "state_image",
}
"""The modules behind the SDK (tests/unit/test_import_rules.py: servers never import them)."""


def test_every_module_of_the_sdk_package_is_listed() -> None:
    assert {p.stem for p in SDK.glob("*.py")} - {"__init__"} == SDK_MODULES


def test_the_public_surface_is_pinned() -> None:
    assert rollpoint.participant.__all__ == [
        "AdmissionGate",
        "CapturingParticipant",
        "CheckpointMode",
        "ControlSettings",
        "EpisodeId",
        "EpisodeScope",
        "Fence",
        "JournalingParticipant",
        "Participant",
        "ParticipantKind",
        "Readiness",
        "RecordMemo",
        "RetireMarks",
        "RetireOutcome",
        "RetireOutcomeKind",
        "StateImage",
        "close_control_plane",
        "control_fence",
        "episode_pairs",
        "latest_attempts",
        "mount_participant",
    ]
    for name in rollpoint.participant.__all__:
        assert getattr(rollpoint.participant, name) is not None


def _reads(tree: ast.AST) -> list[str]:
    """Names and attributes a module reads, with their line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute):
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.alias):
            out.append(f"line {node.lineno}: import {node.name}")
    return out


@pytest.mark.parametrize("module", sorted(SDK_MODULES))
def test_the_sdk_reads_no_token_from_the_environment(module: str) -> None:
    # The token is passed to mount_participant; nothing behind it may look it up.
    tree = ast.parse((SDK / f"{module}.py").read_text())
    env = {"environ", "getenv", "load_token", "data_token", "CONTROL_TOKEN_ENV", "DATA_TOKEN_ENV"}
    found = [r for r in _reads(tree) if r.rsplit(" ", 1)[-1].lstrip(".") in env]
    assert found == []


def test_nothing_reads_portable_with_a_default() -> None:
    src = Path(rollpoint.participant.__file__).parents[1]
    found = [
        f"{path.relative_to(src)}:{node.lineno}"
        for path in sorted(src.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in {"getattr", "hasattr"}
        and any(isinstance(a, ast.Constant) and a.value == "portable" for a in node.args)
    ]
    assert found == []


def test_portable_is_part_of_the_protocol() -> None:
    # Declared, not read with a default: a server without it is not a participant.
    assert isinstance(FakeParticipant(), Participant)
    without = FakeParticipant()
    del without.portable
    assert not isinstance(without, Participant)


async def test_mount_participant_guards_the_routes_with_the_token_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONTROL_TOKEN_ENV, raising=False)  # nothing read from the environment
    app = FastAPI()
    participant = FakeParticipant()
    participant.portable = False
    token = "sdk-token-0123456789abcdef"
    fence = mount_participant(app, participant, token=token, snapshot_root=str(tmp_path))
    assert control_fence(app) is fence
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sdk") as client:
        refused = await client.get(f"{CONTROL_PREFIX}/status")
        status = await client.get(
            f"{CONTROL_PREFIX}/status", headers={"authorization": f"Bearer {token}"}
        )
    assert refused.status_code == 401
    assert status.status_code == 200
    assert status.json()["portable"] is False  # declared by the participant, read as such
    await close_control_plane(app)


@pytest.mark.parametrize(
    ("skew_s", "refused"), [(5.0, True), (2.0, False), (-5.0, False), (0.0, False)]
)
async def test_a_skewed_control_clock_reads_deadlines_against_itself(
    tmp_path: Path, skew_s: float, refused: bool
) -> None:
    # A deadline 3 s ahead of this machine's clock has passed for a participant 5 s ahead.
    app = create_app("skewed participant")  # rollpoint's envelope: errors as codes
    token = "sdk-token-0123456789abcdef"
    mount_participant(
        app, FakeParticipant(), token=token, snapshot_root=str(tmp_path), clock_skew_s=skew_s
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sdk") as client:
        reply = await client.post(
            f"{CONTROL_PREFIX}/prepare",
            json={"checkpoint_id": "c1", "deadline_ts": time.time() + 3},
            headers={"authorization": f"Bearer {token}"},
        )
    if refused:
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"]["code"] == "deadline_exceeded"
    else:
        assert reply.status_code == 200, reply.text
        lease = reply.json()["lease_expires_at"]
        assert lease is not None
    await close_control_plane(app)


def test_a_clock_skew_that_is_no_number_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="clock_skew_s must be a finite number"):
        mount_participant(
            FastAPI(),
            FakeParticipant(),
            token="t" * 24,
            snapshot_root=str(tmp_path),
            clock_skew_s=math.inf,
        )
