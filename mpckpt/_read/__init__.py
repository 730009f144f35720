"""The one read side: a committed checkpoint back into memory, for one process or a job, from any source.

    restore.py   which step to read (newest, fallback, agreement across ranks), then apply (apply.py)
    load.py      one checkpoint's state, or its verification
    whole.py     read plan of a checkpoint one process saved      ranked.py  states of a job's checkpoint
    regions.py   resharding plan: regions of global tensors, block-verified
    skeleton.py  the one skeleton parser                          verified.py  sizes, checksums, headers
    sources.py   where the bytes come from (``Source``), tried nearest first

Nothing is used before it is verified, whichever source it came from. The recovery tier plugs
in as more sources (``sources.ORDER``: memory, peer, then storage). What a root has committed,
seen read-only (``StorageView``, ``mpckpt.load``), is ``mpckpt._view``, above it.
"""
