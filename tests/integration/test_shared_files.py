"""Shared files: deleting any one checkpoint, however it is deleted, leaves every other loadable.

A frozen backbone's shard is written once into ``shared/`` and listed by every later checkpoint
whose frozen tensors did not change. These tests delete checkpoints every way there is
(``ckpt.delete``, ``mpckpt rm``, retention, ``rm -rf`` by hand, a crash) and check, bit for
bit, that the rest load; that a shared file goes once no manifest lists it, never while a
committed or pending save does; and that roots written before shared files (files referenced
in an earlier step's folder) still load and keep that folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from harness.servers import s3_options
from mpckpt.errors import CheckpointNotFoundError, ConfigError, StepOrderError, UnsupportedFormatError, UploadError
from mpckpt.format import manifest as manifest_format
from mpckpt.format.manifest import Manifest
from mpckpt.storage import open_backend, spec_for_url
from tests.backends import ctl_url
from tests.commands import mpckpt_command
from tests.conftest import assert_same
from tests.legacy_roots import make_legacy, manifests_of

REPO = Path(__file__).resolve().parents[2]


class Lora(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(128, 128)
        self.base.requires_grad_(False)
        self.adapter = torch.nn.Linear(128, 4, bias=False)


def _step(model: Lora, step: int) -> dict[str, torch.Tensor]:
    """Train the adapter a little; the model's state as ``step`` saves it."""
    with torch.no_grad():
        model.adapter.weight.add_(float(step + 1))
    return {k: v.clone() for k, v in model.state_dict().items()}


def save_run(root: Any, steps: range | list[int], *, options: dict | None = None,
             **kwargs: Any) -> tuple[Lora, dict[int, dict[str, torch.Tensor]]]:
    model = Lora()
    snapshots = {}
    with mpckpt.Checkpointer(root, workers=1, storage_options=options, **kwargs) as ckpt:
        for step in steps:
            snapshots[step] = _step(model, step)
            ckpt.save(step, {"model": model}, mode="sync")
    return model, snapshots


def assert_loads(root: Any, snapshots: dict[int, dict[str, torch.Tensor]], steps: list[int],
                 options: dict | None = None) -> None:
    for step in steps:
        assert_same(snapshots[step], mpckpt.load(root, step=step, storage_options=options)["model"])


def folder(root: Path, step: int) -> Path:
    return root / f"step_{step:010d}"


def step_folders(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def shared(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "shared").iterdir()) if (root / "shared").exists() else []


cli = mpckpt_command


# -- deleting the oldest: every way ------------------------------------------------------------------

def test_the_frozen_shard_lives_in_shared_and_ckpt_delete_of_the_oldest_keeps_the_rest(tmp_path):
    root = tmp_path / "run"
    model = Lora()
    snapshots = {}
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        for step in range(4):
            snapshots[step] = _step(model, step)
            ckpt.save(step, {"model": model}, mode="sync")
        assert len(shared(root)) == 1 and shared(root)[0].startswith("step_0000000000.")  # written by step 0
        assert all(m.format_version == 3 for m in manifests_of(root).values())
        ckpt.delete(0)
        assert ckpt.steps() == [1, 2, 3] and step_folders(root) == [1, 2, 3] and len(shared(root)) == 1
        assert_same(snapshots[1], ckpt.load(1)["model"])
        with pytest.raises(CheckpointNotFoundError, match="step 0"):
            ckpt.delete(0)
        with pytest.raises(CheckpointNotFoundError, match="step 9"):
            ckpt.delete(1, 9)  # refused as a whole
        assert ckpt.steps() == [1, 2, 3]
        ckpt.delete(1, 3)  # the newest too, when nothing is pending
        assert ckpt.latest_step == 2 and step_folders(root) == [2] and len(shared(root)) == 1
        with pytest.raises(StepOrderError):
            ckpt.save(3, {"model": model})  # steps only increase
        snapshots[4] = _step(model, 4)
        ckpt.save(4, {"model": model}, mode="sync")  # the frozen shard is still listed, not written again
        assert len(shared(root)) == 1 and ckpt.stats.saves[-1].written_bytes < 128 * 128 * 4
        ckpt.delete(2, 4)
        assert shared(root) == [] and step_folders(root) == []  # the last user gone: the file too
    with pytest.raises(CheckpointNotFoundError):
        mpckpt.load(root)


