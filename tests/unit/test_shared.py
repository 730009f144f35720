"""Who uses which file outside its folder: shared files, older refs, the manifest format rules."""

from __future__ import annotations

import dataclasses

import pytest

from mpckpt._commit.shared import deletion_blockers, shared_users
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.manifest import FileEntry, Manifest, format_version_for
from mpckpt.format.names import is_shared_path, shared_path

X = "shared/step_0000000000.aa.shard-00001.safetensors"
Y = "shared/step_0000000003.bb.shard-00001.safetensors"


def manifest(step: int, **files: FileEntry) -> Manifest:
    entries = {"skeleton.json": FileEntry(10, "0" * 16), **{k.replace("_", "-") + ".safetensors": v
                                                             for k, v in files.items()}}
    return Manifest(step=step, seq=step, kind="state", files=entries,
                    format_version=format_version_for("state", entries))


def test_shared_paths_are_new_every_time_and_only_those_are_shared_paths():
    a, b = shared_path(42, "shard-00001.safetensors"), shared_path(42, "shard-00001.safetensors")
    assert a != b and a.startswith("shared/step_0000000042.") and a.endswith(".shard-00001.safetensors")
    assert is_shared_path(a)
    for bad in ("shared/../x", "shared/a/b", "step_0000000001/x", "shared/", "shared/.hidden", "/shared/x",
                "shared/a b", "shared/..", 7):
        assert not is_shared_path(bad), bad  # type: ignore[arg-type]


def test_who_uses_what():
    committed = {
        0: manifest(0, shard_1=FileEntry(5, "1" * 16, shared=X)),
        1: manifest(1, shard_1=FileEntry(5, "1" * 16, shared=X)),
        3: manifest(3, shard_1=FileEntry(5, "2" * 16, shared=Y)),
        4: manifest(4, shard_1=FileEntry(5, "1" * 16, ref="step_0000000002")),  # an older root's
    }
    assert shared_users(committed) == {X: [0, 1], Y: [3]}
    assert deletion_blockers(committed, [0, 1, 3]) == {}  # shared files never block a deletion
    assert deletion_blockers(committed, [2]) == {2: [4]}
    assert deletion_blockers(committed, [2, 4]) == {}  # deleted together
    assert committed[0].format_version == 3 and committed[4].format_version == 1


def test_a_shared_entry_round_trips_and_is_refused_where_it_cannot_be():
    m = manifest(0, shard_1=FileEntry(5, "1" * 16, shared=X))
    back = Manifest.from_bytes(m.to_bytes(), path="m")
    assert back.files["shard-1.safetensors"].shared == X and back.location("step_0000000000", "shard-1.safetensors") == X
    assert back.shared_files() == {X} and back.referenced_folders() == set()
    for bad in (dataclasses.replace(m, format_version=1),  # an older reader would look in the folder
                manifest(0, shard_1=FileEntry(5, "1" * 16, ref="step_0000000002", shared=X))):
        with pytest.raises(CorruptCheckpointError, match="shared"):
            Manifest.from_bytes(bad.to_bytes(), path="m")
