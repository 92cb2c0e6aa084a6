"""The ``rollpoint`` command answers ``--help`` and ``version`` without loading the job.

Each check runs in a fresh interpreter: the test process itself has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

# What a run needs and ``--help`` does not: the trainer, the HTTP stacks, Ray, the servers.
HEAVY = (
    "rollpoint.trainer",
    "rollpoint.job.run",
    "rollpoint.participant",
    "rollpoint.servers",
    "aiohttp",
    "fastapi",
    "ray",
    "uvicorn",
    "starlette",
    "prometheus_client",
    "asyncio",
    "yaml",
)


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_importing_the_cli_loads_no_trainer_http_stack_or_ray() -> None:
    assert _heavy(_loaded_after("import rollpoint.app.cli")) == []


def test_help_and_version_load_no_trainer_http_stack_or_ray() -> None:
    for argv in (["--help"], ["version"], ["--version"], ["run", "--help"]):
        code = (
            "import sys\nfrom rollpoint.app.cli import app\n"
            f"sys.argv = ['rollpoint', *{argv!r}]\n"
            "try:\n    app()\nexcept SystemExit:\n    pass"
        )
        assert _heavy(_loaded_after(code)) == [], argv
