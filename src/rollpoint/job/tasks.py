"""A run's tasks: where they come from, and that each is for the run's environment.

Owns :func:`load_tasks_for` (the rows of the settings' dataset, or the synthetic tasks
their environment makes) and :func:`check_environment`, which refuses rows for another
environment in one line naming the first (a dataset's, or rows a trainer adds while the
run goes on).
"""

from __future__ import annotations

from rollpoint.job.settings import JobSettings
from rollpoint.protocol.episode import TaskRow
from rollpoint.protocol.errors import ConfigError, RollpointError


def load_tasks_for(settings: JobSettings) -> list[TaskRow]:
    """The run's rows: its dataset's, or ``settings.tasks`` made by its environment."""
    from rollpoint.envs import get_environment
    from rollpoint.envs.dataset_formats import dataset_name, load_dataset_tasks

    if settings.dataset is not None:
        tasks = load_dataset_tasks(settings.dataset, settings.environment)
        check_environment(settings.environment, tasks, dataset_name(settings.dataset))
        return tasks
    assert settings.tasks is not None  # JobSettings refuses neither
    return get_environment(settings.environment).make_tasks(settings.tasks, settings.runtime.seed)


def check_environment(
    environment: str,
    tasks: list[TaskRow],
    where: str,
    error: type[RollpointError] = ConfigError,
) -> None:
    """Every task is for ``environment``, or one line names the first that is not."""
    from rollpoint.envs.registry import environment_matches, resolve_environment

    cls = resolve_environment(environment)
    wrong = [t.task_id for t in tasks if not environment_matches(t.environment, cls, resolve=True)]
    if wrong:
        raise error(f"{where}: task {wrong[0]} is for another environment than '{environment}'")
