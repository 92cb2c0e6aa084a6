"""Effects outside the state, exactly once (issue 36 item 3), on a real resources server on
loopback: ``ctx.effect`` journals the intent before ``fn`` runs and the result after, a
re-issued call after a server restart gets the recorded result without ``fn`` (counted from
the outside ledger itself), and an effect left in doubt is decided by the environment's
``reconcile`` or fails its episode with one line naming the effect and the episode.

The journal is off in these servers (``journal=False``): effects are recorded anyway, in the
snapshot store (``rollpoint.servers.resources.effect_records`` says why). A kill of real processes is in
``tests/chaos/test_sandbox_crash.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from rollpoint.envs.effects import EffectCall
from rollpoint.protocol.episode import EpisodeStart, ToolCall
from rollpoint.protocol.errors import ConfigError
from rollpoint.protocol.ids import EpisodeId
from rollpoint.servers.resources.effect_records import EffectRecords, effects_folder
from rollpoint.servers.resources.resources_server import create_resources_app
from tests.support.ledger_env import (
    FAIL_ENV,
    LEDGER_ENV,
    LedgerEnvironment,
    ReconcilingLedger,
    ledger_lines,
)
from tests.support.live_server import serve_app

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROLLPOINT_CONTROL_TOKEN", "effects-test")
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    return path


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


def keys() -> Counter[str]:
    return Counter(line["key"] for line in ledger_lines())


async def play(
    http: httpx.AsyncClient, url: str, tool: str, *, attempt: int, rollout: str = "led1"
) -> httpx.Response:
    """Start the episode (again, on a restarted server) and make its call (turn 2, call 0)."""
    env = LedgerEnvironment()
    task = env.make_tasks(1, seed=0)[0]
    episode = EpisodeId(rollout_id=rollout, attempt=attempt)
    start = EpisodeStart(episode=episode, task=task).model_dump(mode="json")
    assert (await http.post(f"{url}/episodes/start", json=start)).status_code == 200
    call = ToolCall(episode=episode, turn=2, call_index=0, arguments='{"amount": 5}')
    return await http.post(f"{url}/tools/{tool}", json=call.model_dump(mode="json"))


@pytest.mark.parametrize("tool", ["post", "apost"])
async def test_a_reissued_call_after_a_restart_gets_the_recorded_result_and_no_second_effect(
    tmp_path: Path, http: httpx.AsyncClient, tool: str
) -> None:
    store = tmp_path / "store"
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        first = await play(http, url, tool, attempt=0)
    assert first.status_code == 200, first.text
    assert keys() == Counter({"led1/2/0/ledger_post": 1})
    # A new server process's state on the same store: the episode is started again from
    # its task (nothing restored it) and its call re-issued under the next attempt.
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        again = await play(http, url, tool, attempt=1)
        metrics = (await http.get(f"{url}/metrics")).text
    assert again.status_code == 200, again.text
    assert 'rollpoint_resources_effects_total{outcome="answered",' in metrics, metrics
    answered = [m for m in metrics.splitlines() if 'outcome="answered"' in m and "#" not in m]
    made = [m for m in metrics.splitlines() if 'outcome="made"' in m and "#" not in m]
    assert answered[0].endswith(" 1.0") and made[0].endswith(" 0.0"), (answered, made)
    assert again.json()["content"] == first.json()["content"]  # the recorded receipt
    assert keys() == Counter({"led1/2/0/ledger_post": 1}), "the effect was made twice"
    # Another call is another effect.
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        other = await play(http, url, tool, attempt=0, rollout="led2")
    assert other.status_code == 200
    assert keys() == Counter({"led1/2/0/ledger_post": 1, "led2/2/0/ledger_post": 1})


async def test_an_effect_made_on_one_replica_is_not_made_again_on_another(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """A row sent again after a crash may be played by another replica: its journal is its
    own, the effects are the store's (what the sandbox crash test caught)."""
    store = str(tmp_path / "store")
    app = create_resources_app(LedgerEnvironment(), snapshot_root=store, replica="replica-0")
    with serve_app(app) as url:
        first = await play(http, url, "post", attempt=0)
    other = create_resources_app(
        LedgerEnvironment(), snapshot_root=store, replica="replica-1", journal=True
    )
    with serve_app(other) as url:
        again = await play(http, url, "post", attempt=0)
    assert again.status_code == 200 and again.json()["content"] == first.json()["content"]
    assert keys() == Counter({"led1/2/0/ledger_post": 1})


