"""Choosing a runtime and planning replicas: no cluster needed (these are not ``ray`` tests).

The ``ray:`` config section, the runtime ``config.runtime`` picks, the embedded path never
importing Ray, the replica plan both runtimes share, and the URLs an actor hands out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollpoint.app.config import parse_config
from rollpoint.protocol.errors import ConfigError
from rollpoint.runtime.contract import runtime_for
from rollpoint.runtime.embedded import EmbeddedRuntime
from rollpoint.runtime.replica_actor import advertised
from rollpoint.runtime.replica_plan import ReplicaPlan, replica_index, replica_of
from rollpoint.servers.agent.agent_server import AgentSettings


def test_the_ray_section_parses_and_defaults_to_a_local_instance() -> None:
    config = parse_config({"runtime": "ray", "ray": {"num_cpus_per_replica": 0.5}})
    assert (config.runtime, config.ray.address, config.ray.num_cpus_per_replica) == (
        "ray",
        None,
        0.5,
    )
    assert parse_config({"ray": {"address": "auto"}}).runtime == "embedded"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"runtime": "k8s"}, "key 'runtime'"),
        ({"ray": {"adress": "auto"}}, "unknown key 'ray.adress'"),
        ({"ray": {"num_cpus_per_replica": 0}}, "key 'ray.num_cpus_per_replica'"),
    ],
)
def test_a_bad_ray_setting_is_one_line_naming_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(raw)
    assert "\n" not in caught.value.message


def test_the_config_picks_the_runtime(tmp_path: Path) -> None:
    from rollpoint.runtime.ray_runtime import RayRuntime

    embedded = runtime_for(parse_config({"workdir": str(tmp_path)}).runtime_settings())
    on_ray = runtime_for(
        parse_config({"workdir": str(tmp_path), "runtime": "ray"}).runtime_settings()
    )
    assert isinstance(embedded, EmbeddedRuntime)
    assert isinstance(on_ray, RayRuntime)


def test_the_embedded_path_never_imports_ray() -> None:
    code = (
        "import sys, rollpoint.app.cli, rollpoint.job.run, rollpoint.runtime.contract; "
        "from rollpoint.app.config import parse_config; "
        "rollpoint.runtime.contract.runtime_for(parse_config({}).runtime_settings()); "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _plan(base_port: int | None, snapshot_root: str | None) -> ReplicaPlan:
    config = parse_config({"base_port": base_port} if base_port else {})
    return ReplicaPlan.of(
        config.runtime_settings(), policy_url="http://127.0.0.1:9/v1", snapshot_root=snapshot_root
    )


def test_a_replica_takes_its_fixed_ports_first_and_free_ones_when_restarted() -> None:
    plan = _plan(20000, None)
    first = plan.peer_specs(1, restarted=False)
    again = plan.peer_specs(1, restarted=True)
    agent = plan.agent_spec(1, model_url="m", resources_url="r", restarted=False)
    assert [s.port for s in first] + [agent.port] == [20004, 20005, 20006]
    assert [s.port for s in again] == [0, 0]
    assert [s.name for s in first] == ["resources-replica-1", "model-replica-1"]
    assert {replica_of(s.name) for s in [*first, agent]} == {"replica-1"}
    assert replica_index("replica-1") == 1


def test_servers_are_participants_only_with_a_snapshot_root() -> None:
    with_root = _plan(None, "/shared/snaps").peer_specs(0, restarted=False)
    without = _plan(None, None).peer_specs(0, restarted=False)
    assert all(s.settings["snapshot_root"] == "/shared/snaps" for s in with_root)
    assert all("snapshot_root" not in s.settings for s in without)


def test_the_upstream_cap_reaches_every_agent_and_its_settings() -> None:
    config = parse_config({"upstream_connections": 2000})
    plan = ReplicaPlan.of(
        config.runtime_settings(), policy_url="http://127.0.0.1:9/v1", snapshot_root=None
    )
    agent = plan.agent_spec(0, model_url="http://m", resources_url="http://r", restarted=False)
    assert AgentSettings.model_validate(agent.settings).upstream_connections == 2000
    uncapped = _plan(None, None).agent_spec(0, model_url="m", resources_url="r", restarted=False)
    assert uncapped.settings["upstream_connections"] is None


def test_a_plan_crosses_to_an_actor_as_json_unchanged() -> None:
    plan = _plan(20000, "s3://bucket/snaps")
    assert ReplicaPlan.model_validate_json(plan.model_dump_json()) == plan


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://0.0.0.0:8000", "http://10.1.2.3:8000"),
        ("http://[::]:8000/v1", "http://10.1.2.3:8000/v1"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://node-7:8000", "http://node-7:8000"),
    ],
)
def test_an_actor_hands_out_urls_other_nodes_can_reach(url: str, expected: str) -> None:
    assert advertised(url, "10.1.2.3") == expected


def test_the_store_credentials_are_what_the_actors_get_forwarded() -> None:
    from rollpoint.runtime.ray_runtime import forwarded_env

    environ = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_SECRET_ACCESS_KEY": "s",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
        "HOME": "/root",
        "ROLLPOINT_CONTROL_TOKEN": "t",
    }
    default = parse_config({}).ray.forward_env
    assert forwarded_env(default, environ) == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_SECRET_ACCESS_KEY": "s",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json",
    }
    assert forwarded_env(["HOME"], environ) == {"HOME": "/root"}
    assert forwarded_env([], environ) == {}
