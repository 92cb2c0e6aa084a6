"""``pip install rollpoint`` without extras: the library imports, and each extra's feature
refuses in one line naming it.

One virtual environment for the module, made without the system's site-packages, holding
only the core dependencies of pyproject.toml (read with tomllib, pinned by constraints.txt,
from the indexes pip is configured with, as ``make`` installs) and rollpoint itself, built
with ``--no-deps`` from a copy of the tree (a build in the work tree would leave ``build/``
and an egg-info there). pip's cache makes a second run fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpoint.common.extras import EXTRAS

# One worker runs the file: the module's virtual environment is made once.
pytestmark = [pytest.mark.process, pytest.mark.timeout(600), pytest.mark.xdist_group("no_extras")]

ROOT = Path(__file__).resolve().parents[2]

# Every module an extra brings, and what the extras brought in with them.
ABSENT = (*sorted({m for modules in EXTRAS.values() for m in modules}), "tenacity")


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        # --no-compile: no bytecode for the packages installed (the test imports a few
        # modules once; compiling them all cost most of the fixture's CPU).
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh virtual environment with rollpoint and its core only."""
    base = tmp_path_factory.mktemp("no-extras")
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True, timeout=120)
    python = base / "venv" / "bin" / "python"
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    _pip(python, "-c", str(ROOT / "constraints.txt"), *core)
    tree = base / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(
        ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    _pip(python, "--no-deps", str(tree))
    print(f"no-extras venv ready in {time.monotonic() - started:.1f}s")
    yield python


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    # Outside the work tree and with no PYTHONPATH, so only the installed copy is imported.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(argv[0]).parent,
        env=env,
    )


def _python(python: Path, code: str) -> str:
    done = _run(python, "-c", code)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip()


def test_the_extras_are_not_installed(venv: Path) -> None:
    probe = f"import importlib.util\nprint([m for m in {ABSENT!r} if importlib.util.find_spec(m)])"
    assert _python(venv, probe) == "[]"


def test_the_library_imports_without_extras(venv: Path) -> None:
    code = (
        "import sys\n"
        "import rollpoint, rollpoint.trainer, rollpoint.participant, rollpoint.envs\n"
        "import rollpoint.protocol, rollpoint.job.run, rollpoint.testing.conformance\n"
        "import rollpoint.servers.model.model_server, rollpoint.servers.agent.agent_server\n"
        "import rollpoint.servers.resources.resources_server\n"
        "from rollpoint.trainer import Trainer\n"
        "from rollpoint.trainer.state.ledger import RecoveryLedger\n"
        "from rollpoint.participant import Fence, mount_participant\n"
        "from rollpoint import Rollouts, ServedDeployment, TrainBatch, parse_config\n"
        "from rollpoint.envs import get_environment\n"
        "get_environment('workplace'), get_environment('math')\n"
        "print(rollpoint.__file__)"
    )
    where = _python(venv, code)
    assert where.startswith(str(venv.parents[1])), where  # the installed copy, not the tree


def _refusal(venv: Path, code: str) -> str:
    """What ``code`` raised: ``type: message`` of a RollpointError, on one line."""
    wrapped = (
        "from rollpoint.protocol.errors import RollpointError\n"
        f"try:\n    {code}\nexcept RollpointError as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\nelse:\n    print('no error')"
    )
    return _python(venv, wrapped)


def test_each_extra_is_named_when_its_feature_is_used(venv: Path) -> None:
    cases = {
        "from rollpoint.envs import get_environment; get_environment('blackjack')": (
            "the blackjack environment needs the 'gym' extra: pip install 'rollpoint[gym]'"
        ),
        "from rollpoint.envs import get_environment; get_environment('gymnasium:Taxi-v4')": (
            "environment 'gymnasium:Taxi-v4' needs the 'gym' extra: pip install 'rollpoint[gym]'"
        ),
        "from rollpoint.envs import get_environment;"
        " get_environment('verifiers:stardata.envs.constraint_gym')": (
            "environment 'verifiers:stardata.envs.constraint_gym' needs the 'verifiers' extra:"
            " pip install 'rollpoint[verifiers]'"
        ),
        "from rollpoint.envs import get_environment;"
        " get_environment('openenv:echo_env.server.app:app')": (
            "environment 'openenv:echo_env.server.app:app' needs the 'openenv' extra:"
            " pip install 'rollpoint[openenv]'"
        ),
        "from rollpoint.app.config import RunConfig; from rollpoint.runtime.contract import"
        " runtime_for; runtime_for(RunConfig(runtime='ray').runtime_settings())": (
            "the Ray runtime (runtime: ray) needs the 'ray' extra: pip install 'rollpoint[ray]'"
        ),
        "from rollpoint.trainer.metrics import TrainerMetrics; TrainerMetrics()": (
            "the trainer's metrics (a job's /metrics and snapshot timings) needs the 'metrics'"
            " extra: pip install 'rollpoint[metrics]'"
        ),
        "from rollpoint.http.server_metrics import ServerMetrics;"
        " ServerMetrics(server='model', replica='r0')": (
            "the model server's /metrics needs the 'metrics' extra:"
            " pip install 'rollpoint[metrics]'"
        ),
        "from rollpoint.envs.dataset_formats import DatasetSpec, load_dataset_tasks;"
        " load_dataset_tasks(DatasetSpec(path='train.parquet'), 'math')": (
            "a Parquet dataset needs the 'parquet' extra: pip install 'rollpoint[parquet]'"
        ),
        "from rollpoint.envs.dataset_formats import DatasetSpec, load_dataset_tasks;"
        " load_dataset_tasks(DatasetSpec(path='saved', format='hf'), 'math')": (
            "a Hugging Face dataset needs the 'datasets' extra: pip install 'rollpoint[datasets]'"
        ),
    }
    for code, message in cases.items():
        assert _refusal(venv, code) == f"ConfigError: {message}", code


def test_the_command_names_the_cli_extra(venv: Path) -> None:
    # The console script, and python -m rollpoint.
    for argv in ([venv.parent / "rollpoint", "version"], [venv, "-m", "rollpoint", "--help"]):
        done = _run(*argv)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            "error: the rollpoint command needs the 'cli' extra: pip install 'rollpoint[cli]'"
        ], done.stderr