def test_mpckpt_rm_of_the_oldest_keeps_the_rest_and_refuses_what_is_not_there(tmp_path):
    root = tmp_path / "run"
    _, snapshots = save_run(root, range(4))
    done = cli("rm", root, 0)
    assert done.returncode == 0, done.stderr
    assert "deleted step 0" in done.stdout and step_folders(root) == [1, 2, 3] and len(shared(root)) == 1
    assert_loads(root, snapshots, [1, 2, 3])
    unknown = cli("rm", root, 1, 7)
    assert unknown.returncode == 2 and "committed steps: 1, 2, 3" in unknown.stderr
    assert step_folders(root) == [1, 2, 3]  # nothing deleted
    assert cli("rm", root).returncode == 2  # argparse: a step is needed
    assert cli("verify", root).returncode == 0
    done = cli("rm", root, 1, 2, 3)
    assert done.returncode == 0 and "removed shared file shared/step_0000000000." in done.stdout
    assert shared(root) == [] and step_folders(root) == []


def test_retention_keeps_only_the_newest_folder_and_the_shared_file_it_lists(tmp_path):
    root = tmp_path / "run"
    model = Lora()
    snapshots = {}
    with mpckpt.Checkpointer(root, workers=1, keep_last=1) as ckpt:
        for step in range(4):
            snapshots[step] = _step(model, step)
            ckpt.save(step, {"model": model}, mode="sync")
            ckpt.wait()
            assert step_folders(root) == [step] and len(shared(root)) == 1  # the oldest's folder goes at once
            assert_same(snapshots[step], ckpt.load(step)["model"])
        first = shared(root)
        with torch.no_grad():
            model.base.weight.add_(1.0)  # the frozen weights change: a new shard, the old one unused
        snapshots[4] = _step(model, 4)
        ckpt.save(4, {"model": model}, mode="sync")
        ckpt.wait()
        assert step_folders(root) == [4] and len(shared(root)) == 1 and shared(root) != first
    assert_loads(root, snapshots, [4])
    assert cli("ls", root).returncode == 0


@pytest.mark.parametrize("gone", [0, 2, 3])
def test_rm_rf_of_any_step_folder_leaves_the_others_loadable(tmp_path, gone):
    root = tmp_path / "run"
    _, snapshots = save_run(root, range(4))
    shutil.rmtree(folder(root, gone))
    rest = [s for s in range(4) if s != gone]
    assert_loads(root, snapshots, rest)
    assert cli("verify", root).returncode == 0
    with mpckpt.Checkpointer(root, workers=1) as ckpt:  # the open's recovery keeps what is listed
        assert ckpt.steps() == rest
    assert len(shared(root)) == 1
    assert_loads(root, snapshots, rest)


# -- what is never deleted, what is --------------------------------------------------------------

def test_a_failed_saves_shared_file_is_deleted_and_nothing_else(tmp_path):
    root = tmp_path / "run"
    opts = {"fail": {r"\.tmp\.step_0000000001\.": "injected failure"}, "marker_dir": str(tmp_path)}
    model = Lora()
    with mpckpt.Checkpointer(ctl_url(root), workers=1, storage_options=opts) as ckpt:
        snapshot = _step(model, 0)
        ckpt.save(0, {"model": model}, mode="sync")
        with torch.no_grad():
            model.base.weight.add_(1.0)  # step 1 writes a frozen shard of its own, then fails
        future = ckpt.save(1, {"model": model})
        with pytest.raises(UploadError):
            future.result()
        ckpt.wait()
        assert len(shared(root)) == 1 and shared(root)[0].startswith("step_0000000000.")
    assert_loads(root, {0: snapshot}, [0])


