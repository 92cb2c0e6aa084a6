"""Environment plugins: built-in names, entry points, import paths, and each way they fail."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollpoint.envs
import rollpoint.envs.registry as registry
from rollpoint.app.config import parse_config
from rollpoint.envs import (
    ConfigError,
    environment_matches,
    get_environment,
    load_tasks,
    resolve_environment,
    write_tasks,
)
from rollpoint.envs.workplace import WorkplaceEnvironment
from rollpoint.job.tasks import load_tasks_for

COUNTER_ENV = """
from typing import Any, ClassVar
from rollpoint.envs import CheckpointMode, Environment, TaskRow, VerifyReply

class CounterEnvironment(Environment[dict]):
    name: ClassVar[str] = "counter"
    checkpoint_mode: ClassVar[CheckpointMode] = CheckpointMode.TURN

    def _make_task(self, index, rng):
        return TaskRow(task_id=self.task_id(index), environment="counter", prompt="count")

    def start(self, task):
        return {"n": 0}

    def verify(self, state, task, final_message):
        return VerifyReply(reward=1.0)

    def export_state(self, state):
        return dict(state)

    def restore_state(self, task, exported):
        return dict(exported)
"""


@pytest.fixture(autouse=True)
def fresh_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Each test's modules and distributions live in its own folder on sys.path."""
    # Resolutions are kept per process: each test starts with none.
    monkeypatch.setattr(registry, "_RESOLVED", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("plug_"):
            del sys.modules[name]


def write_module(root: Path, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


def write_distribution(root: Path, dist: str, entries: dict[str, str]) -> None:
    """An installed distribution as importlib.metadata finds it: a .dist-info on sys.path."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[rollpoint.environments]\n{lines}")


def test_the_public_surface_is_pinned() -> None:
    assert rollpoint.envs.__all__ == [
        "ENTRY_POINT_GROUP",
        "CheckpointMode",
        "ConfigError",
        "Environment",
        "EpisodeError",
        "InDoubtEffect",
        "InvalidCheckpointStateError",
        "NoArguments",
        "Reconciled",
        "TaskRow",
        "Tool",
        "ToolArgumentError",
        "ToolArguments",
        "ToolContext",
        "VerifyReply",
        "environment_matches",
        "environment_names",
        "get_environment",
        "load_tasks",
        "resolve_environment",
        "slow_tool",
        "write_tasks",
    ]
    for name in rollpoint.envs.__all__:
        assert getattr(rollpoint.envs, name) is not None


def test_an_import_path_loads_the_class(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_counter", COUNTER_ENV)
    env = get_environment("plug_counter:CounterEnvironment")
    assert type(env).__name__ == "CounterEnvironment"
    assert env.name == "counter"
    config = parse_config({"environment": "plug_counter:CounterEnvironment", "tasks": 3})
    assert [t.task_id for t in load_tasks_for(config.job_settings())] == [
        "counter-0000",
        "counter-0001",
        "counter-0002",
    ]


def test_a_dataset_row_may_name_the_environment_by_its_name_or_its_path(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_rows", COUNTER_ENV)
    ref = "plug_rows:CounterEnvironment"
    env = get_environment(ref)
    tasks = env.make_tasks(2, seed=0)
    tasks[1] = tasks[1].model_copy(update={"environment": ref})
    write_tasks(tmp_path / "rows.jsonl", tasks)
    config = parse_config({"environment": ref, "dataset": str(tmp_path / "rows.jsonl")})
    assert load_tasks_for(config.job_settings()) == tasks
    assert environment_matches("counter", env) and environment_matches(ref, env)
    assert not environment_matches("workplace", env)
    assert load_tasks(tmp_path / "rows.jsonl", environment=ref) == tasks
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: task counter-0000 is for 'counter'"):
        load_tasks(tmp_path / "rows.jsonl", environment="workplace")


def test_an_unknown_name_says_what_was_tried() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"environment": "chess"})
    assert str(err.value) == (
        "config: key 'environment': unknown environment 'chess' (valid: blackjack, math,"
        " workplace; or an import path package.module:ClassName, gymnasium:<env id>,"
        " verifiers:<module>, mcp:<spec file>, openenv:<module>:<app>"
        " or nemo-gym:<url>@<rows.jsonl>)"
    )


def test_a_module_that_fails_to_import_is_named(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_broken", "import no_such_dependency_here\n")
    with pytest.raises(ConfigError) as err:
        parse_config({"environment": "plug_broken:Env"})
    assert str(err.value) == (
        "config: key 'environment': environment 'plug_broken:Env': cannot import module"
        " 'plug_broken' (ModuleNotFoundError: No module named 'no_such_dependency_here')"
    )
    with pytest.raises(ConfigError, match=r"cannot import module 'plug_absent' \(ModuleNotFound"):
        resolve_environment("plug_absent:Env")
    write_module(tmp_path, "plug_raises", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError, match=r"'plug_raises' \(RuntimeError: boom at import\)$"):
        resolve_environment("plug_raises:Env")


def test_a_missing_class_is_named(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_empty", "X = 1\n")
    with pytest.raises(
        ConfigError,
        match=r"^environment 'plug_empty:Env': module 'plug_empty' has no attribute 'Env'$",
    ):
        resolve_environment("plug_empty:Env")


@pytest.mark.parametrize(
    ("attr", "what"),
    [
        ("make", "a function"),
        ("NotAnEnv", "the class plug_things.NotAnEnv"),
        ("VALUE", "a int"),
    ],
)
def test_something_that_is_not_an_environment_is_refused(
    tmp_path: Path, attr: str, what: str
) -> None:
    write_module(
        tmp_path,
        "plug_things",
        "def make():\n    pass\nclass NotAnEnv:\n    name = 'x'\nVALUE = 3\n",
    )
    with pytest.raises(ConfigError) as err:
        resolve_environment(f"plug_things:{attr}")
    assert str(err.value) == (
        f"environment 'plug_things:{attr}': plug_things:{attr} is {what}, not a subclass of"
        " rollpoint.envs.Environment"
    )


def test_an_abstract_environment_is_refused(tmp_path: Path) -> None:
    write_module(
        tmp_path,
        "plug_abstract",
        "from rollpoint.envs import Environment\nclass Half(Environment):\n    name = 'half'\n",
    )
    with pytest.raises(ConfigError, match=r"plug_abstract:Half is abstract \(does not define "):
        resolve_environment("plug_abstract:Half")


def test_a_malformed_import_path_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"not an import path \(want package.module:ClassName\)"):
        resolve_environment("plug.:Env")


def test_an_installed_package_registers_a_name(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_dist", COUNTER_ENV)
    write_distribution(tmp_path, "counter_env", {"counter": "plug_dist:CounterEnvironment"})
    assert "counter" in rollpoint.envs.environment_names()
    assert get_environment("counter").name == "counter"
    assert parse_config({"environment": "counter"}).environment == "counter"


def test_a_registered_name_that_does_not_load_names_the_package(tmp_path: Path) -> None:
    write_distribution(tmp_path, "ghost_env", {"ghost": "plug_ghost:GhostEnvironment"})
    with pytest.raises(ConfigError) as err:
        resolve_environment("ghost")
    assert str(err.value) == (
        "environment 'ghost' (package ghost_env: plug_ghost:GhostEnvironment): cannot import"
        " module 'plug_ghost' (ModuleNotFoundError: No module named 'plug_ghost')"
    )


def test_two_packages_claiming_one_name_are_both_named(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_twice", COUNTER_ENV)
    write_distribution(tmp_path, "alpha_env", {"counter": "plug_twice:CounterEnvironment"})
    write_distribution(tmp_path, "beta_env", {"counter": "plug_twice:CounterEnvironment"})
    with pytest.raises(ConfigError) as err:
        parse_config({"environment": "counter"})
    assert str(err.value) == (
        "config: key 'environment': environment 'counter' is claimed by package alpha_env and"
        " package beta_env (entry-point group rollpoint.environments); name it by import path"
        " instead"
    )
    # The import path still works, and an unrelated name is not affected.
    assert get_environment("plug_twice:CounterEnvironment").name == "counter"
    assert isinstance(get_environment("workplace"), WorkplaceEnvironment)


def test_a_package_claiming_a_builtin_name_is_a_conflict(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_shadow", COUNTER_ENV)
    write_distribution(tmp_path, "shadow_env", {"math": "plug_shadow:CounterEnvironment"})
    with pytest.raises(
        ConfigError, match=r"'math' is claimed by package shadow_env and rollpoint \(built-in\)"
    ):
        resolve_environment("math")


def test_a_server_matches_a_row_without_importing_what_it_names(tmp_path: Path) -> None:
    write_module(tmp_path, "plug_side_effect", "import os\nos.environ['PLUG_IMPORTED'] = '1'\n")
    write_module(tmp_path, "plug_known", COUNTER_ENV)
    env = get_environment("plug_known:CounterEnvironment")  # what a server resolved at start
    assert environment_matches("plug_known:CounterEnvironment", env)
    assert not environment_matches("plug_side_effect:Anything", env)
    assert "plug_side_effect" not in sys.modules and "PLUG_IMPORTED" not in os.environ
    # A local dataset may name it any way that resolves: that may import.
    assert not environment_matches("plug_side_effect:Anything", env, resolve=True)
    assert "plug_side_effect" in sys.modules
    os.environ.pop("PLUG_IMPORTED", None)


BAD_TOOL_ENV = (
    COUNTER_ENV
    + """
from rollpoint.envs import NoArguments, Tool

def _bump(state):
    return ""

class BadToolEnvironment(CounterEnvironment):
    name: ClassVar[str] = "badtool"

    def tool_table(self):
        return {"bump": Tool("bump", "Add one.", NoArguments, _bump)}
"""
)


def test_a_config_naming_an_environment_with_a_tool_that_fits_no_convention_is_refused(
    tmp_path: Path,
) -> None:
    write_module(tmp_path, "plug_badtool", BAD_TOOL_ENV)
    ref = "plug_badtool:BadToolEnvironment"
    config = parse_config({"environment": ref, "tasks": 2})
    with pytest.raises(ConfigError) as caught:
        load_tasks_for(config.job_settings())
    assert str(caught.value) == (
        "environment 'badtool': tool 'bump': run must take (state, args) or"
        " (state, args, ctx), not _bump(state)"
    )
