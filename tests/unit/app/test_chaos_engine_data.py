"""A chaos trial's engine-data faults: how the trial sets the scripted policy up for the run
the plan names, and what the runner's check finds in a trial's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollpoint.app.chaos.engine_checks import check_engine_data
from rollpoint.app.chaos.plan import (
    OVERSIZED_CAP,
    ChaosFault,
    PlannedFault,
    TrialEvent,
    TrialPlan,
    engine_fault_log,
)
from rollpoint.app.chaos.tally import RunRecord
from rollpoint.app.chaos.trial import trial_config
from rollpoint.app.config import parse_config
from rollpoint.protocol.engine_faults import PADDING
from rollpoint.protocol.errors import ConfigError
from rollpoint.testing.invariants import Invariant
from tests.support.job_config import write_job_config

OVERSIZED = PlannedFault(kind=ChaosFault.OVERSIZED_REPLY, run=0, at_s=0.0, call=4)
BAD_ID = PlannedFault(kind=ChaosFault.BAD_TOKEN_DATA, run=1, at_s=0.0, call=7, how="id_float")
KILL = PlannedFault(kind=ChaosFault.PROCESS_KILL, run=0, at_s=1.0)


def plan_of(tmp_path: Path, *faults: PlannedFault, run: int = 0) -> TrialPlan:
    config = write_job_config(tmp_path)
    return TrialPlan(
        trial=0, config=config, workdir=tmp_path / "trial-0", run=run, faults=list(faults)
    )


def test_the_policy_corrupts_only_in_the_run_the_plan_names(tmp_path: Path) -> None:
    first = trial_config(plan_of(tmp_path, OVERSIZED, KILL, BAD_ID, run=0))
    rerun = trial_config(plan_of(tmp_path, OVERSIZED, KILL, BAD_ID, run=1))

    ((oversized,), (bad,)) = (first.policy.faults, rerun.policy.faults)
    assert oversized.corrupt == "oversized_reply" and oversized.calls == [4]
    assert oversized.pad_bytes is not None and oversized.pad_bytes > OVERSIZED_CAP
    assert (bad.corrupt, bad.calls, bad.how) == ("token_data", [7], "id_float")
    # Each run logs its own corruptions.
    assert first.policy.fault_log == tmp_path / "trial-0" / "engine-faults-run0.jsonl"
    assert rerun.policy.fault_log == tmp_path / "trial-0" / "engine-faults-run1.jsonl"
    # Both runs alike: token capture on (streamed calls to spoil), replies capped.
    for config in (first, rerun):
        assert config.policy.capture_tokens is True
        assert config.max_reply_bytes == OVERSIZED_CAP
    # A trial without them runs the job as configured.
    plain = trial_config(plan_of(tmp_path, KILL))
    assert plain.policy.faults == [] and plain.policy.capture_tokens is False
    assert plain.max_reply_bytes == 64 * 1024 * 1024


def test_faults_are_refused_for_an_engine_that_is_not_the_scripted_policy() -> None:
    fault = {"corrupt": "tool_call_id", "calls": [1]}
    with pytest.raises(ConfigError, match="faults are the scripted policy's"):
        parse_config({"tasks": 1, "policy": {"base_url": "http://engine/v1", "faults": [fault]}})
    with pytest.raises(ConfigError, match=r"policy\.faults\.0\.calls"):
        parse_config({"tasks": 1, "policy": {"faults": [{**fault, "calls": [0]}]}})


def _trial(tmp_path: Path, rows: list[dict[str, Any]], log: str) -> tuple[TrialPlan, RunRecord]:
    plan = plan_of(tmp_path, BAD_ID.model_copy(update={"run": 0}))
    plan.workdir.mkdir()
    engine_fault_log(plan).write_bytes(
        orjson.dumps(
            {
                "call": 7,
                "corrupt": "token_data",
                "how": "id_float",
                "field": "choices[0].token_ids[3]",
            }
        )
        + b"\n"
    )
    (plan.workdir / "train_data.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (plan.workdir / "rollpoint.log").write_text(log)
    struck = TrialEvent(event="fault", ts=1.0, kind=ChaosFault.BAD_TOKEN_DATA)
    return plan, RunRecord(run=0, started_at=0.0, returncode=0, events=[struck])


CLEAN = {
    "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "function": {}}]}
    ],
    "turns": [
        {
            "completion_token_ids": [5, 6],
            "prompt_token_ids": [1],
            "completion_logprobs": [-0.5, -1.0],
        }
    ],
}
RESENT = (
    "INFO r1#0 lost (transport_error: http://m/v1/chat/completions: vllm reply: chunk "
    "choices[0].token_ids[3] is not a token id: 13.0): re-sending under new rollout ids\n"
)


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"turns": [{"completion_token_ids": [5, 13.0]}]}, "completion_token_ids holds a bad"),
        ({"turns": [{"prompt_token_ids": [2**31]}]}, "prompt_token_ids holds a bad"),
        ({"turns": [{"completion_logprobs": [0.5]}]}, "completion_logprobs holds a bad"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "has no id"),
        ({"messages": [{"role": "assistant", "content": "ok " + PADDING}]}, "padding"),
    ],
)
def test_a_corrupted_reply_that_reached_training_is_an_i1_violation(
    tmp_path: Path, row: dict[str, Any], said: str
) -> None:
    plan, run = _trial(tmp_path, [CLEAN, row], RESENT)

    (found,) = check_engine_data(plan, [run], engine="vllm", cap=OVERSIZED_CAP)

    assert found.kind is Invariant.EXACTLY_ONCE and found.subject == "train_data.jsonl line 2"
    assert said in found.detail


def test_a_corruption_whose_row_was_not_re_sent_naming_it_is_an_i1_violation(
    tmp_path: Path,
) -> None:
    plan, run = _trial(tmp_path, [CLEAN], RESENT)
    assert check_engine_data(plan, [run], engine="vllm", cap=OVERSIZED_CAP) == []

    # The failure said without the field, or the field said but no re-send: not enough.
    for k, log in enumerate(
        (
            "INFO r1#0 lost (transport_error): re-sending under new rollout ids\n",
            "WARNING vllm reply: chunk choices[0].token_ids[3] is not a token id\n",
        )
    ):
        folder = tmp_path / f"said-{k}"
        folder.mkdir()
        plan, run = _trial(folder, [CLEAN], log)
        (found,) = check_engine_data(plan, [run], engine="vllm", cap=OVERSIZED_CAP)
        assert found.subject == "run 0 policy call 7 (token_data)"
        assert "'vllm reply: chunk choices[0].token_ids[3]'" in found.detail
