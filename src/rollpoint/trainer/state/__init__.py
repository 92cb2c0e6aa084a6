"""The trainer's state: the recovery ledger (every row of every prompt group) and the
finished-rollout queue (sealed rollouts waiting for training, by whole group).

The bottom of the trainer: it imports none of the other sub-packages; the snapshot cut
captures it and a restore rebuilds it.
"""
