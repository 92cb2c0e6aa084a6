"""The OpenEnv environment the adapter's tests play: the echo environment that ``openenv init``
makes from the template the ``openenv`` package ships, made as its docs say.

``openenv init echo_env`` writes the environment (its ``EchoEnvironment``, models, client and
server app); the one change is the documented one, ``max_concurrent_envs`` raised from 1 so
that several episodes hold a WebSocket session each (docs/environments.md, "OpenEnv").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

APP = "echo_env.server.app:app"
REFERENCE = f"openenv:{APP}"


def make_echo_env(parent: Path, *, sessions: int = 64) -> Path:
    """``parent/echo_env``, made by OpenEnv's own CLI; ``parent`` goes on the import path."""
    subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(parent)],
        check=True,
        capture_output=True,
    )
    app = parent / "echo_env" / "server" / "app.py"
    text = app.read_text()
    assert "max_concurrent_envs=1," in text, "the template's app changed: update this helper"
    app.write_text(text.replace("max_concurrent_envs=1,", f"max_concurrent_envs={sessions},"))
    return parent / "echo_env"
