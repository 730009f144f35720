"""The read side's ``Source`` seam: the sources of a checkpoint are tried nearest first, and a
source whose bytes are missing or damaged costs a read from the next one, never a wrong byte.

Two copies of one committed checkpoint on disk: the first read through a real subclass of
``StorageSource`` that says it is this node's memory (what the recovery tier will plug in),
the second through the root as a ``StorageSource``. Damage is a flipped byte in a real file.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

import mpckpt
from mpckpt._read.load import load_state
from mpckpt._read.sources import ORDER, StorageSource, first_that_reads, in_order
from mpckpt.catalog import scan
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from mpckpt.format.names import checkpoint_name
from mpckpt.storage import open_backend, spec_for_url
from tests.conftest import assert_same
from tests.states import random_state


class MemoryCopy(StorageSource):
    """A copy of a checkpoint elsewhere, read as the nearest source (a stand-in with real files)."""

    kind = "memory"


def state() -> dict[str, object]:
    return random_state(7, {"w": (256, 64), "b": (64,)}, step=3)


@pytest.fixture
def two_copies(tmp_path):
    root = tmp_path / "root"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(3, state(), mode="sync")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    sources = []
    for where, cls in ((copy, MemoryCopy), (root, StorageSource)):
        backend = open_backend(spec_for_url(str(where), {}))
        manifest = scan(backend, clean=False)[3]
        sources.append(cls(backend, checkpoint_name(3), manifest))
    return sources, copy / checkpoint_name(3)


def _flip_a_shard_byte(folder) -> None:
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[0]
    with open(folder / shard, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_nearest_intact_source_is_read(two_copies):
    memory, storage = two_copies[0]
    assert in_order([storage, memory]) == [memory, storage]
    assert ORDER.index("memory") < ORDER.index("storage")
    source, loaded = first_that_reads([storage, memory], load_state)
    assert source is memory
    assert_same(loaded, state())


def test_a_damaged_near_copy_falls_back_to_storage_with_every_byte_right(two_copies, caplog):
    (memory, storage), folder = two_copies
    _flip_a_shard_byte(folder)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load_state(memory)  # the damage is real: that copy alone does not load
    with caplog.at_level(logging.WARNING, logger="mpckpt"):
        source, loaded = first_that_reads([memory, storage], load_state)
    assert source is storage
    assert_same(loaded, state())
    assert "cannot be read from memory" in caplog.text and "trying storage" in caplog.text


def test_a_missing_near_copy_falls_back_too(two_copies):
    (memory, storage), folder = two_copies
    shutil.rmtree(folder)
    source, loaded = first_that_reads([memory, storage], load_state)
    assert source is storage
    assert_same(loaded, state())


def test_when_no_source_reads_the_last_error_is_raised(two_copies, tmp_path):
    (memory, storage), folder = two_copies
    _flip_a_shard_byte(folder)
    _flip_a_shard_byte(tmp_path / "root" / checkpoint_name(3))
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path / "root") + "|step_0000000003"):
        first_that_reads([memory, storage], load_state)
    with pytest.raises(CheckpointNotFoundError):
        first_that_reads([], load_state)
