"""The environment registry and JSONL task datasets."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from rollpoint.envs import environment_names, get_environment, load_tasks, write_tasks
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.participant import CheckpointMode


def test_every_builtin_environment_is_registered_under_its_name() -> None:
    assert environment_names() == ["blackjack", "math", "workplace"]
    modes = {name: get_environment(name).checkpoint_mode for name in environment_names()}
    assert modes == {
        "blackjack": CheckpointMode.TURN,
        "math": CheckpointMode.RESTART_ONLY,
        "workplace": CheckpointMode.TURN,
    }
    for name in environment_names():
        assert get_environment(name).name == name


def test_unknown_environment_names_the_valid_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown environment .chess. \(valid: blackjack, math, workplace;"
    ):
        get_environment("chess")


def test_negative_task_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be >= 0"):
        get_environment("math").make_tasks(-1, seed=0)


def test_tasks_round_trip_through_a_jsonl_file(tmp_path: Path) -> None:
    tasks = get_environment("workplace").make_tasks(5, seed=0)
    path = tmp_path / "tasks.jsonl"
    write_tasks(path, tasks)
    path.write_bytes(path.read_bytes() + b"\n")  # a trailing blank line is fine
    assert load_tasks(path, environment="workplace") == tasks


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


ROW = orjson.dumps({"task_id": "t1", "environment": "math", "prompt": "p"}).decode()
ROW2 = orjson.dumps({"task_id": "t2", "environment": "math", "prompt": "p"}).decode()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ((ROW, "{nope"), r"tasks.jsonl:2: not valid JSON"),
        ((ROW, "", "[1, 2]"), r"tasks.jsonl:3: want a JSON object"),
        (
            (ROW2, '{"task_id": "t3", "environment": "math", "prompt": "p", "x": 1}'),
            r":2: unknown key 'x'",
        ),
        (
            ('{"task_id": "t3", "environment": "two words", "prompt": "p"}',),
            r":1: key 'environment'",
        ),
        (('{"task_id": "t3", "environment": "math"}',), r":1: key 'prompt': Field required"),
        ((ROW, ROW2, ROW), r"tasks.jsonl:3: duplicate task_id 't1' \(first on line 1\)"),
        (("", "  "), r"tasks.jsonl: the task dataset has no rows"),
    ],
)
def test_bad_datasets_name_the_file_and_line(
    tmp_path: Path, lines: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_tasks(write_lines(tmp_path, *lines))


def test_a_row_for_another_environment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r":1: task t1 is for 'math', not 'workplace'"):
        load_tasks(write_lines(tmp_path, ROW), environment="workplace")


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read task dataset"):
        load_tasks(tmp_path / "absent.jsonl")
