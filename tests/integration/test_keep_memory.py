"""Snapshots kept in this node's shared memory: restarts restore from them, and only when they are safe.

Real processes SIGKILLed at the moments that matter (mid-upload, mid-snapshot, after a memory-only
save), real /dev/shm. In-process cases close with ``leave_in_memory=True`` (what a crash leaves)
and then damage what was left: one flipped byte, a removed or truncated data file, another
user's or another root's files, a wrong mode. Each must fall back to storage with the right
step, and never restore a wrong byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt._keep import store
from mpckpt._system import shm as _shm
from mpckpt.errors import ConfigError
from tests.conftest import assert_same, make_model, train_step
from tests.integration.gated_backend import gated_url
from tests.waiting import wait_until

TRAINER = str(Path(__file__).with_name("keep_trainer.py"))
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_kept_left(tmp_path: Path) -> Any:
    """What a test kept in memory for its roots goes with it (anyone else's is never touched: other
    test runs may keep snapshots on this machine at the same time)."""
    yield
    for kept in store.list_kept():
        if kept.root is not None and kept.root.startswith(str(tmp_path)) and not kept.held:
            store.remove_kept(kept.base)


def trainer(root: Path, out: Path, *args: Any, ok: bool = True) -> int:
    """Run ``keep_trainer.py`` to its end (or its SIGKILL); its exit code. Its output goes to a file,
    not a pipe: the uploaders of a killed trainer may outlive it a while (one blocked at a closed
    gate does until the gate opens), and a pipe they hold would keep this waiting for them."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    log = out / "trainer.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, TRAINER, str(root), str(out), *map(str, args)], env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=180)
    if ok:
        assert proc.returncode == 0, log.read_text()[-3000:]
    return proc.returncode


def restored(out: Path) -> dict[str, Any]:
    return json.loads((out / "restored.json").read_text())


def assert_restored(out: Path, saved_in: Path, step: int) -> None:
    """What the restart in ``out`` restored is, bit for bit, what the run in ``saved_in`` saved at ``step``."""
    assert_same(torch.load(out / "restored.pt"), torch.load(saved_in / f"state-{step}.pt"))


def kept_files(url: str) -> list[str]:
    base = store.base_name(url, 0)
    return sorted(n for n in os.listdir(store.SHM_DIR) if n.startswith(base))


# -- SIGKILLed trainers, restarted ---------------------------------------------------------------------

def test_a_kill_right_after_a_memory_only_save_loses_no_step(tmp_path):
    root = tmp_path / "root"
    code = trainer(root, tmp_path / "a", "--steps", 6, "--storage-every", 3, "--kill-after", 4, ok=False)
    assert code == -9
    assert not (root / "step_0000000004").exists(), "a memory-only save is never uploaded"
    trainer(root, tmp_path / "b", "--steps", 6, "--storage-every", 3)
    seen = restored(tmp_path / "b")
    assert (seen["step"], seen["source"]) == (4, "memory") and seen["bytes"] > 0
    assert_restored(tmp_path / "b", tmp_path / "a", 4)


def test_a_kill_during_the_upload_restores_that_step_from_memory(tmp_path):
    root, gate = tmp_path / "root", tmp_path / "gate"
    code = trainer(root, tmp_path / "a", "--steps", 5, "--gate", gate, "--kill-after", 2, ok=False)
    assert code == -9
    assert not list(root.glob("step_*")), "no upload may have finished: the gate was closed"
    gate.touch()
    trainer(root, tmp_path / "b", "--steps", 5, "--gate", gate)
    seen = restored(tmp_path / "b")
    assert (seen["step"], seen["source"]) == (2, "memory")
    assert_restored(tmp_path / "b", tmp_path / "a", 2)
    assert mpckpt.Checkpointer(root, read_only=True).steps() == [3, 4]


def test_a_kill_mid_snapshot_restores_the_previous_complete_one(tmp_path):
    root = tmp_path / "root"
    # overlapped: save(3) returns before its copy is complete, and the kill comes at once
    code = trainer(root, tmp_path / "a", "--steps", 6, "--mode", "memory", "--overlap", "--kill-after", 3, ok=False)
    assert code == -9
    trainer(root, tmp_path / "b", "--steps", 6, "--mode", "memory")
    seen = restored(tmp_path / "b")
    assert seen["source"] == "memory" and seen["step"] in (2, 3), seen
    assert_restored(tmp_path / "b", tmp_path / "a", seen["step"])


# -- what a crash leaves, damaged: storage is used, with the right step ------------------------------

