"""One writer per workdir, across commands: ``serve`` holds it as ``run`` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.serve_process import served

pytestmark = pytest.mark.process


def test_a_run_on_a_workdir_that_serve_holds_is_refused_before_touching_it(
    tmp_path: Path,
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {"workdir": str(tmp_path / "run"), "environment": "math", "tasks": 2, "replicas": 1}
        )
    )
    with served(config):
        holder = (tmp_path / "run" / ".rollpoint.lock").read_text().split()[0]
        token = (tmp_path / "run" / "control.token").read_bytes()
        refused = subprocess.run(
            [sys.executable, "-m", "rollpoint", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert (tmp_path / "run" / "control.token").read_bytes() == token

    assert refused.returncode == 1, refused.stderr
    assert f"is in use by process {holder} " in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "run" / "rollpoint.log").exists()
