"""Restoring: the restore order after a crash (the restorer, over the resume point, the
checks made before anything is installed and the install) and a lost replica's episodes
given back from the latest snapshot (replica recovery).

The top of the trainer's sub-packages: built on the others; only the trainer loop imports it.
"""
