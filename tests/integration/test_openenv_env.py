"""The ``openenv:`` adapter against a real OpenEnv server: the echo environment made by
``openenv init`` (tests/support/openenv_echo.py), served by the adapter in a child process.

What the server itself says is the evidence: each step's reply carries the environment's own
step number (``metadata.step``) and its ``state`` has ``step_count`` and ``episode_id``; a
step replayed twice or lost shows there, not only in what the adapter kept.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.envs import get_environment
from rollpoint.envs.openenv_env import STEP_TOOL, OpenEnvEnvironment, OpenEnvEpisode
from rollpoint.envs.openenv_session import _wait
from rollpoint.protocol.errors import (
    ConfigError,
    EpisodeError,
    InvalidCheckpointStateError,
    ToolArgumentError,
)
from tests.support.openenv_echo import APP, REFERENCE, make_echo_env

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    parent = tmp_path_factory.mktemp("openenv")
    make_echo_env(parent)
    sys.path.insert(0, str(parent))
    try:
        yield parent
    finally:
        sys.path.remove(str(parent))


@pytest.fixture(scope="module")
def env(echo_dir: Path) -> OpenEnvEnvironment:
    made = get_environment(REFERENCE)
    assert isinstance(made, OpenEnvEnvironment)
    return made


def step(env: OpenEnvEnvironment, state: OpenEnvEpisode, message: str) -> dict[str, Any]:
    tool = env.tool_table()[STEP_TOOL]
    reply: dict[str, Any] = orjson.loads(
        asyncio.run(tool.run(state, tool.parse({"message": message})))  # type: ignore[arg-type]
    )
    return reply


def server_state(state: OpenEnvEpisode) -> dict[str, Any]:
    """The environment's own ``state``, asked of the server on the episode's session."""
    return _wait(state.client.ask("state"))


def test_the_step_tool_is_the_servers_action_schema(env: OpenEnvEnvironment) -> None:
    (spec,) = env.tools()
    parameters = spec["function"]["parameters"]  # type: ignore[index]
    assert parameters["properties"].keys() == {"message"}  # type: ignore[index,union-attr]
    assert parameters["required"] == ["message"]  # type: ignore[index]


def test_an_episode_steps_on_its_own_session_and_the_server_counts_each_step(
    env: OpenEnvEnvironment,
) -> None:
    task_a, task_b = env.make_tasks(2, 0)
    a, b = env.start(task_a), env.start(task_b)
    try:
        assert step(env, a, "hi")["observation"]["metadata"]["step"] == 1
        assert step(env, a, "hello")["observation"]["metadata"]["step"] == 2
        assert step(env, b, "x")["observation"]["metadata"]["step"] == 1
        assert server_state(a) == {"episode_id": a.episode_id, "step_count": 2}
        assert server_state(b) == {"episode_id": b.episode_id, "step_count": 1}
    finally:
        env.close(a)
        env.close(b)


def test_a_refused_action_is_the_models_error_and_no_step(env: OpenEnvEnvironment) -> None:
    (task,) = env.make_tasks(1, 1)
    state = env.start(task)
    try:
        tool = env.tool_table()[STEP_TOOL]
        with pytest.raises(ToolArgumentError, match="openenv_step"):
            asyncio.run(tool.run(state, tool.parse({"text": "no such field"})))  # type: ignore[arg-type]
        with pytest.raises(ToolArgumentError, match="metadata"):
            tool.parse({"message": "m", "metadata": {}})
        assert state.actions == []
        assert server_state(state)["step_count"] == 0
    finally:
        env.close(state)


def test_restore_replays_the_actions_and_the_episode_goes_on_at_its_step(
    env: OpenEnvEnvironment,
) -> None:
    (task,) = env.make_tasks(1, 2)
    state = env.start(task)
    step(env, state, "one")
    step(env, state, "two")
    saved = env.export_state(state)
    env.close(state)  # the session is gone, as after a crash

    restored = env.restore_state(task, orjson.loads(orjson.dumps(saved)))
    try:
        assert (restored.replayed, restored.restarts) == (2, 0)
        assert server_state(restored) == {"episode_id": state.episode_id, "step_count": 2}
        reply = step(env, restored, "three")
        assert reply["step"] == 3 and "notice" not in reply
        assert reply["observation"]["metadata"]["step"] == 3, "the server's own count went on"
        detail = env.verify(restored, task, "done").detail
        assert detail["server_state"] == {"episode_id": state.episode_id, "step_count": 3}
        assert (detail["replayed"], detail["restarts"]) == (2, 0)
    finally:
        env.close(restored)


def test_a_replay_that_answers_otherwise_restarts_the_episode_and_says_so(
    env: OpenEnvEnvironment,
) -> None:
    (task,) = env.make_tasks(1, 3)
    state = env.start(task)
    step(env, state, "one")
    step(env, state, "two")
    saved = env.export_state(state)
    env.close(state)
    # As if the environment had answered the second action otherwise before the crash.
    saved["trace"][1][0]["echoed_message"] = "not what it says now"  # type: ignore[index,call-overload]

    restored = env.restore_state(task, saved)
    try:
        assert (restored.actions, restored.restarts, restored.replayed) == ([], 1, 2)
        assert server_state(restored)["step_count"] == 0, "a fresh start, not the replayed one"
        reply = step(env, restored, "again")
        assert "restarted" in reply["notice"] and reply["observation"]["metadata"]["step"] == 1
        assert env.verify(restored, task, None).detail["restarts"] == 1
    finally:
        env.close(restored)


def test_restart_mode_never_replays_and_reports_the_restart(echo_dir: Path) -> None:
    env = get_environment(f"{REFERENCE}@restart")
    (task,) = env.make_tasks(1, 4)
    state = env.start(task)
    step(env, state, "one")
    saved = env.export_state(state)
    env.close(state)
    restored = env.restore_state(task, saved)
    try:
        assert (restored.actions, restored.restarts, restored.replayed) == ([], 1, 0)
        assert server_state(restored)["step_count"] == 0
        assert "restarted" in step(env, restored, "x")["notice"]
    finally:
        env.close(restored)


def test_a_step_on_a_lost_session_fails_the_episode_instead_of_opening_another(
    env: OpenEnvEnvironment,
) -> None:
    # OpenEnv's own client would reconnect to a new, never reset environment on its own.
    (task,) = env.make_tasks(1, 5)
    state = env.start(task)
    step(env, state, "one")
    _wait(state.client.close())
    with pytest.raises(EpisodeError, match="session was lost"):
        step(env, state, "two")
    assert state.actions == [{"message": "one"}]


def test_a_saved_state_that_does_not_fit_the_task_is_refused_in_one_line(
    env: OpenEnvEnvironment,
) -> None:
    task, other = env.make_tasks(2, 6)
    state = env.start(task)
    saved = env.export_state(state)
    env.close(state)
    with pytest.raises(InvalidCheckpointStateError, match="does not fit the task"):
        env.restore_state(other, saved)
    with pytest.raises(InvalidCheckpointStateError, match="'actions'"):
        env.restore_state(task, {**saved, "actions": "x"})


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("openenv:", "want openenv:<module>:<app>"),
        ("openenv:server.app:app@later", "want openenv:<module>:<app>"),
        ("openenv:no_such_module_here:app", "did not start"),
    ],
)
def test_a_bad_reference_is_one_config_error(ref: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_environment(ref).tools()


def _state_of(pid: int) -> str | None:
    """The process's state letter (``Z``: a zombie, ended), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_the_server_a_process_started_ends_when_that_process_is_killed(echo_dir: Path) -> None:
    code = (
        "import sys, time\n"
        "from rollpoint.envs.openenv_server import _SERVERS, server_url\n"
        f"print(server_url({APP!r}, 'test'), _SERVERS[{APP!r}].proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        cwd=echo_dir,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(echo_dir), *sys.path])},
    )
    try:
        assert parent.stdout is not None
        _url, pid = parent.stdout.readline().decode().split()
        assert _state_of(int(pid)) not in (None, "Z"), "the server is not running"
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 60
        while _state_of(int(pid)) not in (None, "Z"):
            assert time.monotonic() < deadline, f"the OpenEnv server {pid} outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)


@pytest.mark.parametrize(
    ("app", "environ", "gradio"),
    [
        (APP, {}, False),
        # The app imports gradio itself: it gets it.
        ("app_with_ui:app", {}, True),
        # OpenEnv's web interface asked for: gradio as OpenEnv imports it.
        (APP, {"ENABLE_WEB_INTERFACE": "true"}, True),
    ],
)
def test_the_server_child_imports_its_app_without_gradio_unless_something_needs_it(
    echo_dir: Path, app: str, environ: dict[str, str], gradio: bool
) -> None:
    (echo_dir / "app_with_ui.py").write_text("import gradio\nfrom echo_env.server.app import app\n")
    code = (
        "import sys\n"
        "from rollpoint.envs.openenv_server import import_app\n"
        "app = import_app(sys.argv[1])\n"
        "print(type(app).__name__, sys.modules.get('gradio') is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, app],
        capture_output=True,
        text=True,
        cwd=echo_dir,
        env={
            **os.environ,
            **environ,
            "PYTHONPATH": os.pathsep.join([str(echo_dir), *sys.path]),
        },
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["FastAPI", str(gradio)]
