"""Hostile and damaged checkpoint roots: no bad folder blocks the rest, nothing valid is lost.

Each case writes a real folder on disk the way an attacker who can write into the root would
(checksums recomputed, so only the content is hostile) or the way a crash or bit rot leaves it,
always beside good checkpoints of steps 0 and 1. Then, as a user would:

- ``mpckpt.load`` of a good step works; loading the bad one raises an ``MpckptError`` (never a
  raw ``TypeError``, ``RecursionError`` ...) naming the file;
- a ``Checkpointer`` opens, ``restore(fallback=True)`` falls back to step 1, saving goes on;
- ``mpckpt ls`` / ``verify`` / ``gc`` finish (bounded by a timeout), print no traceback, and
  ``verify`` exits 1; nothing that might be someone's data is deleted.

Links, FIFOs and other file-system tricks are in ``test_hostile_links.py``; shared memory in
``test_hostile_shm.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt.errors import CorruptCheckpointError, MpckptError
from mpckpt.format.manifest import FileEntry, Manifest, checksum
from mpckpt.storage.local import LocalBackend
from tests.commands import mpckpt_in_process
from tests.conftest import assert_same
from tests.legacy_roots import make_legacy
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
GOOD = (0, 1)
BAD = 5


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7 + step)
    return {"model": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)},
            "device": torch.device("cpu"), "step": step}


def blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(32, 16), "b": torch.zeros(16)}, "device": torch.device("cpu"), "step": -1}


def folder(root: Path, step: int) -> Path:
    return root / f"step_{step:010d}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with good checkpoints of steps 0 and 1."""
    path = tmp_path / "root"
    with mpckpt.Checkpointer(path, workers=1) as ckpt:
        for step in GOOD:
            ckpt.save(step, state_for(step), metrics={"loss": 1.0 / (step + 1)})
    return path


# -- forging, as someone who can write into the root -----------------------------------------------

def manifest_of(path: Path) -> Manifest:
    return Manifest.from_bytes((path / "manifest.json").read_bytes(), path=str(path))


def write_manifest_body(path: Path, body: dict[str, Any]) -> None:
    """Write a manifest body with a matching manifest checksum (only the content is hostile)."""
    body = dict(body)
    body.pop("manifest_checksum", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["manifest_checksum"] = checksum(canonical.encode())
    (path / "manifest.json").write_text(json.dumps(body, sort_keys=True))


def manifest_body(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_bytes())


def forge_file(path: Path, rel: str, data: bytes) -> None:
    """Replace file ``rel`` of a committed folder and make its manifest agree."""
    (path / rel).write_bytes(data)
    m = manifest_of(path)
    files = {**m.files, rel: FileEntry(len(data), checksum(data))}
    (path / "manifest.json").write_bytes(dataclasses.replace(m, files=files).to_bytes())


def copy_as(root: Path, src_step: int, step: int) -> Path:
    """A valid checkpoint of ``step``: the folder of ``src_step`` with its manifest re-stepped."""
    dst = folder(root, step)
    shutil.copytree(folder(root, src_step), dst)
    body = manifest_body(dst)
    body.update(step=step, seq=body["seq"] + step)
    write_manifest_body(dst, body)
    return dst


def shard_of(path: Path) -> str:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0]


def rewrite_header(path: Path, change: Any) -> None:
    """Parse a shard's header, let ``change`` edit the dict (or return raw bytes), keep the length."""
    rel = shard_of(path)
    data = (path / rel).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = change(header)
    text = out if isinstance(out, bytes) else json.dumps(header).encode()
    if len(text) <= n:
        text += b" " * (n - len(text))
        forged = data[:8] + text + data[8 + n:]
    else:
        forged = struct.pack("<Q", len(text)) + text + data[8 + n:]
    forge_file(path, rel, forged)


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- what must hold whatever the damage ------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    return mpckpt_in_process(*args)  # (the callers assert on its output; an exception it lets out fails the test)


