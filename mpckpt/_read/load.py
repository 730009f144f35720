"""Loading and verifying one committed checkpoint, from any source: the read side's entry points.

``load_state`` gives the plain nested state of a checkpoint (``whole`` for one process's,
``ranked`` for a job's, every byte verified); ``verify_state`` checks that it would load, in
bounded memory, and reads every file against its checksum. ``load_checkpoint`` and
``verify_checkpoint`` do the same for a checkpoint in its root (``StorageSource``): what
``mpckpt.load``, ``Checkpointer.load``, ``mpckpt verify`` and ``mpckpt export`` use.
"""

from __future__ import annotations

from typing import Any

from mpckpt._read.ranked import check_ranked, load_ranked
from mpckpt._read.sources import Source, StorageSource
from mpckpt._read.verified import stream_verified
from mpckpt._read.whole import check_whole, load_whole
from mpckpt.errors import ConfigError
from mpckpt.format.manifest import Manifest
from mpckpt.storage import Backend


def load_state(source: Source, *, allow_pickle: bool = False, classes: bool = True, threads: int = 8) -> Any:
    """The plain nested state of the checkpoint ``source`` holds (``classes``: see ``unflatten``)."""
    manifest = source.manifest
    if manifest.kind != "state":
        raise ConfigError(f"{source.name} is a directory checkpoint (files you wrote); read it with "
                          "Checkpointer.checkpoint(step).as_directory()")
    if manifest.ranked:  # saved by the ranks of a job: every rank's part, joined
        return load_ranked(source, allow_pickle=allow_pickle, classes=classes, threads=threads)
    return load_whole(source, allow_pickle=allow_pickle, classes=classes, threads=threads)


def verify_state(source: Source) -> None:
    """Check that the checkpoint would load, in bounded memory: for a state the skeleton, every
    shard header and how they fit together (meta tensors: nothing allocated, nothing unpickled),
    then every file's size and checksum (streamed)."""
    manifest = source.manifest
    if manifest.ranked:
        check_ranked(source)
    elif manifest.kind == "state":
        check_whole(source)
    for rel in manifest.files:
        stream_verified(source, rel)


def load_checkpoint(backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False,
                    threads: int = 8, classes: bool = True) -> Any:
    """``load_state`` of checkpoint ``name`` in its root."""
    return load_state(StorageSource(backend, name, manifest), allow_pickle=allow_pickle, classes=classes,
                      threads=threads)


def verify_checkpoint(backend: Backend, name: str, manifest: Manifest) -> None:
    """``verify_state`` of checkpoint ``name`` in its root."""
    verify_state(StorageSource(backend, name, manifest))
