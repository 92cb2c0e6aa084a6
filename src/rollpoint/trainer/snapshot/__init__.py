"""Taking a snapshot: the coordinator's consistent cut across the trainer and every replica,
the control calls it makes, what a save captured, the pause-free save, the publication, the
failure budget, the resumer that reopens every participant a save closed, and the snapshots
a run takes by itself (before its first row, every few seconds, after its last step).

Built on the state, the control plane and dispatch; it imports nothing of restore.
"""
