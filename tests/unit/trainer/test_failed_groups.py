"""Failed groups: the limit that stops a run, the digest line, and sending them again."""

from __future__ import annotations

from rollpoint.protocol.episode import TaskRow
from rollpoint.trainer.dispatch.failed_groups import (
    FailureLimit,
    digest,
    reason_kind,
    retry_failed,
    superseded,
)
from rollpoint.trainer.state.finished_queue import FinishedQueue
from rollpoint.trainer.state.ledger import RecoveryLedger


def task(i: int) -> TaskRow:
    return TaskRow(task_id=f"t{i}", environment="math", prompt=f"What is {i} + 1?")


def test_the_limit_waits_for_min_groups_then_compares_the_share() -> None:
    limit = FailureLimit(0.5, min_groups=4)
    for _ in range(3):
        limit.settle(failed=True)
    assert not limit.exceeded(groups_total=100), "3 settled: too few to judge"
    limit.settle(failed=False)
    assert limit.exceeded(groups_total=100)  # 3 of 4 > 0.5
    small = FailureLimit(0.5, min_groups=8)
    small.settle(failed=True)
    small.settle(failed=True)
    assert small.exceeded(groups_total=2), "a run smaller than min_groups: all of it"
    never = FailureLimit(1.0, min_groups=1)
    never.settle(failed=True)
    assert not never.exceeded(groups_total=1)


def test_the_digest_counts_one_fault_in_many_groups_as_one_reason() -> None:
    url = "http://127.0.0.1:4123/episodes/verify"
    failed = {
        f"t{i}-g0": f"row {i % 2} (r{i:016x}#0): environment_error: {url}: environment 'math' "
        "raised ValueError in verify: closed (at e.py:3 in verify)"
        for i in range(3)
    } | {"t9-g0": "row 0 gave up after 8 fresh tries"}
    line = digest(failed)
    assert line.startswith("4 groups failed; most common: environment_error: /episodes/verify:")
    assert "(3 groups); row 0 gave up after 8 fresh tries (1 group)" in line
    assert reason_kind("row 3 (rabcdefabcdefabcd#2): cancelled: attempt rabcdefabcdefabcd#2") == (
        "cancelled: attempt <rollout>"
    )


def test_retry_adds_each_failed_group_once_as_a_new_group_of_its_task() -> None:
    ledger, tq = RecoveryLedger(), FinishedQueue()
    for i in range(3):
        ledger.add_group(task(i), f"t{i}-g0", 2)
        tq.expect_group(f"t{i}-g0", 2)
    ledger.fail_group("t0-g0", "broken")
    ledger.fail_group("t2-g0", "broken")
    assert retry_failed(ledger, tq, 2) == {"t0-g0": "t0-g1", "t2-g0": "t2-g1"}
    assert superseded(ledger) == {"t0-g0", "t2-g0"}
    assert ledger.group("t2-g1").task_id == "t2" and ledger.group("t2-g1").failed is None
    assert retry_failed(ledger, tq, 2) == {}, "a group sent again is not sent a second time"
    ledger.fail_group("t2-g1", "broken again")
    assert retry_failed(ledger, tq, 2) == {"t2-g1": "t2-g2"}
