"""No secret on a command line: every process of a running job, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support.counting_policy import counting_policy
from tests.support.processes import children_of, servers_of
from tests.support.run_process import RunProcess

pytestmark = pytest.mark.process

API_KEY = "sk-test-6b1f0c2e9d8a4e37"


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


def test_no_token_nor_api_key_is_on_any_command_line_of_a_running_job(tmp_path: Path) -> None:
    with counting_policy(latency_ms=200) as (url, calls):
        config = tmp_path / "job.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "workdir": str(tmp_path / "run"),
                    "tasks": 8,
                    "group_size": 2,
                    "replicas": 2,
                    "concurrency": 4,
                    "policy": {"base_url": url, "api_key": API_KEY},
                    "snapshot": {"every_seconds": 1.0},
                }
            )
        )
        run = RunProcess(config)
        try:
            run.wait_until(lambda: calls.snapshot()[0] > 0, "a policy call", timeout_s=120)
            servers = servers_of(run.proc.pid)
            assert len(servers) == 3 * 2
            secrets = {API_KEY}
            # A forked server's environment is set in its memory, not where /proc reads it
            # (rollpoint.runtime.warm_start): the zygote's is read, which the launcher set.
            for pid in children_of(run.proc.pid):
                env = _environ(pid)
                secrets |= {
                    env[k] for k in ("ROLLPOINT_CONTROL_TOKEN", "ROLLPOINT_DATA_TOKEN") if k in env
                }
            assert len(secrets) == 3, "the servers did not get both tokens by environment"
            for pid in [run.proc.pid, *children_of(run.proc.pid), *servers]:
                line = _cmdline(pid)
                leaked = [s for s in secrets if s in line]
                assert not leaked, f"a secret is on the command line of {pid}: {line[:200]}"
            # The key still reaches the engine, by environment.
            assert f"Bearer {API_KEY}" in calls.authorizations
            assert all(Path(f"/proc/{p}/environ").stat().st_uid == os.getuid() for p in servers)
        finally:
            run.kill()