def test_a_pending_saves_shared_file_is_never_deleted_and_rm_and_gc_wait_for_the_writer(tmp_path):
    root = tmp_path / "run"
    opts = {"delay": {r"\.tmp\.step_0000000002\.": 4.0}, "marker_dir": str(tmp_path)}
    model = Lora()
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("a directory checkpoint lists no shared file")
    with mpckpt.Checkpointer(ctl_url(root), workers=1, storage_options=opts) as ckpt:
        _step(model, 0)
        ckpt.save(0, {"model": model}, mode="sync")  # writes the frozen shard
        ckpt.report({}, checkpoint=mpckpt.Checkpoint.from_directory(files), step=1, mode="sync")
        snapshot = _step(model, 2)
        future = ckpt.save(2, {"model": model})  # lists step 0's frozen shard; pending for 4 s
        with pytest.raises(StepOrderError, match="pending"):
            ckpt.delete(1)  # the newest, while a save is pending
        ckpt.delete(0)  # the last committed user of the shared file; the pending save still lists it
        assert step_folders(root) == [1] and len(shared(root)) == 1 and not future.done()
        for command in (("rm", root, 1), ("gc", root)):  # never beside a live writer
            refused = cli(*command)
            assert refused.returncode == 1 and "live" in refused.stderr, refused.stderr
        assert future.result().name == "step_0000000002"
        assert step_folders(root) == [1, 2] and len(shared(root)) == 1
    assert_loads(root, {2: snapshot}, [2])
    assert cli("rm", root, 1).returncode == 0 and len(shared(root)) == 1


CRASH = textwrap.dedent("""
    import os, sys
    import torch
    import mpckpt
    from tests.backends import ctl_url
    from tests.waiting import wait_until
    root, markers = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)  # the frozen part of Lora, alone
    model.requires_grad_(False)
    opts = {"delay": {r"\\.tmp\\.step_0000000001\\.": 60}, "marker_dir": markers}
    ckpt = mpckpt.Checkpointer(ctl_url(root), workers=2, storage_options=opts)
    ckpt.save(0, {"model": model}, mode="sync")
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.save(1, {"model": model})
    wait_until(lambda: any(n.startswith("step_0000000001.") for n in os.listdir(os.path.join(root, "shared"))),
               60, "step 1's frozen shards being written")
    print("crashing", flush=True)
    os._exit(1)  # killed before step 1 commits
""")


@pytest.mark.parametrize("cleaner", ["gc", "Checkpointer"])
def test_the_shared_file_of_a_crashed_save_is_removed_at_the_next_open_or_gc(tmp_path, cleaner):
    root = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", CRASH, str(root), str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert "crashing" in done.stdout, done.stderr[-3000:]
    assert step_folders(root) == [0] and any(n.startswith("step_0000000001.") for n in shared(root))
    if cleaner == "gc":
        cleaned = cli("gc", root)
        assert cleaned.returncode == 0 and "removed shared file shared/step_0000000001." in cleaned.stdout
    else:
        with mpckpt.Checkpointer(root, workers=1) as ckpt:
            assert ckpt.steps() == [0]
    assert shared(root) and all(n.startswith("step_0000000000.") for n in shared(root))
    torch.manual_seed(0)
    assert_same(torch.nn.Linear(128, 128).state_dict(), mpckpt.load(root, step=0)["model"])


def test_damaged_checkpoints_are_deleted_only_when_asked_and_their_shared_files_kept(tmp_path):
    root = tmp_path / "run"
    _, snapshots = save_run(root, range(3))
    assert cli("rm", root, 0, 1).returncode == 0 and len(shared(root)) == 1  # step 2 lists it
    path = folder(root, 2) / "manifest.json"
    body = json.loads(path.read_text())
    body["metrics"] = {"loss": 1.0}  # bit rot: the manifest's checksum no longer matches
    path.write_text(json.dumps(body))
    assert cli("gc", root).returncode == 0 and len(shared(root)) == 1  # step 2 may be recoverable
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        assert ckpt.steps() == [] and 2 in ckpt._rt.damaged
        with pytest.raises(ConfigError, match="damaged=True"):
            ckpt.delete(2)
    assert len(shared(root)) == 1
    refused = cli("rm", root, 2)
    assert refused.returncode == 2 and "--damaged" in refused.stderr and step_folders(root) == [2]
    done = cli("rm", root, 2, "--damaged")
    assert done.returncode == 0, done.stderr
    assert step_folders(root) == [] and shared(root) == []


