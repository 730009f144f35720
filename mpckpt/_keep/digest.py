"""Completing a kept snapshot's record with the checksums of its shard files.

Every shard file of a kept snapshot has the xxh3-64 of its header followed by its data (the
manifest's checksum of that file: the very value storage gets), and in a multi-rank save the
xxh3-64 of every block of it, computed as ``format.checksums`` computes them for every side
(``FileHasher`` fed by a copy that hashes as it lands, ``file_checksums`` of a file held whole).

A single process's eager save publishes its record before the checksums (``Keeper.keep``,
``pending``) and completes it afterwards (``with_checksums``: those its uploads computed, the rest
hashed here); a record its process left pending is completed with those the restore computed
(``Keeper.settle``).
"""

from __future__ import annotations

import dataclasses

from mpckpt._keep.record import KeptRecord


def with_checksums(record: KeptRecord, digests: dict[str, str]) -> KeptRecord:
    """``record`` with the checksum of each of its shard files in ``digests`` (by relpath) filled in."""
    spans = {rel: dataclasses.replace(span, checksum=digests[rel]) if rel in digests else span
             for rel, span in record.spans.items()}
    return dataclasses.replace(record, spans=spans)