def _crash(root: Path, steps: int, *, memory_after: int | None = None, **options: Any) -> dict[int, Any]:
    """Save ``steps`` steps (the ones after ``memory_after`` in memory only) and close as a crash
    would leave things: the kept snapshot stays. Returns the state saved at each step."""
    model, opt = make_model()
    saved = {}
    with mpckpt.Checkpointer(root, memory_budget="64MiB", **options) as ckpt:
        for s in range(steps):
            train_step(model, opt, s)
            mode = "memory" if memory_after is not None and s > memory_after else "sync"
            ckpt.save(s, {"model": model, "optim": opt}, mode=mode)
            saved[s] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        ckpt.close(leave_in_memory=True)
    return saved


def _restart(root: Path, **options: Any) -> tuple[mpckpt.Checkpointer, dict[str, Any], int | None]:
    model, opt = make_model(seed=7)
    ckpt = mpckpt.Checkpointer(root, memory_budget="64MiB", **options)
    state = {"model": model, "optim": opt}
    return ckpt, state, ckpt.restore(state)


def test_an_intact_kept_snapshot_is_restored_from_memory_and_its_slab_serves_the_next_save(tmp_path):
    root = tmp_path / "root"
    saved = _crash(root, 3)
    ckpt, state, step = _restart(root)
    with ckpt:
        assert step == 2 and ckpt.last_restore.source == "memory" and ckpt.last_restore.bytes > 0
        assert_same({k: v for k, v in state["model"].state_dict().items()}, saved[2]["model"])
        arena = ckpt._rt.arena
        taken = arena._slabs[0].name  # the kept slab, taken over by the restore (before any spare)
        wait_until(lambda: not arena._creating and arena._spares.empty(), 60,
                   "the restore's background prepare (two slabs) finished")
        adopted = {s.name for s in arena._slabs}
        assert taken in adopted and len(adopted) <= 3, ("the kept slab was taken over", adopted)  # + two prepared
        ckpt.save(3, state)
        assert ckpt._rt.keeper.kept[0].name in adopted, "the first save after the restart made a new slab"


@pytest.mark.parametrize("damage", ["flip", "remove", "truncate", "mode", "record"])
def test_a_damaged_kept_snapshot_falls_back_to_storage(tmp_path, damage, caplog):
    root = tmp_path / "root"
    saved = _crash(root, 3)
    names = kept_files(str(root))
    data = next(n for n in names if not n.endswith((".lock", ".record")))
    path = os.path.join(store.SHM_DIR, data)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "remove":
        os.unlink(path)
    elif damage == "truncate":
        os.truncate(path, 4096)
    elif damage == "mode":
        os.chmod(path, 0o644)
    else:
        record = os.path.join(store.SHM_DIR, store.record_names(store.base_name(str(root), 0))[-1])
        with open(record, "r+b") as f:
            f.seek(40)
            f.write(b"#")
    ckpt, state, step = _restart(root)
    with ckpt:
        assert step == 2 and ckpt.last_restore.source == "storage", (damage, ckpt.last_restore)
        assert_same({k: v for k, v in state["model"].state_dict().items()}, saved[2]["model"])
    assert "memory" in caplog.text


def test_a_kept_snapshot_truncated_after_the_open_found_it_falls_back_to_storage(tmp_path, caplog):
    """The data shrinks between the open (which checked its size) and the restore's reads: a short
    read, said and read past, never a SIGBUS nor a wrong byte."""
    root = tmp_path / "root"
    saved = _crash(root, 3)
    data = next(n for n in kept_files(str(root)) if not n.endswith((".lock", ".record")))
    model, opt = make_model(seed=7)
    state = {"model": model, "optim": opt}
    with mpckpt.Checkpointer(root, memory_budget="64MiB") as ckpt:
        assert ckpt._rt.keeper.found is not None, "the open found the kept snapshot"
        os.truncate(os.path.join(store.SHM_DIR, data), 4096)
        assert ckpt.restore(state) == 2 and ckpt.last_restore.source == "storage", ckpt.last_restore
        assert_same({k: v for k, v in state["model"].state_dict().items()}, saved[2]["model"])
    assert "truncated" in caplog.text and "trying storage" in caplog.text


