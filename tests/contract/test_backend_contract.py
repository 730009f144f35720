"""One contract every storage backend keeps, run against each of them on real storage.

``BackendContract`` holds the tests; a backend joins by subclassing it and providing the
``backend`` fixture (a fresh, writable, empty root), ``missing_root`` (a backend whose bucket
or container does not exist, or ``None``), ``secret`` (a credential string that must never be
printed, or ``None``) and the two fault hooks ``leave_dead_lock`` and
``break_after_first_delete``. No client is mocked: faults are injected by real subclasses,
real processes, or by wrapping one real call so that it fails.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness.servers import s3_options
from mpckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    LockedError,
    MpckptError,
    StorageError,
    TransientStorageError,
)
from mpckpt.storage import open_backend
from mpckpt.storage.base import MANIFEST_NAME, Backend
from mpckpt.storage.local import LocalBackend
from tests.waiting import wait_until

DATA = bytes(range(256)) * 40  # 10240 bytes with a position-dependent pattern
MANIFEST = json.dumps({"files": {"shard-0.safetensors": len(DATA)}}).encode()


def stage(b: Backend, name: str) -> str:
    """The staging folder of ``name``, made as the pool's dispatcher makes it before the first write."""
    staging = b.staging_name(name)
    b.prepare_staging(staging)
    return staging


def put_checkpoint(b: Backend, name: str, manifest: bytes = MANIFEST, data: bytes = DATA) -> None:
    staging = stage(b, name)
    view = memoryview(data)
    b.write_file(f"{staging}/shard-0.safetensors", [view[:1000], view[1000:]])
    b.commit(staging, name, manifest)


class InjectedFault(Exception):
    pass


