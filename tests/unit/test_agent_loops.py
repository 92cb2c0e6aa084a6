"""Custom agent loops: the lookup by import path, and the state a session saves for one."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

import rollpoint.agent_loops
from rollpoint.agent_loops import AgentLoop, resolve_agent_loop
from rollpoint.app.config import parse_config
from rollpoint.protocol.episode import RunRow, TaskRow
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.agent.session import Session, SessionRecord

LOOPS = """
from rollpoint.agent_loops import AgentLoop

class Echo(AgentLoop):
    def prompt(self, state, messages, turn):
        return list(messages), {"turns": turn + 1}

class Half(AgentLoop):
    pass

def not_a_class():
    pass
"""


@pytest.fixture(autouse=True)
def loop_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    (tmp_path / "loop_plug.py").write_text(textwrap.dedent(LOOPS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("loop_plug", None)


def test_the_public_surface_is_pinned() -> None:
    assert rollpoint.agent_loops.__all__ == ["AgentLoop", "Prompt", "resolve_agent_loop"]


def test_a_loop_by_import_path_resolves_and_the_config_accepts_it() -> None:
    cls = resolve_agent_loop("loop_plug:Echo")
    assert issubclass(cls, AgentLoop)
    assert cls().prompt(None, [{"role": "user", "content": "hi"}], 0)[1] == {"turns": 1}
    assert parse_config({"agent_loop": "loop_plug:Echo"}).agent_loop == "loop_plug:Echo"


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("echo", r"'echo': not an import path \(want package.module:ClassName\)"),
        ("loop_absent:Echo", r"cannot import module 'loop_absent' \(ModuleNotFoundError"),
        ("loop_plug:Nope", r"module 'loop_plug' has no attribute 'Nope'"),
        (
            "loop_plug:not_a_class",
            r"is a function, not a subclass of rollpoint.agent_loops.AgentLoop",
        ),
        ("loop_plug:Half", r"loop_plug:Half is abstract \(does not define prompt\)"),
    ],
)
def test_a_bad_loop_is_one_line_naming_the_key(ref: str, message: str) -> None:
    with pytest.raises(
        ConfigError, match=r"^config: key 'agent_loop': agent loop .*" + message
    ) as err:
        parse_config({"agent_loop": ref})
    assert "\n" not in str(err.value)


def _row() -> RunRow:
    task = TaskRow(task_id="t1", environment="math", prompt="What is 1 + 1?")
    return RunRow(task=task, group_id="g", row=0, episode=EpisodeId(rollout_id="r1", attempt=0))


def test_a_session_saves_its_loop_state_and_a_restore_hands_it_back() -> None:
    session = Session(_row())
    before = session.export_json()
    session.loop_state = {"summary": ["- a"], "folded": 2}
    exported = orjson.loads(orjson.dumps(session.export_json()))
    assert exported != orjson.loads(orjson.dumps(before))  # a change makes a new record
    assert exported["loop_state"] == {"summary": ["- a"], "folded": 2}
    assert exported == session.to_record().model_dump(mode="json")
    restored = Session.from_record(SessionRecord.model_validate(exported))
    assert restored.loop_state == {"summary": ["- a"], "folded": 2}
    assert restored.episode.attempt == 1


def test_a_record_without_loop_state_still_installs() -> None:
    exported = orjson.loads(orjson.dumps(Session(_row()).export_json()))
    del exported["loop_state"]  # as saved before loops existed
    assert Session.from_record(SessionRecord.model_validate(exported)).loop_state is None
