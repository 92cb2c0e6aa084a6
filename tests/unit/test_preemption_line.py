"""The stop line accounts for every episode in flight at the signal (none reads as lost)."""

from __future__ import annotations

from rollpoint.preemption import saved_line


def test_the_episodes_not_saved_mid_episode_are_said_to_have_finished_before_the_cut() -> None:
    assert saved_line(17, 6, 0) == (
        "of 17 episodes in flight at the signal, 6 saved mid-episode (6 at a turn boundary, "
        "0 waiting on a policy call), 11 finished before the cut; none lost"
    )
    assert saved_line(8, 5, 2, mid_call=3) == (
        "of 8 episodes in flight at the signal, 5 saved mid-episode (2 at a turn boundary, "
        "3 waiting on a policy call), 1 finished before the cut, 2 restart from their prompt; "
        "none lost"
    )
    assert saved_line(3, 0, 0) == (
        "of 3 episodes in flight at the signal, 0 saved mid-episode, 3 finished before the "
        "cut; none lost"
    )
