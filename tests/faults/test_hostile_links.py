"""Hostile and damaged checkpoint roots: links, FIFOs, folders and huge files where files should be.

Anyone who can write into a checkpoint root (or a crash, or bit rot) can plant things there.
Whatever is planted, mpckpt must never write, truncate or delete through a link; never return,
nor reveal anything about, data from outside the root; never block on a FIFO nor read without
a bound; and never let a raw ``OSError`` escape where a user calls it.

Each case copies a root that a real Checkpointer committed, plants one thing, and runs what a
user would run: ``Checkpointer``, ``mpckpt.load``, ``python -m mpckpt.cli``. Those assert what
must not happen (a victim file changed, a hang, data from outside returned, an error that is
not an ``MpckptError``); the exact errors are asserted at the backend (``LocalBackend``).
Whatever could hang or exhaust memory runs in a subprocess with a timeout and a memory limit,
or in a thread whose FIFO the test itself releases, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mpckpt
from mpckpt import Checkpoint
from mpckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MpckptError,
    StorageError,
)
from mpckpt.storage.local import LocalBackend
from tests.conftest import assert_same, make_model, train_step

REPO = str(Path(__file__).resolve().parents[2])
STEP1, STEP2 = "step_0000000001", "step_0000000002"
HANG_S = 60           # far more than any of these commands needs; only a hang reaches it
MEMORY_LIMIT = 1 << 30  # what a subprocess may allocate: less than reading /dev/zero "whole" takes
VICTIM = b"someone else's precious bytes\n"

# What a user runs, in a subprocess: prints REFUSED for an MpckptError; anything else is a traceback.
USER = """
import sys
import mpckpt
from mpckpt.errors import MpckptError

what, root = sys.argv[1], sys.argv[2]
step = int(sys.argv[3]) if len(sys.argv) > 3 else None
try:
    if what == "load":
        mpckpt.load(root, step=step)
    else:
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            print("STEPS", ckpt.steps())
except MpckptError as e:
    print("REFUSED", type(e).__name__, e)
else:
    print("DONE")
"""


def state_for(step: int) -> dict[str, Any]:
    model, opt = make_model(width=32, depth=2, seed=step)
    train_step(model, opt, seed=step)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state_for(step))
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of a root with two committed checkpoints (steps 1 and 2)."""
    dest = tmp_path / "run"
    shutil.copytree(pristine, dest)
    return dest


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return path


def shard_of(folder: Path) -> str:
    shards = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    assert shards, list(folder.iterdir())
    return shards[0]


def fingerprint(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def replace_with_link(path: Path, target: Path | str) -> None:
    path.unlink()
    os.symlink(target, path)


# Each subprocess limits its own memory first (no preexec_fn: the test process may have threads),
# then runs the code it was given (sys.argv[1]) with the remaining arguments.
BOUNDED = ("import resource, sys; resource.setrlimit(resource.RLIMIT_DATA, ({0}, {0})); code = sys.argv.pop(1); "
           "exec(compile(code, '<test>', 'exec'), {{'__name__': '__main__'}})")
AS_MODULE = "import runpy; runpy.run_module('{0}', run_name='__main__', alter_sys=True)"


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Python ``code`` with ``args`` in a subprocess, with bounded memory and time; a hang fails."""
    argv = [sys.executable, "-c", BOUNDED.format(MEMORY_LIMIT), code, *args]
    try:
        return subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                              capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args} hung for {HANG_S}s")


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m mpckpt.cli ARGS`` (run as a module, under the memory limit)."""
    return run(AS_MODULE.format("mpckpt.cli"), *map(str, args))


def user(what: str, root: Path, step: int | None = None) -> subprocess.CompletedProcess[str]:
    r = run(USER, what, str(root), *([] if step is None else [str(step)]))
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)  # only MpckptErrors
    return r


def error_text(e: BaseException) -> str:
    """A message with its notes and causes: everything a user could be shown."""
    parts: list[str] = []
    cur: BaseException | None = e
    while cur is not None and len(parts) < 20:
        parts += [str(cur), *getattr(cur, "__notes__", [])]
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