def test_a_damaged_memory_only_step_falls_back_to_the_newest_on_storage(tmp_path):
    root = tmp_path / "root"
    saved = _crash(root, 4, memory_after=1)  # 0, 1 on storage; 2, 3 in memory (3 kept)
    data = next(n for n in kept_files(str(root)) if not n.endswith((".lock", ".record")))
    with open(os.path.join(store.SHM_DIR, data), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    ckpt, state, step = _restart(root)
    with ckpt:
        assert step == 1 and ckpt.last_restore.source == "storage"
        assert_same({k: v for k, v in state["model"].state_dict().items()}, saved[1]["model"])
        ckpt.save(2, state)  # step 2 may be saved again: memory's 3 was never restored


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_another_users_kept_snapshot_is_never_used(tmp_path, caplog):
    root = tmp_path / "root"
    _crash(root, 3, memory_after=1)
    for name in kept_files(str(root)):
        os.chown(os.path.join(store.SHM_DIR, name), 4242, 4242)
    ckpt, _, step = _restart(root)
    with ckpt:
        assert step == 1 and ckpt.last_restore.source == "storage"
    assert "cannot keep" in caplog.text or "user" in caplog.text
    for name in kept_files(str(root)):
        os.chown(os.path.join(store.SHM_DIR, name), 0, 0)


def test_another_roots_kept_snapshot_is_never_read_reaped_or_trusted(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    _crash(a, 3, memory_after=1)
    left = kept_files(str(a))
    _crash(b, 2)  # b's own snapshot, then its record replaced by a's (named as b's)
    base_a, base_b = store.base_name(str(a), 0), store.base_name(str(b), 0)
    [record_a] = store.record_names(base_a)
    for name in store.record_names(base_b):
        os.unlink(os.path.join(store.SHM_DIR, name))
    os.replace(os.path.join(store.SHM_DIR, record_a),
               os.path.join(store.SHM_DIR, record_a.replace(base_a, base_b)))
    ckpt, _, step = _restart(b)
    with ckpt:
        assert step == 1 and ckpt.last_restore.source == "storage"
    assert f"a snapshot of {str(a)!r}" in caplog.text
    assert set(left) - {record_a} <= set(os.listdir(store.SHM_DIR)), "a's files were removed by b"


def test_keep_in_memory_off_keeps_nothing_and_close_releases_what_it_kept(tmp_path):
    root = tmp_path / "root"
    model, opt = make_model()
    with mpckpt.Checkpointer(root, keep_in_memory=False, memory_budget="64MiB") as ckpt:
        ckpt.save(0, {"model": model, "optim": opt}, mode="sync")
        assert not [n for n in kept_files(str(root)) if not n.endswith(".lock")]
    with mpckpt.Checkpointer(root, memory_budget="64MiB") as ckpt:
        ckpt.save(1, {"model": model, "optim": opt}, mode="sync")
        assert any(n.endswith(".record") for n in kept_files(str(root)))
    assert kept_files(str(root)) == [], "close() without leave_in_memory releases the kept snapshot"


def test_the_kept_slab_counts_against_the_budget(tmp_path, caplog):
    model, opt = make_model(width=512, depth=2)  # ~6 MiB with the moments
    state = {"model": model, "optim": opt}
    with mpckpt.Checkpointer(tmp_path / "roomy", memory_budget="64MiB") as ckpt:
        for s in range(4):
            train_step(model, opt, s)
            ckpt.save(s, state)
            arena = ckpt._rt.arena
            assert arena.allocated_bytes <= arena.budget_bytes
        ckpt.wait()
        assert ckpt._rt.keeper.kept is not None
    with mpckpt.Checkpointer(tmp_path / "tight", memory_budget="13MiB", policy="block") as ckpt:
        for s in range(3):
            train_step(model, opt, s)
            ckpt.save(s, state, mode="sync")
            assert ckpt._rt.arena.allocated_bytes <= ckpt._rt.arena.budget_bytes
    assert _shm.segments_of_this_process() == []


def test_memory_saves_need_one_slab_and_are_refused_clearly_otherwise(tmp_path):
    model, opt = make_model(width=512, depth=2)
    train_step(model, opt, 0)  # ~6 MiB with the moments
    with mpckpt.Checkpointer(tmp_path / "r", memory_budget="4MiB") as ckpt:
        with pytest.raises(ConfigError, match="memory_budget"):
            ckpt.save(0, {"model": model, "optim": opt}, mode="memory")


def test_environment_variable_sets_keep_in_memory(tmp_path):
    from mpckpt.config import Config

    assert Config.resolve(environ={}).keep_in_memory is True
    assert Config.resolve(environ={"MPCKPT_KEEP_IN_MEMORY": "0"}).keep_in_memory is False
    with pytest.raises(ConfigError, match="MPCKPT_KEEP_IN_MEMORY"):
        Config.resolve(environ={"MPCKPT_KEEP_IN_MEMORY": "maybe"})


def test_mpckpt_gc_removes_the_kept_snapshots_of_the_roots_given_that_no_trainer_keeps(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    _crash(root, 2)
    _crash(other, 1)
    assert any(n.endswith(".record") for n in kept_files(str(root)))
    with mpckpt.Checkpointer(tmp_path / "live", memory_budget="64MiB") as live:
        model, opt = make_model()
        live.save(0, {"model": model, "optim": opt}, mode="memory")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        listed = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc"], capture_output=True, text=True,
                                timeout=120, env=env)
        assert listed.returncode == 0, listed.stderr
        assert f"left the snapshot of step 0 of {tmp_path / 'live'} (rank 0) kept in memory" in listed.stdout
        assert f"left the snapshot of step 1 of {root} (rank 0) kept in memory" in listed.stdout
        assert f"`mpckpt gc {other}` removes it" in listed.stdout
        assert any(n.endswith(".record") for n in kept_files(str(root))), "gc without a ROOT removes none"
        missing = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc", str(tmp_path / "typo")],
                                 capture_output=True, text=True, timeout=120, env=env)
        assert missing.returncode == 1 and "does not exist" in missing.stderr, missing
        assert missing.stdout == "", "a gc of a root that does not exist spoke of other roots' snapshots"
        out = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc", str(root)], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert f"removed the snapshot of step 1 of {root} (rank 0) kept in memory" in out.stdout, out.stdout
        assert str(other) not in out.stdout and "live" not in out.stdout, out.stdout
        assert kept_files(str(root)) == []
        assert any(n.endswith(".record") for n in kept_files(str(tmp_path / "live")))
        assert any(n.endswith(".record") for n in kept_files(str(other))), "another root's was removed"


def test_mpckpt_gc_without_a_root_removes_no_incomplete_snapshot_and_gc_root_removes_only_its_own(tmp_path):
    """A kept snapshot whose record is missing (an interrupted keep leaves its lock, or data with
    no record) belongs to the root whose key its names carry: ``mpckpt gc`` lists it and removes
    nothing, ``mpckpt gc ROOT`` removes ROOT's and leaves another root's."""
    root, other = tmp_path / "root", tmp_path / "other"
    left = []
    for url in (root, other):
        base = store.base_name(str(url), 3)
        for name in (f"{base}.lock", f"{base}-{'0' * 32}"):
            fd = os.open(store.data_path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, b"\0" * 4096)
            os.close(fd)
            left.append(store.data_path(name))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        listed = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc"], capture_output=True, text=True,
                                timeout=120, env=env)
        assert listed.returncode == 0, listed.stderr
        for url in (root, other):
            assert f"left the incomplete snapshot {store.base_name(str(url), 3)} (rank 3) in memory" in listed.stdout
        assert all(os.path.exists(p) for p in left), "gc without a ROOT removed files"
        mpckpt.Checkpointer(root, workers=1).close()  # (a root a Checkpointer used: gc collects it)
        out = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc", str(root)], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert f"removed the incomplete snapshot {store.base_name(str(root), 3)} (rank 3)" in out.stdout, out.stdout
        assert str(store.base_name(str(other), 3)) not in out.stdout
        assert [os.path.exists(p) for p in left] == [False, False, True, True]
    finally:
        for path in left:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("overlap,strided", [(False, False), (False, True), (True, False)])