async def test_an_effect_in_doubt_without_reconcile_fails_its_episode_and_is_not_made_again(
    tmp_path: Path, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv(FAIL_ENV, "1")  # the ledger applies the post, its reply is lost
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        lost = await play(http, url, "post", attempt=0)
    assert lost.status_code == 500  # the environment's error: the tool raised
    monkeypatch.delenv(FAIL_ENV)
    assert EffectRecords(effects_folder(str(store))).in_doubt() == ["led1/2/0/ledger_post"]
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        again = await play(http, url, "post", attempt=1)
    error = again.json()["error"]
    assert (again.status_code, error["code"], error["retryable"]) == (500, "effect_in_doubt", False)
    message = error["message"]
    assert "'ledger_post'" in message and "led1#1" in message and "\n" not in message
    assert keys() == Counter({"led1/2/0/ledger_post": 1})


async def test_reconcile_decides_an_effect_in_doubt_from_the_outside_systems_own_record(
    tmp_path: Path, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv(FAIL_ENV, "1")
    with serve_app(create_resources_app(ReconcilingLedger(), snapshot_root=str(store))) as url:
        assert (await play(http, url, "post", attempt=0)).status_code == 500
    monkeypatch.delenv(FAIL_ENV)
    with serve_app(create_resources_app(ReconcilingLedger(), snapshot_root=str(store))) as url:
        found = await play(http, url, "post", attempt=1)
        assert found.status_code == 200, found.text
        # Found in the ledger by its key: recorded as made, fn not called again.
        assert keys() == Counter({"led1/2/0/ledger_post": 1})
        receipt = found.json()["content"]
    # Its result is journaled now: the next restart answers it without asking reconcile.
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        again = await play(http, url, "post", attempt=2)
    assert again.json()["content"] == receipt
    # An intent whose effect never reached the ledger: reconcile says so, and fn runs once.
    await EffectRecords(effects_folder(str(store))).intent(
        EffectCall("led3", 0, 2, 0, "ledger_post", "post")
    )
    with serve_app(create_resources_app(ReconcilingLedger(), snapshot_root=str(store))) as url:
        made = await play(http, url, "post", attempt=1, rollout="led3")
    assert made.status_code == 200, made.text
    assert keys() == Counter({"led1/2/0/ledger_post": 1, "led3/2/0/ledger_post": 1})


@pytest.mark.parametrize(
    ("tool", "said"),
    [("on_loop", "mark it @slow_tool"), ("refund", "effect 'refund' is not declared")],
)
async def test_an_effect_made_where_it_cannot_be_kept_once_is_refused_before_fn_runs(
    tmp_path: Path, http: httpx.AsyncClient, tool: str, said: str
) -> None:
    store = tmp_path / "store"
    with serve_app(create_resources_app(LedgerEnvironment(), snapshot_root=str(store))) as url:
        reply = await play(http, url, tool, attempt=0)
    assert reply.status_code == 500
    assert said in reply.json()["error"]["message"]
    assert keys() == Counter()


def test_an_environment_with_effects_needs_a_local_store_to_journal_them() -> None:
    with pytest.raises(ConfigError, match="environment 'ledger' declares effects") as refused:
        create_resources_app(LedgerEnvironment(), snapshot_root="memory://effects")
    assert "memory://effects" in refused.value.message