def assert_no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def assert_rest_works(root: Path, bad: Path | None, *, bad_step: int | None = BAD) -> None:
    """The good checkpoints load, a Checkpointer works beside the bad folder, the CLI copes."""
    for step in GOOD:
        assert_same(state_for(step), mpckpt.load(root, step=step))
    for command in ("ls", "verify", "gc"):
        done = cli(command, str(root))
        assert_no_traceback(done)
        if command == "verify" and bad_step is not None:
            assert done.returncode == 1, done.stdout + done.stderr
            assert f"step {bad_step}" in done.stderr
    state = blank()
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        assert ckpt.restore(state, fallback=True) == GOOD[-1]  # (a damaged step is then moved aside, whole)
        assert_same(state_for(GOOD[-1]), state)
        ckpt.save(100, state_for(100))
    assert_same(state_for(100), mpckpt.load(root, step=100))
    for command in ("ls", "verify", "gc"):
        assert_no_traceback(cli(command, str(root)))
    if bad is not None:  # kept where it was, or moved whole with its damaged folder (restore(fallback=True))
        assert bad.exists() or bad.is_symlink() or _set_aside(root, bad), f"{bad} was deleted: it may be someone's data"


def _set_aside(root: Path, path: Path) -> bool:
    """Whether ``path`` (below a ``step_*`` folder of ``root``) is now in that folder's set-aside copy."""
    folder, *rest = path.relative_to(root).parts
    return any((aside.joinpath(*rest).exists() or aside.joinpath(*rest).is_symlink())
               for aside in root.glob(f"damaged.{folder}.*"))


def assert_bad_step_refused(root: Path, step: int = BAD) -> None:
    with pytest.raises(MpckptError) as info:
        mpckpt.load(root, step=step)
    assert f"step_{step:010d}" in str(info.value) or f"step {step}" in str(info.value)
    with pytest.raises(CorruptCheckpointError):
        mpckpt.load(root)  # the newest is the bad one: it says why, never silently goes back
    state = blank()
    with mpckpt.Checkpointer(root, workers=1) as ckpt, pytest.raises(CorruptCheckpointError):
        ckpt.restore(state)


# -- 10. manifests that used to stop the whole root --------------------------------------------------

def _shared_as(body: dict[str, Any], path: Any, *, version: int = 3) -> dict[str, Any]:
    """Every file listed as a shared file at ``path(rel)``, in format ``version``."""
    return {**body, "format_version": version,
            "files": {k: {**v, "shared": path(k)} for k, v in body["files"].items()}}


MANIFEST_DAMAGE = {
    "5000-digit integer": None,  # written raw below: Python itself will not serialise it
    "100k-deep JSON": None,  # written raw below
    "not UTF-8": None,
    "kind evil": lambda body: {**body, "kind": "evil"},
    "files is a list": lambda body: {**body, "files": [1, 2]},
    "size is a bool": lambda body: {**body, "files": {k: {**v, "size": True} for k, v in body["files"].items()}},
    "ref escapes": lambda body: {**body, "files": {k: {**v, "ref": "../elsewhere"} for k, v in body["files"].items()}},
    "shared escapes": lambda body: _shared_as(body, lambda rel: "shared/../../etc/passwd"),
    "shared in another step": lambda body: _shared_as(body, lambda rel: f"step_0000000000/{rel}"),
    "shared before version 3": lambda body: _shared_as(body, lambda rel: "shared/x", version=1),
    "version is a string": lambda body: {**body, "format_version": "1"},
    "negative step": lambda body: {**body, "step": -5},
    "metrics is a list": lambda body: {**body, "metrics": [1]},
    "created is a string": lambda body: {**body, "created_unix": "yesterday"},
}


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
def test_a_hostile_manifest_is_reported_and_the_rest_works(root, damage):
    bad = copy_as(root, 1, BAD)
    change = MANIFEST_DAMAGE[damage]
    if damage == "5000-digit integer":
        text = json.dumps({**manifest_body(bad), "step": "STEP"}).replace('"STEP"', "9" * 5000)
        (bad / "manifest.json").write_text(text)
    elif damage == "100k-deep JSON":
        (bad / "manifest.json").write_text('{"format":"mpckpt","x":' + deep_json(100_000) + "}")
    elif damage == "not UTF-8":
        (bad / "manifest.json").write_bytes(b"\xff\xfe" + os.urandom(64))
    else:
        write_manifest_body(bad, change(manifest_body(bad)))
    assert_bad_step_refused(root)
    assert_rest_works(root, bad)


