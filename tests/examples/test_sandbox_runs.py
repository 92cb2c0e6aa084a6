"""The sandbox example tested like a product: conformance of its servers, and a crash.

``rollpoint serve`` starts the sandbox's servers (by import path) and ``rollpoint
conformance`` checks each one, as an environment author would. Then a real ``rollpoint run``
on the sandbox is SIGKILLed after a snapshot and rerun to the end, and held to:

- every row trained exactly once (I1, from ``train_data.jsonl``);
- no append applied twice, counted from the episodes' final trees (the environment writes
  each one to ``$SANDBOX_KEEP_FINAL``): every trained rollout's tree is the one its
  successful calls build from the task's starting files, so an append applied twice
  (a line more) has no matching tree;
- continued episodes not regenerated, counted from the policy's own log: the policy is a
  server of this test (it outlives the killed run) and notes each request's episode seed
  and turn; every turn a continued rollout kept from before the cut was asked exactly once.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from sandbox_env import TASKS
from sandbox_env.tree import pack_tree

from rollpoint.envs import TaskRow, load_tasks
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app
from rollpoint.servers.agent.episode_runner import episode_seed
from rollpoint.testing import invariants
from tests.support.crash_rerun import crash_and_rerun, tool_calls, trained_once
from tests.support.job_config import write_job_config
from tests.support.live_server import serve_app
from tests.support.run_process import RunProcess
from tests.support.serve_process import served

REF = "sandbox_env:SandboxEnvironment"
GROUP_SIZE = 2
TOOL_TURNS = 6
"""The policy's tool calls an episode: its last call (the final answer) is turn TOOL_TURNS."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class CallLog:
    """ASGI layer over the scripted policy: one ``(seed, turn)`` per chat request it gets
    (the turn is the number of assistant messages the request carries)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls: list[tuple[int | None, int]] = []
        self.sent: dict[int | None, list[list[dict[str, Any]]]] = {}
        """Every request's messages, by episode seed."""
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def noted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self._note(b"".join(chunks))
            return message

        await self.app(scope, noted, send)

    def _note(self, body: bytes) -> None:
        request = orjson.loads(body)
        turn = sum(1 for m in request["messages"] if m.get("role") == "assistant")
        with self._lock:
            self.calls.append((request.get("seed"), turn))
            self.sent.setdefault(request.get("seed"), []).append(request["messages"])

    def counts(self) -> Counter[tuple[int | None, int]]:
        with self._lock:
            return Counter(self.calls)


POLICY_LATENCY_MS = 120
"""Slow enough that an episode spends longer between its 1st and its TOOL_TURNS-th turn than
a snapshot interval (0.3 s), so the crash tests see a snapshot holding one at the depth they
wait for: at 40 ms a CI run finished all 24 episodes in about a second, before such a
snapshot was published, and the test failed on a run that had done nothing wrong."""


@pytest.fixture
def policy() -> Iterator[tuple[str, CallLog]]:
    settings = PolicySettings(
        seed=0, latency_ms=POLICY_LATENCY_MS, error_rate=0.0, tool_turns=TOOL_TURNS
    )
    log = CallLog(create_policy_app(settings))
    with serve_app(log) as url:  # type: ignore[arg-type]
        yield f"{url}/v1", log


def write_config(tmp_path: Path, **overrides: object) -> Path:
    fields: dict[str, object] = {
        "environment": REF,
        "dataset": str(TASKS),
        "group_size": GROUP_SIZE,
        "max_turns": 10,
        "policy": {"latency_ms": 40, "error_rate": 0, "tool_turns": TOOL_TURNS},
        "snapshot": {"every_seconds": 0.3},
        **overrides,
    }
    # The dataset holds the tasks: no "tasks" key, as a user's config has none.
    return write_job_config(tmp_path, unset=["tasks"], **fields)


