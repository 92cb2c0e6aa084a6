"""The run config of the small job most tests run: built in one place, each test naming what
it changes.

Owns :data:`SMALL_JOB` (the workplace environment, 4 tasks of 2 rows, 2 replicas, up to 8
turns, 8 in flight, the scripted policy with no latency and no errors, batches of 4) and
the two forms a test needs: :func:`write_job_config`, the YAML file ``rollpoint`` reads, and
:func:`job_config`, the parsed :class:`RunConfig` with its workdir made. An override
replaces a whole key (a section replaces its section); ``{}`` for a section is its defaults,
and a key named in ``unset`` is left out (the config's default, as if never written).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from rollpoint import parse_config
from rollpoint.app.config import RunConfig

SMALL_JOB: dict[str, Any] = {
    "environment": "workplace",
    "tasks": 4,
    "group_size": 2,
    "max_turns": 8,
    "replicas": 2,
    "concurrency": 8,
    "policy": {"latency_ms": 0, "error_rate": 0},
    "train": {"batch_size": 4},
}


def job_fields(folder: Path, unset: Iterable[str] = (), **overrides: Any) -> dict[str, Any]:
    """The small job's keys with ``overrides``, without ``unset``; its workdir
    ``folder/run`` unless given."""
    fields = {"workdir": str(folder / "run"), **SMALL_JOB, **overrides}
    for key in unset:
        del fields[key]
    return fields


def write_job_config(folder: Path, unset: Iterable[str] = (), **overrides: Any) -> Path:
    """The small job's config file, ``folder/job.yaml``."""
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job_fields(folder, unset, **overrides)))
    return path


def job_config(folder: Path, **overrides: Any) -> RunConfig:
    """The small job's config, parsed as ``rollpoint run`` parses it; its workdir made."""
    config = parse_config(job_fields(folder, **overrides))
    config.workdir.mkdir(parents=True, exist_ok=True)
    return config
