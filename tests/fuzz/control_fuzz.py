"""The harness for fuzzing a participant's control routes with schemathesis.

Owns a live participant under fuzz (:class:`Target`: a real server on loopback, its
OpenAPI schema cut down to the control routes), the phases a fuzzed request may start
from (:class:`Start`), aiming a generated body at the checkpoint the participant holds
(so a commit or renew reaches past the id checks), and the tally of what the fuzzer sent
and got back (:data:`TALLY`, printed at the end of the run by ``conftest.py``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import requests
import schemathesis
from fastapi import FastAPI
from pydantic import BaseModel
from schemathesis import Case

from rollpoint.http.auth import CONTROL_TOKEN_ENV
from rollpoint.protocol.control import (
    CONTROL_PREFIX,
    Verb,
)
from rollpoint.protocol.control_verbs import VERBS
from rollpoint.servers.agent.agent_server import AgentSettings, create_agent_app
from rollpoint.servers.model.model_server import ModelServerSettings, create_model_app
from rollpoint.servers.resources.resources_server import create_resources_app
from tests.support.live_server import serve_app

TOKEN = "fuzz-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
GRACE_S = 0.5
DOWN = "http://127.0.0.1:9"
"""A peer nobody serves: the control routes never call it."""
SAVED_ID = "fuzz-saved"
SAVED_DIR = "fuzz/saved"
"""A real empty commit made when the target starts: an aimed restore installs it."""
HOLD_S = 60.0
"""Deadline of the checkpoint a start phase holds: it never lapses within an example."""
REPLIES: dict[Verb, type[BaseModel]] = {v.verb: v.reply for v in VERBS.values()}
FINGERPRINT = ("phase", "checkpoint_id", "lease_expires_at", "counts", "retired_rollouts")
"""The status fields a refused request must leave as they were."""


class Start(StrEnum):
    """The phase the participant is put in before a fuzzed request."""

    IDLE = "idle"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


@dataclass
class Tally:
    """What the fuzzers sent: every HTTP request, and each fuzzed one by status."""

    requests: Counter[str] = field(default_factory=Counter)
    """kind -> every request made (setup, status reads and resets included)."""
    fuzzed: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(kind, status class) -> fuzzed requests."""
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(kind, "<status> <error code>") -> fuzzed refusals."""

    def lines(self) -> list[str]:
        out = []
        for kind in sorted(self.requests):
            classes = {c: n for (k, c), n in sorted(self.fuzzed.items()) if k == kind}
            codes = {c: n for (k, c), n in sorted(self.codes.items()) if k == kind}
            out.append(
                f"{kind}: {sum(classes.values())} fuzzed requests {classes}, "
                f"{self.requests[kind]} requests in all; refusals {codes}"
            )
        return out


TALLY = Tally()


def participant_app(kind: str, root: Path) -> FastAPI:
    snapshot_root = str(root)
    if kind == "model":
        settings = ModelServerSettings(
            upstream_url=f"{DOWN}/v1", snapshot_root=snapshot_root, lease_grace_s=GRACE_S
        )
        return create_model_app(settings)
    if kind == "agent":
        agent = AgentSettings(
            model_url=DOWN,
            resources_url=DOWN,
            environment="workplace",
            snapshot_root=snapshot_root,
            lease_grace_s=GRACE_S,
        )
        return create_agent_app(agent)
    return create_resources_app("workplace", snapshot_root=snapshot_root, lease_grace_s=GRACE_S)


class Target:
    """One live participant under fuzz, reset to idle after every example."""

    def __init__(self, kind: str, url: str, schema: schemathesis.BaseSchema) -> None:
        self.kind = kind
        self.url = url
        self.schema = schema
        self._http = httpx.Client(base_url=url + CONTROL_PREFIX, headers=AUTH, timeout=10)
        self._session = requests.Session()
        self._ids = itertools.count()
        self.held: str | None = None

    def close(self) -> None:
        self._http.close()
        self._session.close()

    def operation(self, verb: Verb) -> Any:
        return self.schema[VERBS[verb].path][VERBS[verb].method]

    def fresh_id(self) -> str:
        return f"fuzz-{next(self._ids)}"

    def control(self, verb: Verb, body: dict[str, Any] | None = None) -> Any:
        """A control call of the harness itself; it must succeed."""
        TALLY.requests[self.kind] += 1
        reply = self._http.request(VERBS[verb].method, f"/{verb}", json=body)
        assert reply.status_code == 200, f"harness {verb}: {reply.status_code} {reply.text}"
        return reply.json()

    def fingerprint(self) -> dict[str, Any]:
        status = self.control(Verb.STATUS)
        return {name: status[name] for name in FINGERPRINT}

    def save_once(self) -> None:
        """Commit an empty state under :data:`SAVED_ID` for aimed restores to install."""
        due = time.time() + HOLD_S
        self.control(Verb.PREPARE, {"checkpoint_id": SAVED_ID, "deadline_ts": due})
        commit = {"checkpoint_id": SAVED_ID, "deadline_ts": due}
        self.control(Verb.COMMIT, {**commit, "checkpoint_dir": SAVED_DIR, "episode_ids": []})
        self.control(Verb.RESUME, {"checkpoint_id": SAVED_ID})

    def enter(self, start: Start) -> None:
        """Put the participant in ``start``, holding a fresh checkpoint id (none in idle)."""
        self.held = None
        if start is Start.IDLE:
            return
        due = time.time() + HOLD_S
        if start is Start.RESTORED:
            self.held = self.fresh_id()
            body = {"checkpoint_id": self.held, "deadline_ts": due, "episode_ids": []}
            body |= {"checkpoint_dir": SAVED_DIR, "source_checkpoint_id": SAVED_ID}
            self.control(Verb.RESTORE, body)
            return
        self.held = self.fresh_id()
        self.control(Verb.PREPARE, {"checkpoint_id": self.held, "deadline_ts": due})
        if start is Start.COMMITTED:
            body = {"checkpoint_id": self.held, "deadline_ts": due, "episode_ids": []}
            self.control(Verb.COMMIT, {**body, "checkpoint_dir": f"fuzz/{self.held}"})

    def aim(self, case: Case) -> None:
        """Point a generated body at the held checkpoint (a restore at the saved state)."""
        body = case.body
        if not isinstance(body, dict):
            return
        if case.path.endswith(f"/{Verb.RESTORE}"):
            body["checkpoint_id"] = self.held or self.fresh_id()
            body["checkpoint_dir"] = SAVED_DIR
            body["source_checkpoint_id"] = SAVED_ID
        elif self.held is not None and "checkpoint_id" in body:
            body["checkpoint_id"] = self.held

    def send(self, case: Case, headers: dict[str, str]) -> Any:
        """Send a fuzzed request; tally it."""
        TALLY.requests[self.kind] += 1
        response = case.call(base_url=self.url, session=self._session, headers=headers)
        TALLY.fuzzed[(self.kind, f"{response.status_code // 100}xx")] += 1
        if response.status_code >= 400:
            code = error_code(response.content) or "(no envelope)"
            TALLY.codes[(self.kind, f"{response.status_code} {code}")] += 1
        return response

    def reset(self) -> None:
        """Back to idle: resume whatever checkpoint is active (the held one, or a fuzzed one)."""
        active = self.control(Verb.STATUS)["checkpoint_id"]
        for cid in {self.held, active} - {None}:
            self.control(Verb.RESUME, {"checkpoint_id": cid})
        self.held = None


def error_code(content: bytes) -> str | None:
    """The error envelope's code, or None when the body is not the envelope."""
    try:
        code = orjson.loads(content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


@contextmanager
def serve_target(kind: str, root: Path) -> Iterator[Target]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CONTROL_TOKEN_ENV, TOKEN)
        app = participant_app(kind, root)
    with serve_app(app) as url:
        raw = httpx.get(f"{url}/openapi.json").json()
        schema = schemathesis.openapi.from_dict(raw).include(path_regex=f"^{CONTROL_PREFIX}/")
        target = Target(kind, url, schema)
        try:
            target.save_once()
            yield target
        finally:
            target.close()
