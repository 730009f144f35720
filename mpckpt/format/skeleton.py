"""The skeleton's versions and limits: what a writer stamps and a reader accepts.

A checkpoint of one process has one ``skeleton.json`` (``SKELETON_VERSION``): the tree of
the state, the tensor table and, per leaf, the shard entries that hold its bytes. A
multi-rank checkpoint has one per rank (``r<rank>-skeleton.json``, ``RANK_SKELETON_VERSION``)
that adds each leaf's ``kind`` (``KINDS``), where a DTensor shard sits in its global tensor,
and the xxh3-64 of every block of the files that rank wrote. Writers: ``_save.saving`` and
``_stage.rank_skeleton``; the one parser: ``_read.skeleton``.
"""

SKELETON_VERSION = 1
RANK_SKELETON_VERSION = 1
KINDS = ("local", "replicated", "sharded")  # a rank's own (PerRank), the same on every rank, a DTensor shard
MAX_SKELETON_BYTES = 1 << 30  # 5M tensors' worth; a bigger one is not ours and is never allocated
