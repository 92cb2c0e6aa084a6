"""Restoring: the restore order after a crash (the restorer) and a lost replica's episodes
given back from the latest snapshot (replica recovery).

The top of the trainer's sub-packages: built on the others; only the trainer loop imports it.
"""
