"""Environments whose state lives outside (issue 36 item 4), with the example shell
sandbox (``sandbox_env.shell``: real ``bash`` process trees in a folder per episode that
outlives the server, an audit log outside it).

A checkpoint saves the version of an episode's outside state, never the state. After a
"crash" (the service and its journal dropped, a new one opened on the same journal folder,
the folders left as a crash leaves them) an episode continues only when ``attach`` finds
its folder at the version journaled with its last call: its journaled calls are answered,
not run again (no command, no audit line: counted from the folder's version and the audit
log); otherwise it is left out of the install and restarts. The end-to-end kill with the
trainer is ``tests/chaos/test_sandbox_crash.py``.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sandbox_env.shell import ShellSandbox, audit_lines

from rollpoint.protocol.episode import EpisodeStart, ToolCall
from rollpoint.protocol.errors import EpisodeError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.effect_records import EffectRecords
from rollpoint.servers.resources.episode_service import ResourcesService
from rollpoint.servers.resources.resources_participant import ResourcesParticipant
from rollpoint.servers.resources.tool_journal import ToolJournal
from rollpoint.store.journal import Journal

pytestmark = pytest.mark.integration

SCRIPTS = ["build", "test", "status", "fix"]


@pytest.fixture(autouse=True)
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "sandboxes"
    monkeypatch.setenv("SHELL_SANDBOX_ROOT", str(root))
    monkeypatch.setenv("SHELL_SANDBOX_STEP_S", "0")
    return root


class Server:
    """One resources server's service with its tool journal (or none): a process's state."""

    def __init__(
        self, folder: Path, *, journal: bool = True, env: ShellSandbox | None = None
    ) -> None:
        self.service = ResourcesService(env or ShellSandbox())
        self.journal = ToolJournal(Journal.open(str(folder)), self.service) if journal else None
        self.service.tool_journal = self.journal
        # As the server wires it: the effects folder of the store (next to the journal).
        self.service.effect_store = EffectRecords(folder.parent / "effects")
        self.participant = ResourcesParticipant(self.service)

    async def start(self, rollout: str, attempt: int = 0) -> None:
        task = ShellSandbox().make_tasks(1, seed=0)[0]
        episode = EpisodeId(rollout_id=rollout, attempt=attempt)
        await self.service.start(EpisodeStart(episode=episode, task=task))

    async def call(self, rollout: str, turn: int, *, attempt: int = 0, script: str = "") -> Any:
        call = ToolCall(
            episode=EpisodeId(rollout_id=rollout, attempt=attempt),
            turn=turn,
            call_index=0,
            arguments=f'{{"script": "{script or SCRIPTS[turn % 4]}"}}',
        )
        if self.journal is None:
            return await self.service.call_tool("run", call)
        return await self.journal.call_tool("run", call)

    async def snapshot(self, *rollouts: str) -> tuple[list[Any], list[EpisodeId]]:
        scope = [EpisodeId(rollout_id=r, attempt=0) for r in rollouts]
        return (await self.participant.capture(scope))(), scope

    async def crash(self) -> None:
        if self.journal is not None:
            await self.journal.close()


def audited() -> Counter[str]:
    return Counter(line["key"] for line in audit_lines())


def version(sandbox: Path, rollout: str) -> str:
    return (sandbox / rollout / "version").read_text().strip()


async def test_an_episode_whose_state_survived_continues_at_its_last_journaled_call(
    tmp_path: Path, sandbox: Path
) -> None:
    folder = tmp_path / "journal"
    first = Server(folder)
    await first.start("sh1")
    await first.call("sh1", 0)
    saved = await first.snapshot("sh1")  # the cut: after turn 0
    answers = [await first.call("sh1", turn) for turn in (1, 2)]  # journaled after the cut
    at_crash, effects = version(sandbox, "sh1"), audited()
    assert at_crash.startswith("3 ") and sum(effects.values()) == 3
    await first.crash()

    second = Server(folder)
    restored = await second.participant.install(*saved)
    assert restored == [EpisodeId(rollout_id="sh1", attempt=1)] and second.service.lost == []
    # The agent re-walks turns 1 and 2 (the model server answers them from its journal):
    # answered from the tool journal, nothing run, nothing audited again.
    again = [await second.call("sh1", turn, attempt=1) for turn in (1, 2)]
    assert [a.content for a in again] == [a.content for a in answers]
    assert all(a.replayed for a in again)
    assert version(sandbox, "sh1") == at_crash and audited() == effects
    # Then it goes on past the crash point: a new call runs and is audited once.
    await second.call("sh1", 3, attempt=1)
    assert version(sandbox, "sh1").startswith("4 ")
    assert audited() == effects + Counter({"sh1/3/0/audit": 1})
    await second.crash()


async def test_an_episode_whose_state_moved_on_or_vanished_is_left_to_restart(
    tmp_path: Path, sandbox: Path
) -> None:
    folder = tmp_path / "journal"
    first = Server(folder)
    for rollout in ("moved", "gone", "kept"):
        await first.start(rollout)
        await first.call(rollout, 0)
    saved = await first.snapshot("moved", "gone", "kept")
    # A call whose result was never journaled (it was in flight at the kill): the folder
    # holds it, no journal record does.
    await first.service.call_tool(
        "run",
        ToolCall(
            episode=EpisodeId(rollout_id="moved", attempt=0),
            turn=1,
            call_index=0,
            arguments='{"script": "fix"}',
        ),
    )
    ShellSandbox.remove("gone")  # the sandbox provider reclaimed it
    await first.crash()

    second = Server(folder)
    restored = await second.participant.install(*saved)
    assert restored == [EpisodeId(rollout_id="kept", attempt=1)]
    assert sorted(second.service.lost) == ["gone", "moved"]
    await second.crash()


async def test_without_the_journal_only_an_episode_untouched_since_the_cut_continues(
    tmp_path: Path,
) -> None:
    first = Server(tmp_path / "journal", journal=False)
    for rollout in ("idle", "busy"):
        await first.start(rollout)
        await first.call(rollout, 0)
    saved = await first.snapshot("idle", "busy")
    await first.call("busy", 1)  # after the cut, and nothing journaled it
    second = Server(tmp_path / "journal", journal=False)
    assert await second.participant.install(*saved) == [EpisodeId(rollout_id="idle", attempt=1)]
    assert second.service.lost == ["busy"]


async def test_an_attached_episode_that_asks_another_call_is_not_continued_on_that_state(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "journal"
    first = Server(folder)
    await first.start("sh2")
    saved = await first.snapshot("sh2")
    await first.call("sh2", 0, script="build")
    await first.crash()
    second = Server(folder)
    assert await second.participant.install(*saved) == [EpisodeId(rollout_id="sh2", attempt=1)]
    with pytest.raises(EpisodeError, match=r"sh2#1 continued on external state .* turn 0") as e:
        await second.call("sh2", 0, attempt=1, script="fix")
    assert "\n" not in e.value.message
    await second.crash()


class SnapshottingSandbox(ShellSandbox):
    """Takes a copy of the folder at each cut (its owner's snapshot) and forks from it."""

    def snapshot(self, state: Any) -> Any:
        if state.folder is None:
            return None
        copy = state.folder.parent / "snapshots" / f"{state.folder.name}-{self.version(state)}"
        if not copy.exists():
            shutil.copytree(state.folder, copy)
        return str(copy)

    def restore_snapshot(self, task: Any, rollout_id: str, handle: Any) -> Any:
        folder = Path(handle).parent.parent / rollout_id
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(handle, folder)
        return self.attach(task, rollout_id)


async def test_a_vanished_state_with_a_snapshot_is_forked_from_it_and_the_journal_replayed(
    tmp_path: Path, sandbox: Path
) -> None:
    folder = tmp_path / "journal"
    first = Server(folder, env=SnapshottingSandbox())
    await first.start("sn1")
    await first.call("sn1", 0)
    saved = await first.snapshot("sn1")
    answers = [await first.call("sn1", turn) for turn in (1, 2)]
    at_crash, effects = version(sandbox, "sn1"), audited()
    await first.crash()
    ShellSandbox.remove("sn1")

    second = Server(folder, env=SnapshottingSandbox())
    assert await second.participant.install(*saved) == [EpisodeId(rollout_id="sn1", attempt=1)]
    assert version(sandbox, "sn1").startswith("1 ")  # the fork is at the cut
    # The journaled calls run again on the fork (their commands: the folder catches up),
    # answered with the recorded results, their audit lines not written again.
    again = [await second.call("sn1", turn, attempt=1) for turn in (1, 2)]
    assert [a.content for a in again] == [a.content for a in answers]
    assert version(sandbox, "sn1") == at_crash and audited() == effects
    await second.crash()


async def test_a_row_sent_again_from_its_prompt_attaches_or_starts_fresh(
    tmp_path: Path, sandbox: Path
) -> None:
    """No snapshot held these episodes (they started after it): the trainer sends their rows
    again under the same rollout ids, and their journaled calls decide."""
    folder = tmp_path / "journal"
    first = Server(folder)
    for rollout in ("again", "stale"):
        await first.start(rollout)
        await first.call(rollout, 0)
    await first.service.call_tool(  # in flight at the kill: in the folder, not the journal
        "run",
        ToolCall(
            episode=EpisodeId(rollout_id="stale", attempt=0),
            turn=1,
            call_index=0,
            arguments='{"script": "fix"}',
        ),
    )
    effects = audited()
    await first.crash()

    second = Server(folder)
    await second.start("again")
    await second.start("stale")
    # Its folder is at its journaled call: answered, not run.
    assert (await second.call("again", 0)).replayed and version(sandbox, "again").startswith("1 ")
    # Its folder moved past the journal: a fresh folder, the call run on it (its effect
    # was made before, under the same key: not made again).
    redone = await second.call("stale", 0)
    assert not redone.replayed and version(sandbox, "stale").startswith("1 ")
    assert not (sandbox / "stale" / "work" / "src.txt").exists()  # the unjournaled fix is gone
    assert audited() == effects
    await second.crash()
