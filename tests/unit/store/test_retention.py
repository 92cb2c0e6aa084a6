"""Retention of snapshots and train checkpoints as one decision (store/retention.py)."""

from __future__ import annotations

from rollpoint.store.retention import Span, checkpoints_to_keep, plan


def spans(*ranges: tuple[int, int]) -> list[Span]:
    """Newest first: snapshot s<k> composes with steps [committed, train]."""
    return [Span(f"s{i}", c, t) for i, (c, t) in enumerate(ranges)]


def test_a_checkpoint_a_kept_snapshot_composes_with_is_never_pruned() -> None:
    # Snapshot writes failed from step 2 on: checkpoints 3..6 came, no snapshot after 2.
    decided = plan(spans((2, 2), (1, 1)), [1, 2, 3, 4, 5, 6], keep_snapshots=3, keep_checkpoints=3)

    assert decided.checkpoints == {4, 5, 6, 2, 1}
    assert decided.snapshots == {"s0", "s1"}


def test_only_the_newest_checkpoint_in_a_span_is_kept_for_it() -> None:
    decided = plan(spans((1, 4)), [1, 2, 3, 4, 5, 6, 7], keep_snapshots=1, keep_checkpoints=2)

    assert decided.checkpoints == {6, 7, 4}


def test_the_last_snapshot_that_composes_with_a_checkpoint_is_kept() -> None:
    # The three newest compose with no checkpoint present (theirs were lost); s3 does.
    decided = plan(
        spans((9, 9), (8, 8), (7, 7), (5, 5), (4, 4)), [5, 6], keep_snapshots=3, keep_checkpoints=3
    )

    assert decided.snapshots == {"s0", "s1", "s2", "s3"}
    assert 5 in decided.checkpoints


def test_step_zero_needs_no_file_and_protected_snapshots_stay() -> None:
    decided = plan(
        spans((0, 0), (0, 0), (0, 0), (0, 0)),
        [],
        keep_snapshots=2,
        keep_checkpoints=3,
        protect={"s3"},
    )

    assert decided.snapshots == {"s0", "s1", "s3"}
    assert decided.checkpoints == frozenset()


def test_a_run_resumed_from_an_older_snapshot_keeps_its_own_checkpoints() -> None:
    """Chaos (pack_damage, then the rerun killed): snapshots at steps 6 to 8 unusable (a
    damaged file), the rerun resumed from s3 at step 4 and wrote step 5. Counted as the
    newest, the abandoned line's checkpoints 6 to 8 got 4 and 5 deleted, and with them every
    snapshot the rerun could resume from: the next rerun was refused."""
    snapshots = spans((8, 8), (7, 7), (6, 6), (4, 4))
    present = [4, 6, 7, 8]

    kept = checkpoints_to_keep(snapshots, present, 5, keep_snapshots=3, keep_checkpoints=3)

    assert {4, 5} <= kept  # the run's own line: what s3 and the next snapshot compose with
    assert {6, 7, 8} <= kept  # the kept (newest) snapshots still compose with these
    # Once no kept snapshot composes with a step of the abandoned line, it goes.
    later = checkpoints_to_keep(
        spans((5, 5), (4, 4)), [*present, 5], 5, keep_snapshots=2, keep_checkpoints=3
    )
    assert later == {4, 5}
    # Before: plan() alone kept the newest three by number.
    assert (
        not {4, 5}
        <= plan(snapshots, [*present, 5], keep_snapshots=3, keep_checkpoints=3).checkpoints
    )


def test_a_held_restored_snapshot_keeps_its_checkpoint_past_newer_damaged_ones() -> None:
    """Trial 104 of the journal-mode chaos campaign: s0..s2 (steps 6 to 8) share a damaged
    file, the rerun restored s3 (steps 3 to 4) and wrote 5 to 8 while its saves failed.
    Unheld, s3 is not among the three newest and its checkpoint 4 goes; held (the
    coordinator pins the snapshot it restored), it stays."""
    snapshots = spans((8, 8), (7, 7), (6, 6), (3, 4))
    present = [4, 5, 6, 7, 8]

    unheld = checkpoints_to_keep(snapshots, present, 8, keep_snapshots=3, keep_checkpoints=1)
    held = checkpoints_to_keep(
        snapshots, present, 8, keep_snapshots=3, keep_checkpoints=1, protect={"s3"}
    )

    assert 4 not in unheld
    assert 4 in held