def test_a_manifest_of_another_step_is_not_loaded_as_either(root):
    bad = folder(root, BAD)
    shutil.copytree(folder(root, 1), bad)  # a folder copied by hand: its manifest says step 1
    with pytest.raises(CorruptCheckpointError, match="step 1"):
        mpckpt.load(root, step=BAD)
    assert_rest_works(root, bad)


@pytest.mark.parametrize("name", ["step_²", "step_2", "step_1", "step_00000000001", "step_0000000001.bak",
                                  "step_-000000001", "step_0000000001 "])
def test_folders_that_are_not_our_names_are_ignored_and_kept(root, name):
    stray = root / name
    if name == "step_²":
        stray.mkdir()
    else:  # an intact checkpoint of step 1 (step 0's files) under a name mpckpt never writes
        shutil.copytree(folder(root, 0), stray)
        body = manifest_body(stray)
        body.update(step=1)
        write_manifest_body(stray, body)
    assert_same(state_for(1), mpckpt.load(root))  # not shadowed: the real step 1
    assert_same(state_for(1), mpckpt.load(root, step=1))
    done = cli("ls", str(root))
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert_rest_works(root, stray, bad_step=None)


# -- 11. hostile skeletons and safetensors headers ------------------------------------------------------

def _skeleton(change: Any) -> Any:
    def apply(path: Path) -> None:
        doc = json.loads((path / "skeleton.json").read_bytes())
        out = change(doc)
        forge_file(path, "skeleton.json", out if isinstance(out, bytes) else json.dumps(doc).encode())
    return apply


def _tree_device(doc: dict[str, Any]) -> None:
    doc["tree"]["v"][doc["tree"]["k"].index("device")] = {"__mpckpt__": "device", "v": "foo"}


SKELETON_DAMAGE = {
    "version is a string": _skeleton(lambda d: d.update(version="1")),
    "version is huge": _skeleton(lambda d: d.update(version=10**400)),  # 401 digits: serialisable
    "leaves is a dict": _skeleton(lambda d: d.update(leaves={"a": 1})),
    "table index 99": _skeleton(lambda d: d["table"].__setitem__(0, {"leaf": 99})),
    "tensor id 99": _skeleton(lambda d: d["tree"]["v"][0]["v"].__setitem__(0, {"__mpckpt__": "tensor", "id": 99})),
    "device foo": _skeleton(_tree_device),
    "unknown node": _skeleton(lambda d: d["tree"]["v"].__setitem__(0, {"__mpckpt__": "exec", "v": "rm -rf"})),
    "deep JSON": _skeleton(lambda d: ('{"version":1,"tree":' + deep_json(100_000) + ',"table":[],"leaves":[]}').encode()),
    "5000-digit integer": _skeleton(lambda d: json.dumps({**d, "tree": "T"}).replace('"T"', "7" * 5000).encode()),
    "not JSON": _skeleton(lambda d: b"\x00not json"),
    "a view with a bad stride": _skeleton(lambda d: d["table"].__setitem__(
        0, {"view_of": 0, "dtype": "float32", "shape": [10**6], "stride": [1], "byte_offset": 0})),
    "shape does not match": _skeleton(lambda d: d["leaves"][0].update(shape=[3, 3])),
    "dtype unknown": _skeleton(lambda d: d["leaves"][0].update(dtype="float128")),
    "parts name a missing shard": _skeleton(lambda d: d["leaves"][0].update(
        parts=[["shard-99999.safetensors", "x", 0, -1]])),
}

