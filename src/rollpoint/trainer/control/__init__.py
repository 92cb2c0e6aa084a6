"""The trainer's handle on the environment's control plane: the transport seam, one typed
client per participant, the replica roster and the control plane built from a deployment;
the in-flight sampler reads the replicas through them for the run's event log.

Above the state, below dispatch and snapshots: it imports nothing of either.
"""
