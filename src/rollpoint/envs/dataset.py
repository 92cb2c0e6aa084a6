"""Task datasets on disk: JSONL files of :class:`TaskRow` objects, one per line.

Owns reading (and writing) those files with errors that name the file and the line. It
does not generate tasks (each environment's ``make_tasks`` does) or know about configs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import orjson
from pydantic import ValidationError

from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError


def _row_error(where: str, exc: ValidationError) -> ConfigError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<row>"
    if err["type"] == "extra_forbidden":
        return ConfigError(f"{where}: unknown key '{loc}'")
    return ConfigError(f"{where}: key '{loc}': {err['msg']}")


def _same_environment(row: str, wanted: str) -> bool:
    from rollpoint.envs.registry import environment_matches, resolve_environment

    return row == wanted or environment_matches(row, resolve_environment(wanted), resolve=True)


def load_tasks(path: Path, *, environment: str | None = None) -> list[TaskRow]:
    """Every task row of a JSONL file; blank lines are skipped.

    Raises :class:`ConfigError` naming the file and line for an unreadable file, a line
    that is not JSON or not a task row, a duplicate ``task_id``, a row of another
    ``environment`` than the one asked for, or a file with no rows.
    """
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read task dataset: {exc.strerror}") from None
    tasks: list[TaskRow] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: want a JSON object (a task row)")
        try:
            task = TaskRow.model_validate(data)
        except ValidationError as exc:
            raise _row_error(where, exc) from None
        if environment is not None and not _same_environment(task.environment, environment):
            raise ConfigError(
                f"{where}: task {task.task_id} is for {task.environment!r}, not {environment!r}"
            )
        if task.task_id in first_line:
            raise ConfigError(
                f"{where}: duplicate task_id {task.task_id!r} (first on line "
                f"{first_line[task.task_id]})"
            )
        first_line[task.task_id] = number
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"{path}: the task dataset has no rows")
    return tasks


def write_tasks(path: Path, tasks: Iterable[TaskRow]) -> None:
    """Write ``tasks`` as JSONL (what :func:`load_tasks` reads back)."""
    path.write_bytes(b"".join(orjson.dumps(t.model_dump(mode="json")) + b"\n" for t in tasks))
