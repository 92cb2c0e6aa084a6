"""The trainer's public surface: the top-level names, loaded on first use, and the parts of
the façade that need no servers (the served deployment line, the attached runtime)."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import threading
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollpoint
from rollpoint.app.config import parse_config
from rollpoint.protocol.deployment import ServedDeployment
from rollpoint.protocol.errors import ConfigError, InvalidPhaseError, LaunchError
from rollpoint.runtime.attached import AttachedRuntime
from tests.support.job_config import job_config

SERVED = (
    '{"replicas":[{"name":"replica-0","model_url":"http://127.0.0.1:1","agent_url":'
    '"http://127.0.0.1:2","resources_url":"http://127.0.0.1:3"}],"policy_url":'
    '"http://127.0.0.1:4/v1","control_token_file":"/w/control.token","data_token_file":null,'
    '"snapshot_store":"/w/snapshots"}'
)


def test_the_top_level_exports_are_pinned_and_each_resolves() -> None:
    assert rollpoint.__all__ == [
        "Blocker",
        "Coverage",
        "JobConfig",
        "JobSettings",
        "ReplicaEndpoints",
        "Rollouts",
        "RollpointError",
        "RunConfig",
        "RunPreemptedError",
        "RunProgress",
        "RunSummary",
        "SavePhase",
        "SaveReport",
        "ServedDeployment",
        "StepRecord",
        "StepResult",
        "StopRequest",
        "SyncRollouts",
        "TaskRow",
        "TrainBatch",
        "TrainCheckpoint",
        "TrainHooks",
        "TrainSample",
        "TrainTurn",
        "load_config",
        "load_served",
        "parse_config",
        "token_segments",
    ]
    for name in rollpoint.__all__:
        assert getattr(rollpoint, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        rollpoint.Trainer  # noqa: B018


def test_importing_the_protocol_does_not_load_the_trainer_side() -> None:
    code = (
        "import sys, rollpoint.protocol.deployment; "
        "print(sorted(m for m in sys.modules if m.startswith(('rollpoint.trainer', 'rollpoint.job.run'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_served_file_that_is_missing_or_not_the_line_is_one_line_naming_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"missing.json: No such file or directory"):
        rollpoint.load_served(tmp_path / "missing.json")
    edited = tmp_path / "served.json"
    edited.write_text(SERVED.replace('"control_token_file":"/w/control.token",', ""))
    with pytest.raises(
        ConfigError, match=r"served.json: not the line .* \(control_token_file: Field required\)"
    ):
        rollpoint.load_served(edited)
    edited.write_text(SERVED)
    assert rollpoint.load_served(edited) == ServedDeployment.model_validate_json(SERVED)


def test_the_line_serve_prints_parses_unchanged() -> None:
    served = ServedDeployment.model_validate_json(SERVED)
    assert served.snapshot_store == "/w/snapshots" and served.data_token_file is None
    assert served.deployment().replicas[0].agent_url == "http://127.0.0.1:2"


async def test_the_attached_runtime_hands_back_the_servers_and_restarts_none() -> None:
    served = ServedDeployment.model_validate_json(SERVED)
    config = parse_config({"workdir": "/tmp/x", "environment": "math", "tasks": 1, "replicas": 1})
    async with AttachedRuntime(config.runtime_settings(), served.deployment()) as runtime:
        assert runtime.deployment == served.deployment()
        with pytest.raises(LaunchError, match="replica-0 is not this trainer's to restart"):
            await runtime.restart_replica("replica-0")
    assert runtime.deployment is None


def test_the_attached_runtime_refuses_another_replica_count() -> None:
    served = ServedDeployment.model_validate_json(SERVED)
    config = parse_config({"workdir": "/tmp/x", "environment": "math", "tasks": 1, "replicas": 2})
    with pytest.raises(ConfigError, match=r"replicas: the config says 2, the deployment has 1"):
        AttachedRuntime(config.runtime_settings(), served.deployment())


def _rollpoint_types(hint: object) -> Iterator[type]:
    """The rollpoint classes named in a type hint, through unions and generics."""
    if isinstance(hint, type) and hint.__module__.startswith("rollpoint."):
        yield hint
    for arg in typing.get_args(hint):
        yield from _rollpoint_types(arg)


def test_every_type_the_facades_signatures_take_or_return_is_exported_at_the_top() -> None:
    # A façade user imports what the façade takes and hands back from ``rollpoint``, never
    # from the trainer library's modules; so does the author of a custom step record (what
    # the façade's ``step_record`` takes) for the types of its methods.
    used: set[type] = set()
    for owner in (
        rollpoint.Rollouts,
        rollpoint.SyncRollouts,
        rollpoint.TrainBatch,
        rollpoint.StepRecord,
    ):
        for name, member in inspect.getmembers(owner):
            if name.startswith("_") and name != "__init__":
                continue
            function = member.fget if isinstance(member, property) else member
            if not callable(function) or isinstance(function, type):
                continue
            for hint in typing.get_type_hints(function).values():
                used.update(_rollpoint_types(hint))
    for hint in typing.get_type_hints(rollpoint.TrainBatch).values():  # its fields
        used.update(_rollpoint_types(hint))
    names = {cls.__name__ for cls in used}
    assert names - set(rollpoint.__all__) == set()
    assert {"RunSummary", "SaveReport", "StepRecord", "StepResult", "TrainCheckpoint"} <= names


def test_the_trainer_library_and_the_loop_export_pinned_names_that_each_resolve() -> None:
    import rollpoint.loop
    import rollpoint.trainer

    assert rollpoint.trainer.__all__ == [
        "Blocker",
        "Coverage",
        "RunSummary",
        "SavePhase",
        "SaveReport",
        "SaveSettings",
        "StepRecord",
        "StepResult",
        "TrainCheckpoint",
        "TrainHooks",
        "TrainSample",
        "TrainTurn",
        "Trainer",
        "TrainerSettings",
        "TrainerStats",
        "WorkdirRecord",
        "advantages_by_episode",
        "group_advantages",
    ]
    assert rollpoint.loop.__all__ == ["SimulatedTrainer", "run_builtin"]
    for package in (rollpoint.trainer, rollpoint.loop):
        for name in package.__all__:
            assert getattr(package, name).__name__ == name


def test_leaving_sync_rollouts_as_its_run_ends_on_its_own_does_not_raise(tmp_path: Path) -> None:
    """The run's thread closes its loop as the run ends; ``with`` may be left in that moment,
    its thread still alive and its loop already closed (CI once failed a test on it:
    "Event loop is closed" from ``__exit__``). That state, made on purpose."""
    run = rollpoint.SyncRollouts(job_config(tmp_path))
    loop = asyncio.new_event_loop()

    async def ended() -> None:
        return None

    run._main = loop.create_task(ended())
    loop.run_until_complete(run._main)
    loop.close()
    run._loop = loop
    ends = threading.Event()
    run._thread = threading.Thread(target=ends.wait, daemon=True)  # between close and its end
    run._thread.start()
    threading.Timer(0.05, ends.set).start()

    run.__exit__(None, None, None)

    assert not run._thread.is_alive()


def test_a_sync_call_after_the_run_ended_is_refused_in_one_line(tmp_path: Path) -> None:
    """A call made once the run's thread closed its loop, or while the thread ends with
    the loop stopped (what is handed to it then never runs): a rollpoint error naming it,
    not asyncio's RuntimeError nor a wait that never ends."""
    run = rollpoint.SyncRollouts(job_config(tmp_path))
    closed = asyncio.new_event_loop()
    closed.close()
    run._loop = closed
    with pytest.raises(InvalidPhaseError, match="the run has ended"):
        run.progress()

    stopped = asyncio.new_event_loop()  # open, never run again: the thread is ending
    run._loop = stopped
    ends = threading.Event()
    run._thread = threading.Thread(target=ends.wait, daemon=True)
    run._thread.start()
    threading.Timer(0.2, ends.set).start()
    try:
        with pytest.raises(InvalidPhaseError, match="the run ended before this call ran"):
            run.progress()
    finally:
        stopped.close()