HEADER_DAMAGE = {
    "header is not JSON": lambda h: b"{not json" + b" " * 8,
    "header is deep JSON": lambda h: deep_json(50_000).encode(),
    "offsets past the end": lambda h: [v.update(data_offsets=[0, 10**12]) for k, v in h.items() if k != "__metadata__"],
    "unknown dtype": lambda h: [v.update(dtype="F128") for k, v in h.items() if k != "__metadata__"],
    "negative shape": lambda h: [v.update(shape=[-1]) for k, v in h.items() if k != "__metadata__"],
    "huge integer shape": lambda h: [v.update(shape=[10**30]) for k, v in h.items() if k != "__metadata__"],
    "entries overlap": lambda h: [v.update(data_offsets=[0, 4]) for k, v in h.items() if k != "__metadata__"],
}


@pytest.mark.parametrize("damage", list(SKELETON_DAMAGE))
def test_a_hostile_skeleton_is_a_corrupt_checkpoint(root, damage):
    bad = copy_as(root, 1, BAD)
    SKELETON_DAMAGE[damage](bad)
    with pytest.raises(CorruptCheckpointError, match="skeleton"):
        mpckpt.load(root, step=BAD)
    assert_bad_step_refused(root)
    assert_rest_works(root, bad)


@pytest.mark.parametrize("damage", list(HEADER_DAMAGE))
def test_a_hostile_shard_header_is_a_corrupt_checkpoint_and_verify_says_so(root, damage):
    bad = copy_as(root, 1, BAD)
    rewrite_header(bad, HEADER_DAMAGE[damage])
    with pytest.raises(CorruptCheckpointError, match="safetensors"):
        mpckpt.load(root, step=BAD)
    done = cli("verify", str(root), "--step", str(BAD))
    assert done.returncode == 1, done.stdout  # the checksum matches: only a real parse can tell
    assert_no_traceback(done)
    assert_rest_works(root, bad)


