"""Sending prompt groups to agents: the dispatcher, the dispatch barrier in front of every
``/run``, row slots and deadlines, the replica picker, given-up tries, stray replies and the
releases the trainer sends when it no longer needs a row.

Built on the state and the control plane; it imports nothing of snapshots nor restore.
"""
