"""The shipped schema of ``train_data.jsonl``: a valid 2020-12 schema, strict about keys.
(Real rows are validated against it by the runs that write them: test_cli_run, test_token_runs,
tests/chaos/test_generation_cut_restore, test_run_failures.)"""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from rollpoint.schemas import train_data_schema
from tests.support.train_schema import check_train_rows

ROW: dict[str, Any] = {
    "task_id": "math-0000",
    "group_id": "math-0000-g0",
    "row": 0,
    "rollout_id": "r0123456789abcdef",
    "attempt": 1,
    "reward": 1.0,
    "advantage": 0.5,
    "messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ],
    "train_step": 1,
    "policy_version": 0,
    "turn_count": 1,
    "turns": [
        {
            "turn": 0,
            "attempt": 1,
            "policy_version": 1,
            "completion_id": "c1",
            "finish_reason": "stop",
            "completion_token_ids": [1, 2, 3],
            "completion_logprobs": [-0.1, -0.2, -0.3],
            "prompt_token_ids": [7, 8],
            "prompt_is_suffix": False,
            "segments": [{"policy_version": 0, "tokens": 2}, {"policy_version": 1, "tokens": 1}],
        }
    ],
    "model_calls": [{"turn": 0, "attempt": 0}],
}


def test_the_schema_is_a_valid_2020_12_schema_and_takes_a_full_row() -> None:
    Draft202012Validator.check_schema(train_data_schema())
    assert check_train_rows([ROW]) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.pop("messages"), "the row"),
        (lambda r: r.update(transcript=[]), "the row"),
        (lambda r: r["turns"][0]["segments"][0].update(tokens=[1, 2]), "turns/0/segments/0/tokens"),
        (lambda r: r.update(row=-1), "row"),
    ],
)
def test_a_row_off_the_format_is_refused_naming_the_field(change: Any, field: str) -> None:
    row = {
        **ROW,
        "turns": [dict(ROW["turns"][0], segments=[dict(s) for s in ROW["turns"][0]["segments"]])],
    }
    change(row)
    with pytest.raises(AssertionError, match=f"train_data row 1: {field}:"):
        check_train_rows([row])