class BackendContract:
    """The tests; subclasses provide the fixtures and fault hooks named in the module docstring."""

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError

    @pytest.fixture
    def missing_root(self) -> Backend | None:
        return None

    @pytest.fixture
    def secret(self) -> str | None:
        return None

    def leave_dead_lock(self, backend: Backend) -> None:
        """Leave the writer lock as a writer that died without releasing it would."""
        raise NotImplementedError

    def break_after_first_delete(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make every storage deletion after the first one fail with ``InjectedFault``."""
        raise NotImplementedError

    # -- writing and committing ----------------------------------------------------------
    def test_round_trip(self, backend: Backend) -> None:
        assert isinstance(backend, Backend)
        put_checkpoint(backend, "step-1")
        assert backend.read_bytes("step-1/shard-0.safetensors") == DATA
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST
        assert backend.size("step-1/shard-0.safetensors") == len(DATA)
        assert backend.list_names() == ["step-1"]

    def test_parts_of_many_kinds_are_concatenated(self, backend: Backend) -> None:
        import array

        ints = array.array("i", range(100))
        parts = [b"head", bytearray(b"-mid-"), memoryview(ints), memoryview(b"")]
        backend.write_file("loose/file.bin", parts)
        assert backend.read_bytes("loose/file.bin") == b"head-mid-" + ints.tobytes()

    def test_write_file_overwrites_a_partial_earlier_attempt(self, backend: Backend) -> None:
        backend.write_file("loose/file.bin", [b"x" * 5000])
        backend.write_file("loose/file.bin", [b"short"])
        assert backend.read_bytes("loose/file.bin") == b"short"

    def test_no_manifest_is_visible_before_commit(self, backend: Backend) -> None:
        staging = stage(backend, "step-1")
        backend.write_file(f"{staging}/shard-0.safetensors", [DATA])
        assert not backend.exists(f"step-1/{MANIFEST_NAME}")
        backend.commit(staging, "step-1", MANIFEST)
        assert backend.exists(f"step-1/{MANIFEST_NAME}")

    def test_leftovers_of_a_failed_attempt_do_not_survive_a_commit(self, backend: Backend) -> None:
        failed = stage(backend, "step-1")
        backend.write_file(f"{failed}/junk-from-failed-attempt", [b"junk"])
        backend.abort(failed)  # what the ledger does when an attempt fails
        put_checkpoint(backend, "step-1")
        assert not backend.exists("step-1/junk-from-failed-attempt")
        assert backend.read_bytes("step-1/shard-0.safetensors") == DATA

    def test_commit_refuses_a_committed_name(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        staging = backend.staging_name("step-1")  # no check here: it makes no request
        with pytest.raises(CommitConflictError, match="step-1"):
            backend.commit(staging, "step-1", b'{"the": "loser"}')
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST
        assert backend.read_bytes("step-1/shard-0.safetensors") == DATA
        backend.abort(staging)  # what the ledger does after a failed commit
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST

    def test_commit_conflict_never_replaces_a_committed_manifest(self, backend: Backend) -> None:
        first = stage(backend, "step-1")
        second = backend.staging_name("step-1")  # two writers racing for the same name
        backend.write_file(f"{first}/shard-0.safetensors", [DATA])
        backend.commit(first, "step-1", MANIFEST)
        with pytest.raises(CommitConflictError, match="step-1"):
            backend.commit(second, "step-1", b'{"the": "loser"}')
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST
        assert backend.read_bytes("step-1/shard-0.safetensors") == DATA

    def test_the_create_only_condition_holds_inside_the_race_window(
            self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        """Both writers passed every existence check; the store itself must refuse the second."""
        first = backend.staging_name("step-1")
        second = backend.staging_name("step-1")
        backend.commit(first, "step-1", MANIFEST)
        monkeypatch.setattr(backend, "exists", lambda relpath: False)
        with pytest.raises(CommitConflictError, match="step-1"):
            backend.commit(second, "step-1", b'{"the": "loser"}')
        monkeypatch.undo()
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST

    def test_abort_removes_the_attempt_but_never_a_committed_checkpoint(self, backend: Backend) -> None:
        staging = stage(backend, "step-2")
        backend.write_file(f"{staging}/shard-0.safetensors", [DATA])
        backend.abort(staging)
        assert not backend.exists(f"{staging}/shard-0.safetensors")
        put_checkpoint(backend, "step-1")
        backend.abort("step-1")
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST

    def test_upload_file(self, backend: Backend, tmp_path: Any) -> None:
        local = tmp_path / "model.ckpt"
        local.write_bytes(DATA * 3)
        backend.upload_file("dir-ckpt/model.ckpt", str(local))
        assert backend.read_bytes("dir-ckpt/model.ckpt") == DATA * 3
        with pytest.raises(CheckpointNotFoundError, match="nope"):
            backend.upload_file("dir-ckpt/other", str(tmp_path / "nope"))

    def test_staging_name_touches_no_storage(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        before = self.stored(backend)
        names = {backend.staging_name("step-2"), backend.staging_name("step-1")}  # a committed name too
        assert self.stored(backend) == before and backend.list_names() == ["step-1"]
        assert all(not backend.exists(f"{staging}/{MANIFEST_NAME}") for staging in names - {"step-1"})
        for bad in ("../escape", "", "/absolute", "."):
            with pytest.raises(ConfigError):
                backend.staging_name(bad)

    def test_files_go_under_a_prepared_staging_folder_and_a_commit_needs_none(self, backend: Backend,
                                                                               tmp_path: Any) -> None:
        local = tmp_path / "model.ckpt"
        local.write_bytes(DATA[:100])
        for name, write in (("step-1", lambda rel: backend.write_file(rel, [DATA])),
                            ("step-2", lambda rel: backend.upload_file(rel, str(local))),
                            ("step-3", None)):  # a commit with no data file: commit makes the folder itself
            staging = backend.staging_name(name)
            if write is not None:
                backend.prepare_staging(staging)
                backend.prepare_staging(staging)  # idempotent: each wave's jobs prepare it again
                write(f"{staging}/deep/er/file.bin")
            backend.commit(staging, name, MANIFEST)
        assert backend.read_bytes("step-1/deep/er/file.bin") == DATA
        assert backend.read_bytes("step-2/deep/er/file.bin") == DATA[:100]
        assert backend.read_bytes(f"step-3/{MANIFEST_NAME}") == MANIFEST
        assert backend.list_names() == ["step-1", "step-2", "step-3"]

    def test_abort_of_a_staging_folder_never_created_is_quiet(self, backend: Backend) -> None:
        before = self.stored(backend)
        backend.abort(backend.staging_name("step-1"))
        assert self.stored(backend) == before and backend.list_names() == []

    def stored(self, backend: Backend) -> Any:
        """Everything under the root as raw storage lists it (subclasses look closer)."""
        return backend.list_names()

    # -- reading ------------------------------------------------------------------------
    @pytest.mark.parametrize(("offset", "length"), [(0, 10), (1000, 3000), (len(DATA) - 7, 7), (5, 0),
                                                    (0, len(DATA))])
    def test_read_into_ranges(self, backend: Backend, offset: int, length: int) -> None:
        backend.write_file("f.bin", [DATA])
        out = bytearray(length)
        backend.read_into("f.bin", offset, memoryview(out))
        assert bytes(out) == DATA[offset:offset + length]

    @pytest.mark.parametrize(("offset", "length"), [(len(DATA) - 5, 10), (len(DATA), 1), (len(DATA) + 100, 8)])
    def test_short_read_is_corruption(self, backend: Backend, offset: int, length: int) -> None:
        backend.write_file("f.bin", [DATA])
        with pytest.raises(CorruptCheckpointError, match="f.bin"):
            backend.read_into("f.bin", offset, memoryview(bytearray(length)))

    def test_read_bytes_with_a_size_bound(self, backend: Backend) -> None:
        backend.write_file("f.bin", [DATA])
        backend.write_file("empty.bin", [b""])
        assert backend.read_bytes("f.bin", max_bytes=len(DATA)) == DATA
        assert backend.read_bytes("empty.bin", max_bytes=0) == b""
        assert backend.read_bytes("empty.bin", max_bytes=100) == b""
        with pytest.raises(CorruptCheckpointError, match="f.bin") as info:
            backend.read_bytes("f.bin", max_bytes=len(DATA) - 1)
        assert str(len(DATA)) in str(info.value) and str(len(DATA) - 1) in str(info.value)
        with pytest.raises(CheckpointNotFoundError, match="step-9/x"):
            backend.read_bytes("step-9/x", max_bytes=100)

    def test_missing_files(self, backend: Backend) -> None:
        assert not backend.exists("step-9/shard-0.safetensors")
        for call in (lambda: backend.read_bytes("step-9/x"), lambda: backend.size("step-9/x"),
                     lambda: backend.read_into("step-9/x", 0, memoryview(bytearray(4)))):
            with pytest.raises(CheckpointNotFoundError, match="step-9/x"):
                call()

    def test_list_names_lists_top_level_folders_only(self, backend: Backend) -> None:
        assert backend.list_names() == []
        put_checkpoint(backend, "step-2")
        put_checkpoint(backend, "step-10")
        backend.write_file("half-written/a/b/c.bin", [b"x"])
        backend.write_file("top-level-file.bin", [b"x"])
        assert backend.list_names() == ["half-written", "step-10", "step-2"]

    def test_list_files_lists_the_files_directly_in_a_folder(self, backend: Backend) -> None:
        assert backend.list_files("shared") == []  # no such folder yet
        backend.write_file("shared/b.safetensors", [b"x"])
        backend.write_file("shared/a.safetensors", [DATA])
        backend.write_file("shared/deeper/c.bin", [b"x"])
        put_checkpoint(backend, "step-1")
        assert backend.list_files("shared") == ["shared/a.safetensors", "shared/b.safetensors"]
        assert backend.list_names() == ["shared", "step-1"]
        assert backend.read_bytes("shared/a.safetensors") == DATA  # written durably, straight into place

    # -- housekeeping -------------------------------------------------------------------
    def test_delete_file_removes_one_file_quietly(self, backend: Backend) -> None:
        backend.write_file("shared/a.safetensors", [DATA])
        backend.write_file("shared/b.safetensors", [DATA])
        put_checkpoint(backend, "step-1")
        backend.delete_file("shared/a.safetensors")
        backend.delete_file("shared/a.safetensors")  # idempotent
        backend.delete_file("shared/never-existed")
        assert backend.list_files("shared") == ["shared/b.safetensors"]
        assert not backend.exists("shared/a.safetensors") and backend.exists(f"step-1/{MANIFEST_NAME}")

    def test_delete(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        put_checkpoint(backend, "step-2")
        backend.delete("step-1")
        assert backend.list_names() == ["step-2"]
        assert not backend.exists(f"step-1/{MANIFEST_NAME}")
        assert not backend.exists("step-1/shard-0.safetensors")
        backend.delete("step-1")  # idempotent
        backend.delete("never-existed")

    def test_set_aside_moves_a_checkpoint_whole_and_frees_its_name(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        backend.write_file("step-1/files/deeper/user.bin", [b"a user's file"])  # a directory checkpoint's files
        backend.set_aside("step-1", "damaged.step-1.x")
        assert backend.list_names() == ["damaged.step-1.x"]
        assert not backend.exists(f"step-1/{MANIFEST_NAME}")
        assert backend.read_bytes(f"damaged.step-1.x/{MANIFEST_NAME}") == MANIFEST  # every byte kept
        assert backend.read_bytes("damaged.step-1.x/shard-0.safetensors") == DATA
        assert backend.read_bytes("damaged.step-1.x/files/deeper/user.bin") == b"a user's file"
        put_checkpoint(backend, "step-1", data=DATA[::-1])  # the name is free: the step is saved again
        assert backend.read_bytes("step-1/shard-0.safetensors") == DATA[::-1]
        assert backend.read_bytes("damaged.step-1.x/shard-0.safetensors") == DATA

    def test_delete_removes_the_manifest_first(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        put_checkpoint(backend, "step-1")
        backend.write_file("step-1/aaa-sorts-before-the-manifest.bin", [b"x"])
        self.break_after_first_delete(backend, monkeypatch)
        with pytest.raises(Exception) as info:
            backend.delete("step-1")
        assert info.errisinstance(InjectedFault) or isinstance(info.value.__cause__, InjectedFault)
        monkeypatch.undo()
        assert not backend.exists(f"step-1/{MANIFEST_NAME}")  # the checkpoint stopped existing at once
        assert backend.exists("step-1/shard-0.safetensors")  # although its data was not yet deleted

    def test_cleanup_incomplete_keeps_committed_checkpoints(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        staging = stage(backend, "step-2")
        backend.write_file(f"{staging}/shard-0.safetensors", [DATA])
        removed = backend.cleanup_incomplete()
        assert all(isinstance(r, str) for r in removed)
        assert backend.read_bytes(f"step-1/{MANIFEST_NAME}") == MANIFEST

    # -- the writer lock ----------------------------------------------------------------
    def test_writer_lock_is_exclusive(self, backend: Backend) -> None:
        lock = backend.acquire_writer_lock("writer-a")
        try:
            with pytest.raises(LockedError, match="writer-a"):
                backend.acquire_writer_lock("writer-b")
            lock.renew()
            with pytest.raises(LockedError):
                backend.acquire_writer_lock("writer-b")
        finally:
            lock.release()
        lock.release()  # idempotent
        backend.acquire_writer_lock("writer-b").release()

    def test_a_dead_writers_lock_is_taken_over(self, backend: Backend) -> None:
        self.leave_dead_lock(backend)
        lock = backend.acquire_writer_lock("writer-b")
        try:
            with pytest.raises(LockedError, match="writer-b"):
                backend.acquire_writer_lock("writer-c")
        finally:
            lock.release()

    # -- inputs, configuration, credentials -----------------------------------------------
    @pytest.mark.parametrize("relpath", ["../escape", "step-1/../../escape", "/absolute", "", ".", "a\\b"])
    def test_paths_may_not_escape_the_root(self, backend: Backend, relpath: str) -> None:
        for call in (lambda: backend.write_file(relpath, [b"x"]), lambda: backend.read_bytes(relpath),
                     lambda: backend.exists(relpath), lambda: backend.delete(relpath)):
            with pytest.raises(ConfigError):
                call()

    def test_missing_bucket_is_a_config_error_naming_the_url(self, missing_root: Backend | None) -> None:
        if missing_root is None:
            pytest.skip("this storage has no bucket or container that could be missing")
        with pytest.raises(ConfigError) as info:
            missing_root.check_writable()
        assert missing_root.url in str(info.value)
        assert "create" in str(info.value)

    def test_spec_rebuilds_an_equivalent_backend(self, backend: Backend) -> None:
        put_checkpoint(backend, "step-1")
        again = open_backend(pickle.loads(pickle.dumps(backend.spec())))
        assert again.url == backend.url
        assert again.read_bytes("step-1/shard-0.safetensors") == DATA

    def test_credentials_are_never_shown(self, backend: Backend, missing_root: Backend | None,
                                         secret: str | None) -> None:
        if secret is None:
            pytest.skip("this backend takes no credentials")
        shown = [backend.url, repr(backend), repr(backend.spec()), str(backend.spec())]
        for call in (lambda: backend.read_bytes("nope/x"), lambda: missing_root and missing_root.check_writable()):
            try:
                call()
            except MpckptError as e:
                shown.append(str(e))
        assert all(secret not in text for text in shown)


def test_retry_cures_a_flaky_call_with_backoff() -> None:
    """A backend's calls go through ``_retry.retry``: transient failures are retried, then pass."""
    from mpckpt.storage._retry import retry

    failures = [TransientStorageError("503 slow down")] * 3
    sleeps: list[float] = []

    def flaky() -> str:
        if failures:
            raise failures.pop()
        return "ok"

    assert retry(flaky, what="write s3://b/x", sleep=sleeps.append, rng=lambda: 1.0) == "ok"
    assert sleeps == [0.2, 0.4, 0.8]


# -- local disk -------------------------------------------------------------------------

_HOLD_FLOCK = """
import os, sys
from mpckpt.storage.local import LocalBackend
LocalBackend(sys.argv[1]).acquire_writer_lock("dead-writer")
os._exit(0)  # dies holding the lock, without release
"""


class TestLocal(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Any) -> Backend:
        b = LocalBackend(str(tmp_path / "root"))
        b.check_writable()
        return b

    @pytest.fixture
    def missing_root(self, tmp_path: Any) -> Backend:
        (tmp_path / "a-file").write_bytes(b"")
        return LocalBackend(str(tmp_path / "a-file" / "root"))  # cannot be created under a file

    def leave_dead_lock(self, backend: Backend) -> None:
        subprocess.run([sys.executable, "-c", _HOLD_FLOCK, backend.url], check=True, timeout=60)

    def break_after_first_delete(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        import mpckpt.storage.local as local

        def boom(*args: Any, **kwargs: Any) -> None:
            raise InjectedFault("remove tree")
        monkeypatch.setattr(local, "remove_tree", boom)  # the manifest's unlink comes first

    def stored(self, backend: Any) -> Any:
        root = Path(backend.root)
        return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else None

    def test_commit_refuses_what_is_not_a_checkpoint_folder(self, backend: Any, tmp_path: Any) -> None:
        root = Path(backend.root)
        (root / "step-1").write_bytes(b"a file where the checkpoint folder goes")
        os.symlink(tmp_path, root / "step-2")
        (root / "step-3").mkdir()
        (root / "step-3" / MANIFEST_NAME).write_bytes(b'{"torn')  # a damaged manifest is still taken
        for name, why in (("step-1", "is a regular file"), ("step-2", "is a symbolic link"),
                          ("step-3", "step-3 already exists")):
            staging = stage(backend, name)
            backend.write_file(f"{staging}/shard-0.safetensors", [DATA])
            with pytest.raises(CommitConflictError, match=why):
                backend.commit(staging, name, MANIFEST)
            backend.abort(staging)
        assert self.stored(backend) == ["step-1", "step-2", "step-3", f"step-3/{MANIFEST_NAME}"]
        assert (root / "step-2").is_symlink() and list(tmp_path.iterdir()) == [root]

    def test_shared_files_never_go_through_a_link(self, backend: Any, tmp_path: Any) -> None:
        root = Path(backend.root)
        backend.write_file("shared/a.safetensors", [DATA])
        victim = tmp_path / "victim"
        victim.write_bytes(b"someone's file")
        os.symlink(victim, root / "shared" / "link.safetensors")
        (root / "shared" / "folder").mkdir()
        assert backend.list_files("shared") == ["shared/a.safetensors"]  # no link, no folder
        backend.delete_file("shared/link.safetensors")  # the link itself, never its target
        backend.delete_file("shared/folder")  # not a file of ours: left alone
        assert victim.read_bytes() == b"someone's file" and not (root / "shared" / "link.safetensors").exists()
        assert (root / "shared" / "folder").is_dir()
        os.rename(root / "shared", tmp_path / "moved")
        os.symlink(tmp_path / "moved", root / "shared")
        with pytest.raises(CorruptCheckpointError, match="link"):
            backend.list_files("shared")
        with pytest.raises(StorageError, match="link"):
            backend.write_file("shared/b.safetensors", [DATA])
        assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == ["a.safetensors", "folder"]

    def test_a_write_never_brings_back_a_staging_folder(self, backend: Any, tmp_path: Any) -> None:
        """An uploader that outlives its trainer, or writes after an abort, fails instead of
        re-creating a staging folder the next open (or the abort) removed."""
        local = tmp_path / "model.ckpt"
        local.write_bytes(DATA[:100])
        never = backend.staging_name("step-1")
        aborted = stage(backend, "step-2")
        backend.write_file(f"{aborted}/shard-0.safetensors", [DATA])
        backend.abort(aborted)
        for staging in (never, aborted):
            for write in (lambda rel: backend.write_file(rel, [DATA]), lambda rel: backend.upload_file(rel, str(local))):
                with pytest.raises(StorageError, match="no longer exists"):
                    write(f"{staging}/deep/shard-0.safetensors")
        assert self.stored(backend) == []
        with pytest.raises(ConfigError, match="not a staging folder"):
            backend.prepare_staging("step-3")  # only a staging folder is made this way

    def test_adopt_folder_moves_the_folder_into_a_staging_folder(self, backend: Any, tmp_path: Any) -> None:
        user = tmp_path / "exported"
        (user / "sub").mkdir(parents=True)
        (user / "config.json").write_bytes(b"{}")
        (user / "sub" / "weights.bin").write_bytes(DATA)
        staging = backend.staging_name("step-1")
        backend.adopt_folder(str(user), f"{staging}/files")
        assert not user.exists()
        backend.commit(staging, "step-1", MANIFEST)
        assert backend.read_bytes("step-1/files/sub/weights.bin") == DATA
        assert backend.read_bytes("step-1/files/config.json") == b"{}"

    def test_adopt_folder_refuses_a_link_and_what_is_no_folder(self, backend: Any, tmp_path: Any) -> None:
        user = tmp_path / "exported"
        user.mkdir()
        (user / "weights.bin").write_bytes(DATA)
        os.symlink(user, tmp_path / "link")
        staging = backend.staging_name("step-1")
        for path, why in ((tmp_path / "link", "is a symbolic link"), (user / "weights.bin", "is a regular file")):
            with pytest.raises(ConfigError, match=re.escape(f"{path} {why}, not a folder")):
                backend.adopt_folder(str(path), f"{staging}/files")
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            backend.adopt_folder(str(tmp_path / "nope"), f"{staging}/files")
        assert self.stored(backend) == [] and (tmp_path / "link").is_symlink()
        assert (user / "weights.bin").read_bytes() == DATA

    def test_adopt_folder_from_another_filesystem_is_a_config_error(self, backend: Any) -> None:
        shm = Path("/dev/shm")
        if not shm.is_dir() or os.stat(shm).st_dev == os.stat(backend.root).st_dev:
            pytest.skip("needs /dev/shm on another filesystem than the test folder")
        user = shm / f"mpckpt-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        user.mkdir()
        try:
            (user / "weights.bin").write_bytes(DATA)
            staging = backend.staging_name("step-1")
            with pytest.raises(ConfigError, match="same filesystem") as info:
                backend.adopt_folder(str(user), f"{staging}/files")
            assert str(user) in str(info.value) and f"{staging}/files" in str(info.value)
            assert "ASYNC" in str(info.value) and (user / "weights.bin").read_bytes() == DATA
        finally:
            shutil.rmtree(user)

    def test_direct_io_is_a_storage_option_carried_by_the_spec(self, tmp_path: Any) -> None:
        from mpckpt.storage import spec_for_url

        root = str(tmp_path / "root")
        assert LocalBackend(root).direct_io == hasattr(os, "O_DIRECT")
        specs = (spec_for_url(root, {"direct_io": False}), spec_for_url(root, direct_io=False),
                 spec_for_url(f"file://{root}", {"direct_io": False}, direct_io=True))  # the option wins
        for i, spec in enumerate(specs):
            backend = open_backend(pickle.loads(pickle.dumps(spec)))  # as an uploader builds it
            again = open_backend(pickle.loads(pickle.dumps(backend.spec())))
            assert backend.direct_io is False and again.direct_io is False
            again.write_file(f"loose/{i}.bin", [DATA * 200])  # 2 MiB: the O_DIRECT path when it is on
            assert backend.read_bytes(f"loose/{i}.bin") == DATA * 200
        assert "direct_io" not in spec_for_url("memory://x/y", direct_io=False).options  # local roots only
        with pytest.raises(ConfigError, match="direct_io"):
            open_backend(spec_for_url(root, {"direct_io": "no"}))
        assert open_backend(spec_for_url(root, {"unknown": 1})).url == root  # ignored, as ever

    def test_missing_bucket_is_a_config_error_naming_the_url(self, missing_root: Backend | None) -> None:
        assert missing_root is not None
        with pytest.raises(ConfigError) as info:
            missing_root.check_writable()
        assert missing_root.url in str(info.value)


# -- object stores through fsspec ---------------------------------------------------------

def _write_expired_lease(backend: Backend) -> None:
    record = {"owner": "dead-writer", "token": "0" * 16, "expires_unix": time.time() - 5}
    backend.write_file(".mpckpt.lock", [json.dumps(record).encode()])


def _break_fsspec_rm(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real_rm = backend.fs.rm
    calls: list[Any] = []

    def rm_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) > 1:
            raise InjectedFault("rm")
        return real_rm(*args, **kwargs)
    monkeypatch.setattr(backend.fs, "rm", rm_once)


class ObjectStoreContract(BackendContract):
    """What object stores add: the writer lock is a lease object that expires unless renewed."""

    def leave_dead_lock(self, backend: Backend) -> None:
        _write_expired_lease(backend)

    def test_staging_name_makes_no_request(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        def no_request(*args: Any, **kwargs: Any) -> None:
            raise InjectedFault("staging_name made a request")
        monkeypatch.setattr(backend, "_call", no_request)
        monkeypatch.setattr(backend, "exists", no_request)
        assert backend.staging_name("step-1") == "step-1"

    def test_adopt_folder_needs_a_local_root(self, backend: Any, tmp_path: Any) -> None:
        (tmp_path / "exported").mkdir()
        with pytest.raises(ConfigError, match="NO_UPLOAD.*local root") as info:
            backend.adopt_folder(str(tmp_path / "exported"), "step-1/files")
        assert str(tmp_path / "exported") in str(info.value) and (tmp_path / "exported").is_dir()
        assert backend.list_names() == []

    def test_lease_expiry_is_renewed(self, backend: Any) -> None:
        lock = backend.acquire_writer_lock("writer-a")
        first = json.loads(backend.read_bytes(".mpckpt.lock"))
        time.sleep(0.01)  # time passing is the scenario: the renewed lease ends later
        lock.renew()
        second = json.loads(backend.read_bytes(".mpckpt.lock"))
        assert second["owner"] == "writer-a" and second["expires_unix"] > first["expires_unix"] > time.time()
        lock.release()
        assert not backend.exists(".mpckpt.lock")

    def test_a_takeover_after_expiry_is_noticed_at_renew(self, backend: Any) -> None:
        lock = backend.acquire_writer_lock("writer-a")
        _write_expired_lease(backend)  # writer-a's lease ran out and someone else took it over
        with pytest.raises(LockedError, match="taken over"):
            lock.renew()
        assert json.loads(backend.read_bytes(".mpckpt.lock"))["owner"] == "dead-writer"  # not clobbered
        lock.release()  # no longer ours: must not delete it
        assert backend.exists(".mpckpt.lock")


class TestMemory(ObjectStoreContract):
    @pytest.fixture
    def backend(self) -> Any:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        b = FsspecBackend(f"memory://mpckpt-test-{uuid.uuid4().hex}")
        b.check_writable()
        yield b
        b.fs.rm(b._root, recursive=True) if b.fs.exists(b._root) else None

    def break_after_first_delete(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        _break_fsspec_rm(backend, monkeypatch)

    def test_a_held_lease_renews_itself_and_a_silent_one_expires(self, backend: Any) -> None:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        short = FsspecBackend(backend.url, {"lease_s": 0.6})
        lock = short.acquire_writer_lock("writer-a")
        time.sleep(1.5)  # the scenario: more than twice the lease passes; only the keep-alive can have kept it
        with pytest.raises(LockedError, match="writer-a"):
            short.acquire_writer_lock("writer-b")
        lock._stop.set()  # the holder goes silent, as if its process had died
        lock._keepalive.join()
        wait_until(lambda: json.loads(short.read_bytes(".mpckpt.lock"))["expires_unix"] < time.time(), 30,
                   "the silent holder's lease to expire")
        short.acquire_writer_lock("writer-b").release()
        with pytest.raises(LockedError, match="taken over"):
            lock.renew()

    def test_an_unknown_scheme_is_a_config_error(self) -> None:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        with pytest.raises(ConfigError, match="nosuchscheme://x"):
            FsspecBackend("nosuchscheme://x")

    def test_transient_errors_are_retried_by_the_backend(self) -> None:
        """A real fsspec filesystem whose first writes fail with connection resets."""
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        from mpckpt.storage.fsspec_backend import FsspecBackend

        class FlakyMemory(MemoryFileSystem):
            protocol = "flakymem"
            failures = 2

            def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
                if "w" in mode and FlakyMemory.failures > 0:
                    FlakyMemory.failures -= 1
                    raise ConnectionResetError("connection reset by peer")
                return super()._open(path, mode, *args, **kwargs)

        fsspec.register_implementation("flakymem", FlakyMemory, clobber=True)
        b = FsspecBackend(f"flakymem://retry-{uuid.uuid4().hex}")
        b.write_file("x.bin", [DATA])
        assert FlakyMemory.failures == 0 and b.read_bytes("x.bin") == DATA
        FlakyMemory.failures = 99
        with pytest.raises(TransientStorageError, match="x.bin"):
            FsspecBackend(b.url, {"retry_attempts": 2}).write_file("x.bin", [DATA])


S3_SECRET = "s3cr3t-never-print-me"


@pytest.fixture(scope="module")
def bucket(moto_server: str) -> str:
    """One bucket for the module; every test gets its own prefix in it."""
    from mpckpt.storage.fsspec_backend import FsspecBackend

    name = f"mpckpt-{uuid.uuid4().hex[:12]}"
    FsspecBackend(f"s3://{name}/probe", s3_options(moto_server, create=True)).check_writable()
    return name


@pytest.mark.s3
class TestS3Moto(ObjectStoreContract):
    @pytest.fixture
    def backend(self, moto_server: str, bucket: str) -> Backend:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        options = s3_options(moto_server, secret=S3_SECRET)
        b = FsspecBackend(f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}", options)
        b.check_writable()
        return b

    @pytest.fixture
    def missing_root(self, moto_server: str) -> Backend:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        return FsspecBackend("s3://no-such-bucket-mpckpt/run", s3_options(moto_server, secret=S3_SECRET))

    @pytest.fixture
    def secret(self) -> str:
        return S3_SECRET

    def break_after_first_delete(self, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
        _break_fsspec_rm(backend, monkeypatch)

    def test_create_option_creates_the_bucket(self, moto_server: str) -> None:
        from mpckpt.storage.fsspec_backend import FsspecBackend

        b = FsspecBackend(f"s3://mpckpt-new-{uuid.uuid4().hex[:8]}/run", s3_options(moto_server, create=True))
        b.check_writable()
        put_checkpoint(b, "step-1")
        assert b.list_names() == ["step-1"]

    def test_unreachable_endpoint_is_a_config_error(self) -> None:
        from harness.servers import free_port
        from mpckpt.storage.fsspec_backend import FsspecBackend

        dead = f"http://127.0.0.1:{free_port()}"
        options = s3_options(dead, secret=S3_SECRET, config_kwargs={"retries": {"max_attempts": 1}})
        b = FsspecBackend("s3://some-bucket/run", options)
        with pytest.raises(ConfigError, match="s3://some-bucket/run") as info:
            b.check_writable()
        assert S3_SECRET not in str(info.value)


# -- Azure Blob Storage (Azurite) -----------------------------------------------------------

@pytest.fixture(scope="module")
def container(azurite_server: str) -> str:
    """One container for the module; every test gets its own prefix in it."""
    from mpckpt.storage.azure import AzureBlobBackend

    name = f"mpckpt-{uuid.uuid4().hex[:12]}"
    AzureBlobBackend(f"az://{name}/probe", {"connection_string": azurite_server, "create": True}).check_writable()
    return name


@pytest.mark.azure
class TestAzurite(ObjectStoreContract):
    @pytest.fixture
    def backend(self, azurite_server: str, container: str) -> Backend:
        from mpckpt.storage.azure import AzureBlobBackend

        # A small block size so that the block-upload path (several blocks, parts spanning blocks) is exercised.
        b = AzureBlobBackend(f"az://{container}/run-{uuid.uuid4().hex[:8]}",
                             {"connection_string": azurite_server, "block_size": 1024, "max_concurrency": 4})
        b.check_writable()
        return b

    @pytest.fixture
    def missing_root(self, azurite_server: str) -> Backend:
        from mpckpt.storage.azure import AzureBlobBackend

        return AzureBlobBackend("az://no-such-container/run", {"connection_string": azurite_server})

    @pytest.fixture
    def secret(self) -> str:
        from harness.servers import AZURITE_KEY

        return AZURITE_KEY

    def break_after_first_delete(self, backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        real = backend._container.delete_blob
        calls: list[Any] = []

        def delete_once(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            if len(calls) > 1:
                raise InjectedFault("delete_blob")
            return real(*args, **kwargs)
        monkeypatch.setattr(backend._container, "delete_blob", delete_once)

    def test_create_option_creates_the_container(self, azurite_server: str) -> None:
        from mpckpt.storage.azure import AzureBlobBackend

        b = AzureBlobBackend(f"az://mpckpt-new-{uuid.uuid4().hex[:8]}/run",
                             {"connection_string": azurite_server, "create": True})
        b.check_writable()
        put_checkpoint(b, "step-1")
        assert b.list_names() == ["step-1"]

    def test_abfs_url_with_account_and_key_options(self, azurite_server: str, container: str) -> None:
        from harness.servers import AZURITE_ACCOUNT, AZURITE_KEY
        from mpckpt.storage.azure import AzureBlobBackend

        endpoint = azurite_server.split("BlobEndpoint=")[1].rstrip(";")
        b = AzureBlobBackend(f"abfs://{container}@{AZURITE_ACCOUNT}.dfs.core.windows.net/abfs-run",
                             {"account_url": endpoint, "account_key": AZURITE_KEY})
        b.check_writable()
        put_checkpoint(b, "step-1")
        assert b.read_bytes("step-1/shard-0.safetensors") == DATA

    def test_credentials_from_the_environment(self, azurite_server: str, container: str) -> None:
        from mpckpt.storage.azure import AzureBlobBackend

        b = AzureBlobBackend(f"az://{container}/env-run", environ={"AZURE_STORAGE_CONNECTION_STRING": azurite_server})
        b.check_writable()
        assert b.list_names() == []

    def test_wrong_key_is_a_config_error_naming_the_url(self, azurite_server: str, container: str) -> None:
        import base64

        from harness.servers import AZURITE_KEY
        from mpckpt.storage.azure import AzureBlobBackend

        wrong = base64.b64encode(b"not the key" * 6).decode()
        b = AzureBlobBackend(f"az://{container}/run", {"connection_string": azurite_server.replace(AZURITE_KEY, wrong)})
        with pytest.raises(ConfigError, match=f"az://{container}/run") as info:
            b.check_writable()
        assert wrong not in str(info.value) and AZURITE_KEY not in str(info.value)

    def test_unreachable_account_is_a_config_error(self, azurite_server: str) -> None:
        from harness.servers import AZURITE_KEY, free_port
        from mpckpt.storage.azure import AzureBlobBackend

        conn = azurite_server.split("BlobEndpoint=")[0] + f"BlobEndpoint=http://127.0.0.1:{free_port()}/x;"
        b = AzureBlobBackend("az://any/run", {"connection_string": conn})
        with pytest.raises(ConfigError, match="az://any/run") as info:
            b.check_writable()
        assert AZURITE_KEY not in str(info.value)

    def test_large_shard_in_many_blocks_from_many_parts(self, backend: Any) -> None:
        blob = bytes(range(251)) * 400  # 100400 bytes: ~98 blocks of 1 KiB, parts cut off-block
        view = memoryview(blob)
        parts = [view[:333], view[333:70_000], view[70_000:70_001], view[70_001:]]
        backend.write_file("big/shard.bin", parts)
        assert backend.read_bytes("big/shard.bin") == blob
        backend.write_file("big/shard.bin", [view[:5000]])  # a retry with fewer blocks replaces it
        assert backend.read_bytes("big/shard.bin") == blob[:5000]
        out = bytearray(50_000)
        backend.write_file("big/shard.bin", parts)
        backend.read_into("big/shard.bin", 12_345, memoryview(out))
        assert bytes(out) == blob[12_345:62_345]

    def test_bad_options_are_config_errors(self, azurite_server: str) -> None:
        from mpckpt.storage.azure import AzureBlobBackend

        with pytest.raises(ConfigError, match="block_size"):
            AzureBlobBackend("az://c/p", {"connection_string": azurite_server, "block_size": 0})
        with pytest.raises(ConfigError, match="bogus"):
            AzureBlobBackend("az://c/p", {"connection_string": azurite_server, "bogus": 1})
        with pytest.raises(ConfigError, match="container"):
            AzureBlobBackend("az:///p", {"connection_string": azurite_server})