@pytest.fixture
def sandbox_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The servers' sandboxes, and the final trees, under the test's folder."""
    monkeypatch.setenv("SANDBOX_ROOT", str(tmp_path / "sandboxes"))
    monkeypatch.setenv("SANDBOX_KEEP_FINAL", str(tmp_path / "final"))
    return tmp_path / "final"


# ---- conformance -------------------------------------------------------------------------
def test_rollpoint_conformance_passes_on_every_sandbox_server(
    tmp_path: Path, sandbox_dirs: Path
) -> None:
    config = write_config(tmp_path, replicas=1)
    with served(config) as deployment:
        (replica,) = deployment["replicas"]
        token_file = deployment["control_token_file"]
        for role in ("resources_url", "model_url", "agent_url"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rollpoint",
                    "conformance",
                    replica[role],
                    "--token-file",
                    token_file,
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{role}: {done.stdout[-3000:]}{done.stderr[-2000:]}"
            report = orjson.loads(done.stdout)
            failed = [c for c in report["cases"] if not c["passed"]]
            assert report["cases"] and failed == [], f"{role}: {failed}"


# ---- a crash -----------------------------------------------------------------------------
def _calls(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """Every tool call of a transcript with its arguments and the result it got."""
    return [(c.name, c.arguments, c.result) for c in tool_calls(messages)]


def expected_tree(task: TaskRow, messages: list[dict[str, Any]]) -> tuple[bytes, int]:
    """The tree a rollout's successful calls build from the task's files, and its appends."""
    files = {p: str(t).encode() for p, t in dict(task.params["files"]).items()}  # type: ignore[arg-type]
    appends = 0
    for name, args, result in _calls(messages):
        if result.startswith("error"):
            continue
        if name == "fs_write":
            files[args["path"]] = args["content"].encode()
        elif name == "fs_append":
            files[args["path"]] = files.get(args["path"], b"") + (args["line"] + "\n").encode()
            appends += 1
    return pack_tree(files), appends


def crash_and_rerun_sandbox(
    config: Path, workdir: Path, *, depth: int = 1
) -> list[invariants.TrainedRollout]:
    """SIGKILL the run once a snapshot after its first train checkpoint holds an episode
    ``depth`` turns in with a policy call left (the newest one: the rerun restores from it,
    and continues the episode with a call), rerun it to the end; the rollouts it trained,
    each row once (checked), some of them continued."""
    crash_and_rerun(config, workdir, depth=depth, most=TOOL_TURNS, rerun_timeout_s=90)
    return trained_once(workdir, load_tasks(TASKS, environment=REF), GROUP_SIZE)


def test_sigkill_and_rerun_trains_every_row_once_applies_each_append_once_and_regenerates_nothing(
    tmp_path: Path, sandbox_dirs: Path, policy: tuple[str, CallLog]
) -> None:
    policy_url, log = policy
    config = write_config(tmp_path, policy={"base_url": policy_url})
    rollouts = crash_and_rerun_sandbox(config, tmp_path / "run")
    tasks = {t.task_id: t for t in load_tasks(TASKS, environment=REF)}

    # No append applied twice: from the final trees the environment itself wrote.
    kept = {p.name for p in sandbox_dirs.glob("*.tar")}
    appends = 0
    for r in rollouts:
        tree, made = expected_tree(tasks[r.task_id], r.messages)
        name = f"{r.task_id}-{hashlib.sha256(tree).hexdigest()}.tar"
        assert name in kept, f"{r.subject}: its final tree is not the one its calls build"
        appends += made
    assert appends > 0, "no append happened: the check above proved nothing"

    # Continued episodes not regenerated: from the policy's own log.
    asked = log.counts()
    kept_turns = [
        (r, call.turn)
        for r in rollouts
        if r.attempt >= 1 and r.model_calls is not None
        for call in r.model_calls
        if call.attempt < r.attempt
    ]
    assert kept_turns, "no continued rollout kept a turn from before the cut"
    regenerated = [
        f"{r.subject} turn {turn}: asked {asked[(episode_seed(r.rollout_id), turn)]} times"
        for r, turn in kept_turns
        if asked[(episode_seed(r.rollout_id), turn)] != 1
    ]
    assert regenerated == [], "\n".join(regenerated)


# ---- an author's mistake -------------------------------------------------------------------
FLAKY_ENV = '''
from sandbox_env import SandboxEnvironment


class FlakyExport(SandboxEnvironment):
    """One task's episodes export a set (not JSON-safe) once a tool touched them; such an
    episode lives a few turns, so a snapshot or two fail, then the others go through."""

    def capture_state(self, state):
        made = super().capture_state(state)
        if all(r.path != "license.txt" for r in state.requirements):
            return made
        return lambda: {**made(), "seen": {1, 2}}
'''


def test_an_export_that_is_not_json_safe_fails_that_snapshot_and_the_run_goes_on(
    tmp_path: Path, sandbox_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "flaky_env.py").write_text(FLAKY_ENV)
    monkeypatch.setenv("PYTHONPATH", f"{plugins}:{':'.join(sys.path)}")
    config = write_config(
        tmp_path,
        environment="flaky_env:FlakyExport",
        policy={"latency_ms": 40, "error_rate": 0, "tool_turns": 6},
        # However slow this machine makes those episodes, failed snapshots never end the run.
        snapshot={"every_seconds": 0.3, "retry_after_seconds": 600},
    )
    run = RunProcess(config)
    finished = run.finish(timeout_s=240)

    assert finished.returncode == 0, finished.stderr[-3000:]
    workdir = tmp_path / "run"
    trained_once(workdir, load_tasks(TASKS, environment=REF), GROUP_SIZE)
    events = [orjson.loads(line) for line in (workdir / "metrics.jsonl").read_bytes().splitlines()]
    snapshots = [e for e in events if e.get("event") == "snapshot"]
    failed = [e for e in snapshots if e["outcome"] == "failed"]
    assert failed, "no snapshot failed: the bad export was never written"
    detail = str(failed[0].get("detail"))
    assert re.search(
        r"packed state of rollout \S+ could not be made: environment 'sandbox': export_state"
        r" returned data that is not JSON-safe \(Type is not JSON serializable: set\)",
        detail,
    ), detail
    assert any(e["outcome"] == "published" and e["ts"] > failed[-1]["ts"] for e in snapshots), (
        "no snapshot was published after the failed one"
    )


# ---- a custom agent loop -------------------------------------------------------------------
LOOP = "sandbox_env.summary_loop:SummarizingLoop"


def test_a_custom_loop_gets_its_state_back_after_sigkill_and_rerun(
    tmp_path: Path, sandbox_dirs: Path, policy: tuple[str, CallLog]
) -> None:
    from sandbox_env.summary_loop import SummarizingLoop

    policy_url, log = policy
    config = write_config(tmp_path, policy={"base_url": policy_url}, agent_loop=LOOP)
    # Killed with an episode past a fold, whose next call the rerun makes from the summary.
    rollouts = crash_and_rerun_sandbox(config, tmp_path / "run", depth=SummarizingLoop.every)

    # Every request the policy got is what the loop makes from the transcript, its state
    # threaded turn by turn from the start: a restore that lost the state (or handed back
    # another) would have sent a prompt without the summary it had.
    loop = SummarizingLoop()
    resumed_with_summary = 0
    for r in rollouts:
        assistants = [i for i, m in enumerate(r.messages) if m["role"] == "assistant"]
        expected, state = [], None
        for turn, index in enumerate(assistants):
            sent, state = loop.prompt(state, r.messages[:index], turn)
            expected.append(sent)
        logged = log.sent[episode_seed(r.rollout_id)]
        stray = [m for m in logged if m not in expected]
        assert stray == [], f"{r.subject}: the policy was sent a prompt the loop does not make"
        assert r.model_calls is not None
        # None: the last attempt made no policy call (saved after its final answer, it
        # only had its check left to run).
        first_after = min((c.turn for c in r.model_calls if c.attempt == r.attempt), default=None)
        if r.attempt >= 1 and first_after is not None and first_after >= SummarizingLoop.every:
            assert expected[first_after][1]["content"].startswith("Summary of the earlier steps")
            resumed_with_summary += 1
    assert resumed_with_summary > 0, "no rollout continued past a fold: nothing was restored"
