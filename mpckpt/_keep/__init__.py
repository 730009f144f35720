"""The recovery tier: snapshots kept in this node's shared memory across a crash of the trainer.

``record`` (what a kept snapshot holds), ``store`` (its files in /dev/shm, the lock of the process
keeping it), ``keeper`` (keeping the newest complete snapshot, finding the one a previous process
kept, taking it over after a restore), ``source`` (reading a checkpoint from it: the ``memory``
source of ``_read.sources``).
"""