def test_a_huge_sparse_skeleton_is_refused_before_it_is_allocated(root, tmp_path):
    bad = copy_as(root, 1, BAD)
    size = 64 << 30
    with open(bad / "skeleton.json", "r+b") as f:
        f.truncate(size)  # sparse: costs no disk
    m = manifest_of(bad)
    files = {**m.files, "skeleton.json": FileEntry(size, "0" * 16)}
    (bad / "manifest.json").write_bytes(dataclasses.replace(m, files=files).to_bytes())
    # a 2 GiB address-space limit: allocating the 64 GiB file would fail with MemoryError
    code = textwrap.dedent(f"""
        import resource, sys
        import torch
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import mpckpt
        from mpckpt.errors import CorruptCheckpointError
        try:
            mpckpt.load({str(root)!r}, step={BAD})
        except CorruptCheckpointError as e:
            print("refused:", e)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "skeleton.json" in done.stdout


# -- 6. files a valid checkpoint references are never deleted -------------------------------------------

class Adapter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(64, 64)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(64, 4)


@pytest.mark.parametrize("layout", ["shared files", "refs into step folders (before format 3)"])
@pytest.mark.parametrize("damage", ["manifest deleted", "manifest torn"])
@pytest.mark.parametrize("cleaner", ["Checkpointer", "gc"])
def test_a_folder_whose_files_are_referenced_is_kept(tmp_path, damage, cleaner, layout):
    path = tmp_path / "lora"
    model = Adapter()
    with mpckpt.Checkpointer(path, workers=1) as ckpt:
        ckpt.save(0, {"model": model}, mode="sync")
        with torch.no_grad():
            model.head.weight.add_(1.0)
        ckpt.save(1, {"model": model}, mode="sync")
    if layout.startswith("refs"):
        make_legacy(path)
        m1 = manifest_of(folder(path, 1))
        assert any(e.ref == "step_0000000000" for e in m1.files.values())  # step 1 uses step 0's frozen shard
    else:
        m1 = manifest_of(folder(path, 1))
        assert any(e.shared is not None for e in m1.files.values())  # step 0's frozen shard, in shared/
    target = folder(path, 0) / "manifest.json"
    if damage == "manifest deleted":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[:40])
    if cleaner == "gc":
        assert_no_traceback(cli("gc", str(path)))
    else:
        with mpckpt.Checkpointer(path, workers=1):
            pass
    loaded = mpckpt.load(path, step=1)
    assert torch.equal(loaded["model"]["base.weight"], model.base.weight)
    assert torch.equal(loaded["model"]["head.weight"], model.head.weight)
    # a manifest-less folder goes unless step 1 reads files in it; a torn one is damaged: kept
    assert folder(path, 0).exists() == (layout.startswith("refs") or damage == "manifest torn")


# -- 7. user files never collide with mpckpt's own names ------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "sync", "no_upload"])
def test_a_directory_checkpoint_may_hold_files_named_like_ours(tmp_path, mode):
    src = tmp_path / "hf"
    src.mkdir()
    mine = {"manifest.json": b'{"mine": true}', "skeleton.json": b"[1, 2]", "sub/manifest.json": b"nested",
            "model.safetensors": b"\x00" * 100}
    for rel, data in mine.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    root = tmp_path / "root"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.report({"loss": 0.5}, checkpoint=mpckpt.Checkpoint.from_directory(src), step=3, mode=mode)
        ckpt.wait()
        with ckpt.checkpoint(3).as_directory() as d:
            got = {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}
        assert got == mine
        assert sorted(ckpt.checkpoint(3).files()) == sorted(mine)
    out = ckpt_dir = tmp_path / "out"
    mpckpt_root = mpckpt.Checkpointer(root, workers=1)
    try:
        mpckpt_root.checkpoint(3).to_directory(ckpt_dir)
    finally:
        mpckpt_root.close()
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == mine
    done = cli("verify", str(root))
    assert done.returncode == 0, done.stderr


# -- 12. as_directory verifies what it hands back ---------------------------------------------------------

def _directory_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "files"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(4096))
    (src / "config.json").write_text('{"layers": 2}')
    root = tmp_path / "root"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.report(checkpoint=mpckpt.Checkpoint.from_directory(src), step=0, mode="sync")
    return root, folder(root, 0)


@pytest.mark.parametrize("damage", ["flipped byte", "unlisted file", "unlisted link", "missing file"])
def test_as_directory_refuses_a_folder_that_does_not_verify(tmp_path, damage):
    root, path = _directory_checkpoint(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("secret")
    weights = next(path.rglob("weights.bin"))
    if damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[100] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "unlisted file":
        (weights.parent / "extra.py").write_text("import os")
    elif damage == "unlisted link":
        (weights.parent / "leak.txt").symlink_to(victim)
    else:
        weights.unlink()
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        with pytest.raises(CorruptCheckpointError), ckpt.checkpoint(0).as_directory():
            pass


# -- 13. mpckpt verify / ls / gc never pass or crash on damage -----------------------------------------

def test_verify_fails_on_a_torn_manifest(root):
    target = folder(root, 1) / "manifest.json"
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    done = cli("verify", str(root))
    assert done.returncode == 1
    assert "step 1" in done.stderr and "manifest" in done.stderr
    assert_no_traceback(done)


@pytest.mark.parametrize("command", ["ls", "verify", "gc"])
def test_commands_on_a_missing_root_fail_clearly(tmp_path, command):
    missing = tmp_path / "no" / "such" / "root"
    done = cli(command, str(missing))
    assert done.returncode == 1
    assert str(missing) in done.stderr
    assert_no_traceback(done)
    assert not missing.exists()  # looking is not creating


@pytest.mark.parametrize("entry", ["x" * 300, "skeleton.json/x", "sub"])
def test_verify_reports_odd_manifest_entries_without_a_traceback(root, entry):
    path = folder(root, 1)
    if entry == "sub":
        (path / "sub").mkdir()
    m = manifest_of(path)
    files = {**m.files, entry: FileEntry(10, "0" * 16)}
    (path / "manifest.json").write_bytes(dataclasses.replace(m, files=files).to_bytes())
    done = cli("verify", str(root))
    assert done.returncode == 1
    assert "step 1" in done.stderr
    assert_no_traceback(done)
    try:  # load reads only the files the skeleton uses: it may work, but never with a raw error
        mpckpt.load(root, step=1)
    except MpckptError:
        pass


def test_verify_does_not_print_terminal_escapes_from_a_manifest(root):
    path = folder(root, 1)
    m = manifest_of(path)
    evil = "\x1b]0;owned\x07\x1b[2Jshard.bin"
    files = {**m.files, evil: FileEntry(10, "0" * 16)}
    (path / "manifest.json").write_bytes(dataclasses.replace(m, files=files).to_bytes())
    for command in ("verify", "ls"):
        done = cli(command, str(root))
        assert "\x1b" not in done.stdout + done.stderr
        assert "\x07" not in done.stdout + done.stderr
        assert_no_traceback(done)


def test_gc_with_a_lock_that_is_a_directory_fails_clearly(root):
    (root / ".mpckpt.lock").unlink()
    (root / ".mpckpt.lock").mkdir()
    done = cli("gc", str(root))
    assert done.returncode == 1
    assert ".mpckpt.lock" in done.stderr
    assert_no_traceback(done)
    assert folder(root, 1).exists()


# -- 15, 16. readers beside a live writer; NaN metrics ----------------------------------------------------

def test_loads_beside_a_writer_whose_retention_deletes_never_fail(tmp_path):
    path, stop = tmp_path / "live", tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, torch, mpckpt
        with mpckpt.Checkpointer({str(path)!r}, workers=1, keep_last=1) as ckpt:
            step = 0
            while not os.path.exists({str(stop)!r}) and step < 5000:
                ckpt.save(step, {{"w": torch.full((2 << 20,), float(step))}}, mode="sync")  # 8 MiB
                step += 1
    """)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        def first_commit() -> bool:
            assert writer.poll() is None, "the writer ended before its first commit"
            return bool(list(path.glob("step_*")))

        wait_until(first_commit, 180, "the writer's first commit", poll_s=0.05)
        steps, loads, deadline = set(), 0, time.monotonic() + 180
        # Each load races the writer's next commit and its deletion of this one; keep loading until
        # the writer has moved on a dozen times meanwhile (how fast it does depends on machine load).
        while len(steps) <= 10 and time.monotonic() < deadline:
            w = mpckpt.load(path)["w"]
            assert torch.equal(w, torch.full_like(w, w[0].item()))  # never a mix of two steps
            steps.add(int(w[0].item()))
            loads += 1
        assert len(steps) > 10, f"the writer committed only {len(steps)} steps during {loads} loads"
    finally:
        stop.touch()
        writer.wait(120)
    assert writer.returncode == 0