# -- roots written before shared files -------------------------------------------------------------

def test_a_root_with_refs_into_step_folders_loads_and_that_folder_is_kept(tmp_path):
    root = tmp_path / "run"
    model, snapshots = save_run(root, range(3))
    legacy = make_legacy(root)
    assert not (root / "shared").exists()
    assert {e.ref for e in legacy[2].files.values()} == {None, "step_0000000000"}
    assert_loads(root, snapshots, [0, 1, 2])
    rows = json.loads(cli("ls", root, "--json").stdout)
    assert [r["kept"] for r in rows] == [["referenced"], [], ["latest"]]
    assert [r["uses_steps"] for r in rows] == [[], [0], [0]] and rows[2]["shared_bytes"] == 0
    refused = cli("rm", root, 0)
    assert refused.returncode == 2 and "steps [1, 2]" in refused.stderr and step_folders(root) == [0, 1, 2]
    with mpckpt.Checkpointer(root, workers=1, keep_last=1) as ckpt:
        with pytest.raises(ConfigError, match="folder of step 0"):
            ckpt.delete(0)
        snapshots[3] = _step(model, 3)
        ckpt.save(3, {"model": model}, mode="sync")
        ckpt.wait()
        # retention let go of 1 and 2; step 0 was still read by them when it decided
        assert step_folders(root) == [0, 3] and ckpt.steps() == [0, 3]
    assert_loads(root, snapshots, [0, 3])
    assert cli("rm", root, 0).returncode == 0  # nobody reads its files any more
    assert_loads(root, snapshots, [3])
    assert cli("verify", root).returncode == 0


def test_an_mpckpt_that_reads_only_older_formats_refuses_shared_files_clearly(tmp_path, monkeypatch):
    root = tmp_path / "run"
    save_run(root, range(1))
    data = (folder(root, 0) / "manifest.json").read_bytes()
    assert Manifest.from_bytes(data, path="m").format_version == 3
    monkeypatch.setattr(manifest_format, "FORMAT_VERSION", 2)
    with pytest.raises(UnsupportedFormatError, match="Upgrade mpckpt"):
        Manifest.from_bytes(data, path="m")


# -- every backend ---------------------------------------------------------------------------------

@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3),
                        pytest.param("azure", marks=pytest.mark.azure)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict]:
    name = f"mpckpt-{uuid.uuid4().hex[:12]}"
    if request.param == "local":
        return str(tmp_path / "run"), {}
    if request.param == "memory":
        return f"memory://{name}/run", {}
    if request.param == "s3":
        return f"s3://{name}/run", s3_options(request.getfixturevalue("moto_server"), create=True)
    return f"az://{name}/run", {"connection_string": request.getfixturevalue("azurite_server"), "create": True}


def test_every_backend_keeps_the_shared_file_while_a_checkpoint_lists_it(where):
    url, opts = where
    model = Lora()
    snapshots = {}
    backend = open_backend(spec_for_url(url, opts or None))
    with mpckpt.Checkpointer(url, workers=1, storage_options=opts, keep_last=2) as ckpt:
        for step in range(4):
            snapshots[step] = _step(model, step)
            ckpt.save(step, {"model": model}, mode="sync")
        ckpt.wait()
        assert ckpt.steps() == [2, 3] and len(backend.list_files("shared")) == 1
        ckpt.delete(2)
        assert_loads(url, snapshots, [3], opts)
        assert len(backend.list_files("shared")) == 1
        ckpt.delete(3)
        assert backend.list_files("shared") == [] and ckpt.steps() == []
        backend.write_file("shared/step_0000000009.0123.shard-00000.safetensors", [b"a crashed save's"])
    with mpckpt.Checkpointer(url, workers=1, storage_options=opts):
        pass  # the open removes what no manifest lists
    assert backend.list_files("shared") == []