# -- the writer lock ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["gc", "Checkpointer"])
@pytest.mark.parametrize("plant", ["symlink", "hard link"])
def test_a_planted_lock_never_overwrites_its_target(root: Path, victim: Path, plant: str, how: str) -> None:
    lock = root / ".mpckpt.lock"
    lock.unlink()
    os.symlink(victim, lock) if plant == "symlink" else os.link(victim, lock)
    if how == "gc":
        r = cli("gc", root)
        refusal = r.stderr if r.returncode == 1 and "Traceback" not in r.stderr else f"no refusal: {r}"
    else:
        refusal = "opened"
        try:
            with mpckpt.Checkpointer(root, workers=1):
                pass
        except StorageError as e:
            refusal = str(e)
    assert victim.read_bytes() == VICTIM
    assert ".mpckpt.lock" in refusal and ("symbolic link" if plant == "symlink" else "hard links") in refusal, refusal


def test_a_dangling_lock_link_creates_nothing(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "would-be-created"
    lock = root / ".mpckpt.lock"
    replace_with_link(lock, target)
    with pytest.raises(StorageError, match=r"\.mpckpt\.lock is a symbolic link; mpckpt never follows links"):
        LocalBackend(str(root)).acquire_writer_lock("test")
    assert not os.path.lexists(target)


@pytest.mark.parametrize("kind", ["a folder", "a FIFO"])
def test_a_lock_that_is_no_file_is_a_clear_error(root: Path, kind: str) -> None:
    lock = root / ".mpckpt.lock"
    lock.unlink()
    lock.mkdir() if kind == "a folder" else os.mkfifo(lock)
    r = cli("gc", root)  # first in a subprocess: a FIFO must not block
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f".mpckpt.lock is {kind}" in r.stderr
    with pytest.raises(StorageError, match=re.escape(f"{lock} is {kind} where mpckpt expects its lock file")):
        LocalBackend(str(root)).acquire_writer_lock("test")
    with pytest.raises(StorageError, match=r"\.mpckpt\.lock"):
        mpckpt.Checkpointer(root, workers=1)
    assert lock.is_dir() if kind == "a folder" else stat.S_ISFIFO(os.lstat(lock).st_mode)  # left as it was


def test_gc_of_a_missing_root_says_so_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    r = cli("gc", missing)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{missing} does not exist" in r.stderr
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        LocalBackend(str(missing)).acquire_writer_lock("test")
    assert not missing.exists()


# -- a step folder that is a link --------------------------------------------------------------

@pytest.fixture
def run_b(root: Path, tmp_path: Path) -> Path:
    """A second run whose ``step_0000000002`` is a link to the first run's."""
    path = tmp_path / "runB"
    path.mkdir()
    os.symlink(root / STEP2, path / STEP2)
    return path


def test_retention_never_deletes_through_a_linked_step_folder(root: Path, run_b: Path) -> None:
    before, loaded = fingerprint(root / STEP2), mpckpt.load(root, step=2)
    with mpckpt.Checkpointer(run_b, workers=1, keep_last=1) as ckpt:
        for step in (3, 4):
            ckpt.save(step, state_for(step))
        ckpt.wait()
        assert ckpt.steps() == [4]
    assert fingerprint(root / STEP2) == before
    assert_same(mpckpt.load(root, step=2), loaded)


@pytest.mark.parametrize("how", ["load", "ls", "verify", "Checkpointer"])
def test_a_linked_step_folder_is_no_checkpoint(root: Path, run_b: Path, how: str) -> None:
    assert LocalBackend(str(run_b)).list_names() == []
    if how == "load":
        with pytest.raises(CheckpointNotFoundError):
            mpckpt.load(run_b)
    elif how == "ls":
        r = cli("ls", run_b)
        assert r.returncode == 0 and r.stdout.strip() == "", r
    elif how == "verify":
        r = cli("verify", run_b, "--step", "2")
        assert r.returncode == 1 and "ok" not in r.stdout, r
    else:
        with mpckpt.Checkpointer(run_b, workers=1) as ckpt:
            assert ckpt.steps() == []
    assert (root / STEP2 / "manifest.json").is_file()


def test_delete_removes_a_link_never_its_target(root: Path, run_b: Path) -> None:
    before = fingerprint(root / STEP2)
    LocalBackend(str(run_b)).delete(STEP2)
    assert fingerprint(root / STEP2) == before
    assert not os.path.lexists(run_b / STEP2)  # the link itself is gone


# -- a file that is a link -------------------------------------------------------------------------

def link_to_copy(root: Path, which: str, tmp_path: Path) -> tuple[str, Path]:
    """Replace a file of step 2 by a link to an exact copy outside the root (checksums match)."""
    folder = root / STEP2
    name = shard_of(folder) if which == "shard" else which
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    copy = outside / name
    shutil.copyfile(folder / name, copy)
    replace_with_link(folder / name, copy)
    return f"{STEP2}/{name}", copy


LINKABLE = ["manifest.json", "skeleton.json", "shard"]


@pytest.mark.parametrize("which", LINKABLE)
def test_the_backend_refuses_a_file_linked_outside_even_with_the_right_bytes(
        root: Path, tmp_path: Path, which: str) -> None:
    rel, copy = link_to_copy(root, which, tmp_path)
    b = LocalBackend(str(root))
    calls: list[Callable[[], object]] = [lambda: b.read_bytes(rel), lambda: b.read_bytes(rel, max_bytes=1 << 20),
                                         lambda: b.size(rel), lambda: b.exists(rel),
                                         lambda: b.read_into(rel, 0, memoryview(bytearray(8)))]
    for call in calls:
        with pytest.raises(CorruptCheckpointError, match="is a symbolic link; mpckpt never follows links") as info:
            call()
        assert info.value.path == str(root / rel) and str(copy) not in error_text(info.value)


@pytest.mark.parametrize("how", ["load", "verify"])
@pytest.mark.parametrize("which", LINKABLE)
def test_users_never_get_bytes_from_a_file_linked_outside(root: Path, tmp_path: Path, which: str, how: str) -> None:
    link_to_copy(root, which, tmp_path)
    if how == "load":
        with pytest.raises(MpckptError):
            mpckpt.load(root, step=2)
        mpckpt.load(root, step=1)  # the other checkpoint is unharmed
    else:
        r = cli("verify", root, "--step", "2")
        assert r.returncode == 1 and "ok" not in r.stdout and "Traceback" not in r.stderr, r


def test_a_link_to_a_big_file_reveals_nothing_about_it(root: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that takes no disk
    folder = root / STEP2
    name = shard_of(folder)
    replace_with_link(folder / name, big)
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{name} is a symbolic link")) as info:
        LocalBackend(str(root)).size(f"{STEP2}/{name}")
    with pytest.raises(MpckptError) as loaded:
        mpckpt.load(root, step=2)
    for text in (error_text(info.value), error_text(loaded.value)):
        assert str(1 << 30) not in text and str(big) not in text, text


@pytest.mark.parametrize("how", ["load", "Checkpointer", "gc"])
def test_a_manifest_linked_to_dev_zero_is_refused_unread(root: Path, how: str) -> None:
    manifest = root / STEP2 / "manifest.json"
    replace_with_link(manifest, "/dev/zero")
    if how == "gc":
        r = cli("gc", root)
        assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    elif how == "load":
        assert "REFUSED" in user("load", root, 2).stdout
    else:
        r = user("open", root)  # opens without step 2, or refuses to open: either way no MemoryError
        assert "STEPS [1]" in r.stdout or "REFUSED" in r.stdout, r.stdout
    assert manifest.is_symlink()  # damaged: reported, never deleted by mpckpt
    with pytest.raises(CorruptCheckpointError, match="manifest.json is a symbolic link"):
        LocalBackend(str(root)).read_bytes(f"{STEP2}/manifest.json")


def test_a_huge_manifest_is_refused_unread(root: Path) -> None:
    manifest = root / STEP2 / "manifest.json"
    os.truncate(manifest, 1 << 30)  # sparse
    with pytest.raises(CorruptCheckpointError) as info:
        LocalBackend(str(root)).read_bytes(f"{STEP2}/manifest.json", max_bytes=1 << 20)
    assert info.value.path == str(manifest)
    assert all(s in str(info.value) for s in (str(manifest), str(1 << 30), str(1 << 20))), info.value
    r = user("load", root, 2)  # under the memory limit: the ledger bounds the manifest it reads
    assert "REFUSED" in r.stdout, r.stdout


# -- FIFOs, folders and loops where a file should be ---------------------------------------------------

@pytest.mark.parametrize("how", ["load", "Checkpointer", "ls", "verify", "gc"])
def test_a_manifest_fifo_never_blocks(root: Path, how: str) -> None:
    manifest = root / STEP2 / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    if how in ("ls", "verify", "gc"):
        r = cli(how, root)
        assert "Traceback" not in r.stderr and r.returncode in (0, 1), r
    else:
        user("load" if how == "load" else "open", root)
    assert stat.S_ISFIFO(os.lstat(manifest).st_mode)  # damaged: never deleted


def test_the_backend_refuses_a_fifo_at_once(root: Path) -> None:
    fifo = root / STEP2 / "manifest.json"
    fifo.unlink()
    os.mkfifo(fifo)
    b = LocalBackend(str(root))
    rel = f"{STEP2}/manifest.json"
    calls: dict[str, Callable[[], object]] = {
        "read_bytes": lambda: b.read_bytes(rel), "read_into": lambda: b.read_into(rel, 0, memoryview(bytearray(4))),
        "size": lambda: b.size(rel), "exists": lambda: b.exists(rel)}
    outcome: dict[str, object] = {}

    def attempt() -> None:
        for name, call in calls.items():
            try:
                outcome[name] = call()
            except Exception as e:  # noqa: BLE001 - judged below
                outcome[name] = e

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(HANG_S / 2)
    blocked = thread.is_alive()
    while thread.is_alive():  # release the blocked reader (it reads EOF) so the thread ends
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(0.2)
    assert not blocked, "a read blocked on a FIFO"
    for name in calls:
        e = outcome[name]
        assert isinstance(e, CorruptCheckpointError), (name, e)
        assert str(e) == f"{fifo} is a FIFO where mpckpt expects a regular file; remove it", (name, e)


@pytest.mark.parametrize("kind", ["folder", "self link", "link loop"])
def test_a_manifest_that_is_no_file_is_corruption_and_is_kept(root: Path, kind: str) -> None:
    manifest = root / STEP2 / "manifest.json"
    manifest.unlink()
    if kind == "folder":
        manifest.mkdir()
        (manifest / "x").write_bytes(b"{}")
    elif kind == "self link":
        os.symlink("manifest.json", manifest)
    else:
        os.symlink("other.json", manifest)
        os.symlink("manifest.json", manifest.parent / "other.json")
    b = LocalBackend(str(root))
    rel = f"{STEP2}/manifest.json"
    expected = "is a folder where mpckpt expects a regular file" if kind == "folder" else "is a symbolic link"
    for call in (lambda: b.read_bytes(rel), lambda: b.size(rel), lambda: b.exists(rel)):
        with pytest.raises(CorruptCheckpointError, match=expected) as info:
            call()
        assert info.value.path == str(manifest)
    try:
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            assert 2 not in ckpt.steps()
    except MpckptError:
        pass
    r = cli("gc", root)
    assert "Traceback" not in r.stderr, r.stderr
    assert os.path.lexists(manifest)  # damaged: never deleted


def test_a_linked_folder_inside_a_checkpoint_is_refused(tmp_path: Path) -> None:
    export = tmp_path / "export"
    (export / "sub").mkdir(parents=True)
    (export / "sub" / "data.bin").write_bytes(b"d" * 1000)
    (export / "config.json").write_text("{}")
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.report({"loss": 1.0}, Checkpoint.from_directory(export), step=5, mode="sync")
    folder = root / "step_0000000005" / "files"  # where a directory checkpoint keeps the user's files
    outside = tmp_path / "outside"
    shutil.copytree(folder / "sub", outside)  # the very same bytes: checksums would match
    shutil.rmtree(folder / "sub")
    os.symlink(outside, folder / "sub")
    r = cli("verify", root, "--step", "5")
    assert r.returncode == 1 and "symbolic link" in r.stderr and "Traceback" not in r.stderr, r
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder / 'sub'} is a symbolic link")):
        LocalBackend(str(root)).read_bytes("step_0000000005/files/sub/data.bin")


@pytest.mark.parametrize("rel", [f"{STEP2}/{'x' * 300}", f"{STEP2}/skeleton.json/x", f"{STEP2}/manifest.json/x"],
                         ids=["name-too-long", "under-a-file", "under-the-manifest"])
def test_a_path_that_cannot_exist_is_not_found(root: Path, rel: str) -> None:
    b = LocalBackend(str(root))
    assert b.exists(rel) is False
    for call in (lambda: b.read_bytes(rel), lambda: b.size(rel), lambda: b.read_into(rel, 0, memoryview(bytearray(4)))):
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            call()


# -- writing into a staging folder ---------------------------------------------------------------------

@pytest.mark.parametrize("how", ["write_file", "upload_file"])
@pytest.mark.parametrize("plant", ["symlink", "dangling symlink", "hard link", "linked folder"])
def test_a_link_planted_in_a_staging_folder_is_never_written_through(
        tmp_path: Path, victim: Path, plant: str, how: str) -> None:
    b = LocalBackend(str(tmp_path / "run"))
    b.check_writable()
    staging = b.staging_name("step_0000000007")
    folder = tmp_path / "run" / staging
    folder.mkdir()  # as an earlier file of this checkpoint would have
    victim_dir, nowhere = tmp_path / "victim-dir", tmp_path / "would-be-created"
    victim_dir.mkdir()
    target = folder / "shard.safetensors"
    if plant == "symlink":
        os.symlink(victim, target)
    elif plant == "dangling symlink":
        os.symlink(nowhere, target)
    elif plant == "hard link":
        os.link(victim, target)
    else:
        os.symlink(victim_dir, folder / "sub")
        target = folder / "sub" / "shard.safetensors"
    rel = str(target.relative_to(tmp_path / "run"))
    data = bytes(range(256)) * (8 << 10)  # 2 MiB: the O_DIRECT path where the filesystem has it

    def write() -> None:
        if how == "write_file":
            b.write_file(rel, [memoryview(data)])
        else:
            src = tmp_path / "src.bin"
            src.write_bytes(data)
            b.upload_file(rel, str(src))

    try:
        write()
    except StorageError as e:
        refusal: StorageError | None = e
    else:
        refusal = None
    assert victim.read_bytes() == VICTIM and list(victim_dir.iterdir()) == [] and not os.path.lexists(nowhere)
    if plant == "linked folder":  # refused: mpckpt does not replace folders it did not make
        assert refusal is not None and f"{folder / 'sub'} is a symbolic link" in str(refusal), refusal
    else:  # the planted entry was replaced by a file of its own
        assert refusal is None and not target.is_symlink() and target.stat().st_nlink == 1
        assert target.read_bytes() == data


@pytest.mark.parametrize("how", ["prepare_staging", "write_file", "upload_file", "adopt_folder"])
def test_a_link_planted_as_the_staging_folder_is_never_written_through(
        tmp_path: Path, victim: Path, how: str) -> None:
    """``prepare_staging`` makes the staging folder: a link planted under its name is refused, by it
    and by every write under it."""
    b = LocalBackend(str(tmp_path / "run"))
    b.check_writable()
    staging = b.staging_name("step_0000000007")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    os.symlink(victim_dir, tmp_path / "run" / staging)
    src = tmp_path / "user-folder"
    src.mkdir()
    (src / "model.bin").write_bytes(b"m" * 100)
    with pytest.raises(StorageError, match=re.escape(f"{tmp_path / 'run' / staging} is a symbolic link")):
        if how == "prepare_staging":
            b.prepare_staging(staging)
        elif how == "write_file":
            b.write_file(f"{staging}/shard.safetensors", [b"x" * 100])
        elif how == "upload_file":
            b.upload_file(f"{staging}/shard.safetensors", str(src / "model.bin"))
        else:
            b.adopt_folder(str(src), f"{staging}/files")
    assert list(victim_dir.iterdir()) == [] and (src / "model.bin").read_bytes() == b"m" * 100
    assert (tmp_path / "run" / staging).is_symlink()  # not ours to remove at a write; abort unlinks it
    b.abort(staging)
    assert not os.path.lexists(tmp_path / "run" / staging) and victim_dir.is_dir()