def test_a_kept_snapshot_has_the_checksums_storage_gets(tmp_path, overlap, strided):
    """The copy that hashes as it goes (eager, contiguous tensors) and the hash after the copy
    (overlapped, or a strided tensor) give each file the xxh3 the uploaders compute from the same
    slab: the manifest's."""
    model, opt = make_model(width=300, depth=3)
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt, "odd": torch.arange(7, dtype=torch.int16)}
    if strided:
        state["t"] = torch.randn(5, 3).t()
    with mpckpt.Checkpointer(tmp_path / "r", memory_budget="64MiB", overlap=overlap) as ckpt:
        ckpt.save(1, state, mode="sync")
        ckpt.wait()  # (the record is published before its checksums, then again with them)
        record = ckpt._rt.keeper.kept[1]
        manifest = ckpt._rt.ledger.committed()[1]
        assert record.step == 1 and record.file_entries() == manifest.files
        [found] = store.read_kept(str(tmp_path / "r"), 0, 1)  # what a restart would find: the same
        try:
            assert not found.record.pending and found.record.file_entries() == manifest.files
        finally:
            found.close()


def test_a_kept_record_is_completed_with_the_checksums_of_its_uploads(tmp_path):
    """A single process's kept record is published pending and completed once the uploads of its
    slab are done, with the checksums they computed (the slab is not read again for them, beside
    the training steps that follow the save): pending while its uploads are held at a gate."""
    gate = tmp_path / "gate"
    state = {"w": torch.randn(300, 300), "b": torch.arange(11, dtype=torch.int64)}
    with mpckpt.Checkpointer(gated_url(tmp_path / "r"), storage_options={"gate": str(gate)}, workers=1,
                             memory_budget="64MiB") as ckpt:
        try:
            future = ckpt.save(1, state)
            ckpt._rt.keeper.wait(1.0)  # (a completion that did not wait for the uploads is over by now)
            record = ckpt._rt.keeper.kept[1]
            assert not future.done() and record.step == 1 and record.pending
        finally:
            os.close(os.open(gate, os.O_CREAT | os.O_WRONLY))  # open the gate (never hold the close)
        ckpt.wait()
        record = ckpt._rt.keeper.kept[1]
        assert not record.pending and record.file_entries() == ckpt._rt.ledger.committed()[1].files


