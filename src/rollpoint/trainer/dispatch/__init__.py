"""Sending prompt groups to agents: the dispatcher, the dispatch barrier in front of every
``/run``, row slots and deadlines, the replica picker, given-up tries, stray replies, the
releases the trainer sends when it no longer needs a row, and the stall watchdog over the
dispatcher's row results.

Built on the state and the control plane; it imports nothing of snapshots nor restore.
"""
