"""What a job is told of a run, typed: :class:`JobSettings`, and :class:`JobConfig`, what can
say its settings.

The job and the façade read no run config. They are told what they need: the runtime's
settings (:class:`~rollpoint.runtime.settings.RuntimeSettings`: what servers to start, and
where), the trainer's (:class:`~rollpoint.trainer.settings.TrainerSettings`), where the
run's tasks come from, where snapshots go and how many stay, how a restore treats the
episodes it finds, the grace a signal gives, the trainer's metrics endpoint, and what the
run's event log records as its config. ``rollpoint run``'s YAML builds them
(:meth:`RunConfig.job_settings() <rollpoint.app.config.RunConfig.job_settings>`), so a
:class:`~rollpoint.RunConfig` is a :class:`JobConfig`; an embedding builds them in code, or
changes a loaded config's with :func:`dataclasses.replace`.

The values are taken as given (the run config checked them, and each server checks its own
as it starts); only what would make the parts disagree is refused here, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import JsonValue
from pydantic_core import to_jsonable_python

from rollpoint.envs.dataset_formats import DatasetSpec
from rollpoint.protocol.errors import ConfigError
from rollpoint.runtime.settings import RuntimeSettings
from rollpoint.trainer.settings import TrainerSettings

__all__ = ["JobConfig", "JobSettings", "settings_of"]


@dataclass(frozen=True, slots=True)
class JobSettings:
    """One run: the servers to start (``runtime``), the trainer (``trainer``), its tasks,
    its snapshots, and how it restores and stops."""

    runtime: RuntimeSettings
    trainer: TrainerSettings
    """Its ``fingerprint`` is the job's to set: :meth:`fingerprint`, as the run starts."""
    tasks: int | None = 32
    """Synthetic tasks the environment makes (``make_tasks(tasks, runtime.seed)``); ignored
    when ``dataset`` is given. 0 only for a run handed its groups while it runs."""
    dataset: Path | DatasetSpec | None = None
    """The run's task rows: a JSONL file, or a Parquet or Hugging Face dataset."""
    snapshot_store: str | None = None
    """A path or fsspec URL; None keeps snapshots under ``<workdir>/snapshots``."""
    snapshot_keep: int = 3
    """Published snapshots kept (older ones are deleted as new ones publish)."""
    continue_episodes: bool = True
    """A restore continues each saved episode from its last completed turn; False starts
    every unfinished episode over (``recovery: restart``)."""
    grace_seconds: float = 25.0
    """From a stop request's first signal to the run's end (one last snapshot)."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    """The trainer's Prometheus ``/metrics`` (0: a free port, said at start)."""
    record: Mapping[str, JsonValue] | None = None
    """The config the run's event log records at each start (``rollpoint report`` shows
    it; secrets are redacted as it is written). None: these settings, as JSON."""

    def __post_init__(self) -> None:
        if self.runtime.workdir != self.trainer.workdir:
            raise ConfigError(
                f"job settings: the runtime's workdir {self.runtime.workdir} is not the "
                f"trainer's {self.trainer.workdir}"
            )
        if self.tasks is None and self.dataset is None:
            raise ConfigError("job settings: give either tasks or dataset")

    @property
    def workdir(self) -> Path:
        return self.trainer.workdir

    @property
    def environment(self) -> str:
        return self.runtime.environment

    def snapshot_root(self) -> str:
        """Where snapshots go: ``snapshot_store``, or ``<workdir>/snapshots`` made absolute."""
        return self.snapshot_store or str((self.workdir / "snapshots").resolve())

    def fingerprint(self) -> dict[str, JsonValue]:
        """The keys a snapshot of this run depends on, from these settings (whatever
        ``trainer.fingerprint`` holds): what the job saves with every snapshot and checks a
        restore against (but ``replicas``: an elastic restore changes it). A dataset's files
        are hashed: one edited in place is not the one the snapshot saw."""
        from rollpoint.envs.dataset_formats import content_sha256, fingerprint_value

        dataset = self.dataset
        return {
            "environment": self.environment,
            "group_size": self.trainer.group_size,
            "max_turns": self.trainer.max_turns,
            "replicas": self.runtime.replicas,
            "tasks": self.tasks if dataset is None else None,
            "dataset": None if dataset is None else fingerprint_value(dataset),
            "dataset_content_sha256": None if dataset is None else content_sha256(dataset),
            "seed": self.runtime.seed,
        }

    def recorded(self) -> dict[str, JsonValue]:
        """What the run's event log records as its config (secrets not yet redacted)."""
        if self.record is not None:
            return dict(self.record)
        found = to_jsonable_python(self)
        assert isinstance(found, dict)
        return found

    def on_store(self, store: str) -> JobSettings:
        """These settings with snapshots kept at ``store`` (servers started apart write
        theirs there), unless they name a store already (then the job checks they agree)."""
        return self if self.snapshot_store else replace(self, snapshot_store=store)


@runtime_checkable
class JobConfig(Protocol):
    """What can say the settings of its job: :class:`~rollpoint.RunConfig` does."""

    def job_settings(self) -> JobSettings: ...


def settings_of(config: JobSettings | JobConfig, where: str) -> JobSettings:
    """``config``'s job settings; anything else is one :class:`ConfigError` line naming
    ``where`` it was given and what it was."""
    if isinstance(config, JobSettings):
        return config
    if isinstance(config, JobConfig):
        return config.job_settings()
    raise ConfigError(
        f"{where}: takes a RunConfig (rollpoint.load_config(path)) or JobSettings, "
        f"not {type(config).__name__}"
    )