def test_a_nan_metric_never_wins(tmp_path):
    path = tmp_path / "nan"
    with mpckpt.Checkpointer(path, workers=1) as ckpt:
        for step, loss in enumerate([0.5, float("nan"), 0.2, 0.9, float("inf")]):
            ckpt.save(step, {"x": torch.ones(1)}, metrics={"loss": loss}, mode="sync")
        assert ckpt.best(1, "loss") == [2]
        assert ckpt.best(3, "loss") == [2, 0, 3]
        assert ckpt.best(1, "loss", mode="max") == [4]
    with mpckpt.Checkpointer(path, workers=1) as again:  # the same from what is on storage
        assert again.best(3, "loss") == [2, 0, 3]
        assert math.isnan(again.checkpoint(1).metrics["loss"])


def test_load_looks_again_when_the_listed_checkpoint_goes_before_its_manifest_is_read(tmp_path, monkeypatch):
    """The race a live keep_last=1 writer creates: ``load`` lists step_1, the writer commits step_2 and
    deletes step_1, then ``load`` reads step_1's manifest. It must load step 2, not say "nothing"."""
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(1, {"w": torch.full((4,), 1.0)}, mode="sync")
    listed = LocalBackend.list_names
    raced: list[bool] = []

    def list_then_race(self):
        names = listed(self)
        if not raced:  # once: between this listing and the manifest read, a writer moves on
            raced.append(True)
            with mpckpt.Checkpointer(root, workers=1, keep_last=1) as writer:
                writer.save(2, {"w": torch.full((4,), 2.0)}, mode="sync")
            assert sorted(p.name for p in root.glob("step_*")) == ["step_0000000002"]
        return names

    monkeypatch.setattr(LocalBackend, "list_names", list_then_race)
    assert torch.equal(mpckpt.load(root)["w"], torch.full((4,), 2.0))
    assert raced == [True]
