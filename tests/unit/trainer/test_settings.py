"""The trainer library's settings: what ``rollpoint run``'s config tells it, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpoint.app.config import parse_config
from rollpoint.protocol.errors import ConfigError
from rollpoint.trainer import SaveSettings, TrainerSettings


def test_a_run_config_tells_the_trainer_each_of_its_keys(tmp_path: Path) -> None:
    config = parse_config(
        {
            "workdir": str(tmp_path),
            "environment": "workplace",
            "tasks": 5,
            "group_size": 3,
            "max_turns": 7,
            "concurrency": 9,
            "row_timeout_seconds": 12.5,
            "train": {"batch_size": 6, "checkpoint_every_steps": 2, "step_seconds": 0.25},
            "snapshot": {
                "every_seconds": 4,
                "deadline_seconds": 8,
                "retry_after_seconds": 3,
                "allow_restart_only": True,
            },
        }
    )
    assert config.trainer_settings() == TrainerSettings(
        workdir=tmp_path,
        group_size=3,
        concurrency=9,
        max_turns=7,
        batch_size=6,
        checkpoint_every_steps=2,
        row_timeout_seconds=12.5,
        snapshot_every_seconds=4,
        save=SaveSettings(deadline_seconds=8, retry_after_seconds=3, allow_restart_only=True),
        fingerprint=config.fingerprint(),
    )
    assert config.fingerprint()["group_size"] == 3 and config.fingerprint()["tasks"] == 5


def test_the_defaults_are_the_configs(tmp_path: Path) -> None:
    config = parse_config({"workdir": str(tmp_path)})
    ours = TrainerSettings(workdir=tmp_path, fingerprint=config.fingerprint())
    assert config.trainer_settings() == ours
    assert config.snapshot.save_settings() == SaveSettings()


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: SaveSettings(deadline_seconds=0), "deadline_seconds"),
        (lambda: SaveSettings(deadline_seconds=3600), "deadline_seconds"),
        (lambda: SaveSettings(retry_after_seconds=-1), "retry_after_seconds"),
        (lambda: SaveSettings(retry_after_seconds=float("nan")), "retry_after_seconds"),
        (lambda: TrainerSettings(workdir=Path("w"), group_size=0), "group_size"),
        (lambda: TrainerSettings(workdir=Path("w"), batch_size=0), "batch_size"),
        (lambda: TrainerSettings(workdir=Path("w"), checkpoint_every_steps=0), "checkpoint_every"),
        (lambda: TrainerSettings(workdir=Path("w"), row_timeout_seconds=0), "row_timeout"),
        (lambda: TrainerSettings(workdir=Path("w"), snapshot_every_seconds=0), "snapshot_every"),
    ],
)
def test_a_value_the_config_would_refuse_is_refused_naming_the_field(
    build: object, field: str
) -> None:
    assert callable(build)
    with pytest.raises(ConfigError, match=field) as caught:
        build()
    assert "\n" not in caught.value.message