def test_a_record_published_before_its_checksums_is_completed_and_restored_from_memory(tmp_path, caplog):
    """A process killed after ``save()`` returned but before the checksums were in the record leaves
    it pending: the restart computes them from the slab (nothing writes a kept slab while its
    record exists) and restores that step from memory, bit for bit, then saves on."""
    root = tmp_path / "root"
    model, opt = make_model()
    with mpckpt.Checkpointer(root, memory_budget="64MiB") as ckpt:
        train_step(model, opt, 0)
        ckpt.save(1, {"model": model, "optim": opt}, mode="sync")
        train_step(model, opt, 1)
        ckpt.save(2, {"model": model, "optim": opt}, mode="memory")
        ckpt.wait()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        keeper = ckpt._rt.keeper
        slab, record = keeper.kept
        assert not record.pending
        pending = dataclasses.replace(record, spans={rel: dataclasses.replace(span, checksum=None)
                                                     for rel, span in record.spans.items()})
        keeper.store.publish_record(pending, again=True)  # as the save left it, before ``_complete_later``
        ckpt.close(leave_in_memory=True)
    on_shm = os.path.join(store.SHM_DIR, store.record_names(store.base_name(str(root), 0))[-1])
    with open(on_shm, "rb") as f:
        assert b'"xxh3_64":null' in f.read()
    caplog.set_level("INFO", logger="mpckpt")
    ckpt, state, step = _restart(root)
    with ckpt:
        assert step == 2 and ckpt.last_restore.source == "memory", ckpt.last_restore
        assert_same(dict(state["model"].state_dict()), saved)
        assert "had no checksums yet" in caplog.text
        assert ckpt._rt.keeper.kept is not None and not ckpt._rt.keeper.kept[1].pending
        ckpt.save(3, state, mode="sync")
        ckpt.wait()
        assert ckpt._rt.keeper.kept[1].step == 3 and not ckpt._rt.keeper.kept[1].pending


def test_mpckpt_gc_names_the_copies_held_for_other_nodes_and_removes_them_like_kept_snapshots(tmp_path):
    """A copy of another node's snapshot (``peer_copies``) left on this node by a trainer that died
    is listed by ``mpckpt gc`` as such, and removed by ``mpckpt gc ROOT`` (no live process holds it)."""
    import dataclasses
    import shutil

    root = tmp_path / "root"
    _crash(root, 1)
    url = str(root)
    [found] = store.read_kept(url, 0, 1)
    copy = store.KeptStore(url, 0, store.PEER_PREFIX)
    assert copy.hold()
    name = copy.new_data_name()
    shutil.copyfile(store.data_path(found.record.data), store.data_path(name))
    os.chmod(store.data_path(name), 0o600)
    copy.publish_record(dataclasses.replace(found.record, data=name))
    found.close()
    copy.release(leave=True)
    [peer] = store.read_kept(url, 0, 1, store.PEER_PREFIX)
    step = found.record.step
    assert peer.record.step == step
    peer.close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    listed = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert f"left the copy held for another node of step {step} of {root} (rank 0) kept in memory" in listed.stdout, \
        listed
    out = subprocess.run([sys.executable, "-m", "mpckpt.cli", "gc", str(root)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert f"removed the copy held for another node of step {step} of {root} (rank 0)" in out.stdout, out
    assert store.read_kept(url, 0, 1, store.PEER_PREFIX) == []
    assert not [n for n in os.listdir(store.SHM_DIR) if n.startswith(store.base_name(url, 0, prefix=store.PEER_PREFIX))]
