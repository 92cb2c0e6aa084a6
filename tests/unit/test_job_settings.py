"""The job's settings: what ``rollpoint run``'s config tells the job and the façade (neither
reads the config), what they refuse, and the façade taking either form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import rollpoint
from rollpoint.app.config import parse_config
from rollpoint.job.settings import JobSettings, settings_of
from rollpoint.job.tasks import load_tasks_for
from rollpoint.protocol.deployment import ServedDeployment
from rollpoint.protocol.errors import ConfigError
from rollpoint.rollouts import attached_settings
from rollpoint.runtime.settings import RuntimeSettings
from rollpoint.trainer.settings import TrainerSettings
from tests.support.job_config import job_config
from tests.unit.test_trainer_facade import SERVED


def test_a_run_config_tells_the_job_each_of_its_keys(tmp_path: Path) -> None:
    config = parse_config(
        {
            "workdir": str(tmp_path / "run"),
            "environment": "math",
            "tasks": 5,
            "seed": 3,
            "recovery": "restart",
            "snapshot": {"store": str(tmp_path / "store"), "keep": 7},
            "preemption": {"grace_seconds": 4.5},
            "metrics": {"port": 9123},
        }
    )
    settings = config.job_settings()
    assert settings == JobSettings(
        runtime=config.runtime_settings(),
        trainer=dataclasses.replace(config.trainer_settings(), fingerprint={}),
        tasks=5,
        dataset=None,
        snapshot_store=str(tmp_path / "store"),
        snapshot_keep=7,
        continue_episodes=False,
        grace_seconds=4.5,
        metrics_host="127.0.0.1",
        metrics_port=9123,
        record=config.model_dump(mode="json"),
    )
    assert settings.workdir == tmp_path / "run"
    assert settings.environment == "math"
    assert settings.snapshot_root() == str(tmp_path / "store")
    assert settings.fingerprint() == config.fingerprint()


def test_the_tasks_come_from_the_settings_environment_and_seed(tmp_path: Path) -> None:
    config = job_config(tmp_path, environment="math", tasks=3, seed=11)
    tasks = load_tasks_for(config.job_settings())
    assert [t.environment for t in tasks] == ["math"] * 3
    assert tasks == load_tasks_for(config.job_settings())  # the seed makes the same rows
    other = load_tasks_for(job_config(tmp_path / "b", environment="math", tasks=3).job_settings())
    assert [t.params for t in tasks] != [t.params for t in other]


def test_the_fingerprint_follows_the_settings_not_what_the_trainer_was_told(
    tmp_path: Path,
) -> None:
    settings = JobSettings(
        runtime=RuntimeSettings(workdir=tmp_path, environment="blackjack", seed=4),
        trainer=TrainerSettings(workdir=tmp_path, group_size=3, fingerprint={"stale": 1}),
        tasks=2,
    )
    assert settings.fingerprint() == {
        "environment": "blackjack",
        "group_size": 3,
        "max_turns": 8,
        "replicas": 2,
        "tasks": 2,
        "dataset": None,
        "dataset_content_sha256": None,
        "seed": 4,
    }
    more = dataclasses.replace(settings, tasks=7)
    assert more.fingerprint()["tasks"] == 7


def test_settings_whose_parts_name_two_workdirs_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the runtime's workdir .*/a is not the trainer's .*/b"):
        JobSettings(
            runtime=RuntimeSettings(workdir=tmp_path / "a"),
            trainer=TrainerSettings(workdir=tmp_path / "b"),
        )
    with pytest.raises(ConfigError, match="give either tasks or dataset"):
        JobSettings(
            runtime=RuntimeSettings(workdir=tmp_path),
            trainer=TrainerSettings(workdir=tmp_path),
            tasks=None,
        )


def test_settings_built_in_code_record_themselves_as_json(tmp_path: Path) -> None:
    settings = JobSettings(
        runtime=RuntimeSettings(workdir=tmp_path, environment="blackjack"),
        trainer=TrainerSettings(workdir=tmp_path, group_size=3),
        tasks=2,
    )
    recorded = settings.recorded()
    assert recorded["runtime"]["environment"] == "blackjack"  # type: ignore[index,call-overload]
    assert recorded["trainer"]["group_size"] == 3  # type: ignore[index,call-overload]
    assert recorded["runtime"]["workdir"] == str(tmp_path)  # type: ignore[index,call-overload]
    assert settings.snapshot_root() == str((tmp_path / "snapshots").resolve())


def test_attached_servers_store_is_taken_unless_the_settings_name_one(tmp_path: Path) -> None:
    served = ServedDeployment.model_validate_json(SERVED)  # its store: /w/snapshots
    own = job_config(tmp_path).job_settings()
    assert attached_settings(own, served).snapshot_root() == "/w/snapshots"
    named = dataclasses.replace(own, snapshot_store="/mine")
    assert attached_settings(named, served).snapshot_root() == "/mine"
    unnamed = served.model_copy(update={"snapshot_store": None})
    assert attached_settings(own, unnamed) is own


def test_the_facade_takes_a_run_config_or_its_settings_and_nothing_else(tmp_path: Path) -> None:
    config = job_config(tmp_path)
    assert rollpoint.Rollouts(config).settings == config.job_settings()
    changed = dataclasses.replace(config.job_settings(), snapshot_keep=1)
    assert rollpoint.Rollouts(changed).settings is changed
    assert settings_of(config, "here") == config.job_settings()
    with pytest.raises(ConfigError, match=r"^Rollouts: takes a RunConfig .* not dict$"):
        rollpoint.Rollouts({"workdir": "x"})  # type: ignore[arg-type]
