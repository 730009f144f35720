"""Plain torch.distributed.checkpoint (DCP) folders in and out, on real folders written by ``dcp.save``.

- One process's folder (model with a bf16 layer and BatchNorm, AdamW with state, plain values):
  ``mpckpt.load`` gives the state with every tensor bit for bit (optimizer ids back as ints);
  ``info`` and ``verify`` describe and check it (saying DCP stores no checksums); ``import-dcp``
  commits it (a taken or older step refused, nothing changed), after which ``mpckpt.load(ROOT)`` and
  ``restore`` into fresh objects give the same tensors; ``export --format dcp`` writes it back, and
  both ``mpckpt.load`` and ``dcp.load`` into a fresh model and optimizer give the original bit for bit.
- Two ranks under torchrun (FSDP2, DTensor shards on a gloo CPU mesh): loaded whole, verified,
  imported, exported, and the exported folder read by ``dcp.load`` into a fresh sharded FSDP2 state.
- A ``.metadata`` whose unpickling would run code is refused by ``mpckpt.load``, ``info``, ``verify``
  and ``import-dcp``, naming the file and the global it asked for; the marker file it would create
  never appears and nothing is imported. One that sets attributes on an admitted class (pickle's
  BUILD on the class object) changes nothing the rest of the process sees.
- A truncated ``.distcp`` file, a damaged item, a value ``torch.load(weights_only=True)`` refuses,
  and an existing non-empty export target: each a clear error naming what is wrong.
"""

from __future__ import annotations

import copy
import fractions
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mpckpt
from mpckpt.cli import main
from mpckpt.errors import CorruptCheckpointError, StateError
from tests.conftest import assert_same
from tests.launch import torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("dcp_folder_worker.py"))


# -- states and folders ---------------------------------------------------------------------------------

def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with a bf16 layer and BatchNorm buffers, and AdamW after one step (so it has state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = model[2](model[1](model[0](torch.randn(5, 4))).to(torch.bfloat16))
    out.float().square().sum().backward()
    opt.step()
    return model, opt


def plain_values() -> dict[str, Any]:
    return {"epoch": 3, "tag": "run-a", "extra": {"flags": [True, None], "pair": (1, 2.5)},
            "table": torch.arange(12, dtype=torch.int16).reshape(3, 4), "empty": torch.empty(0)}


def canonical(node: Any) -> Any:
    """Dicts in key order (DCP's metadata lists keys in plan order), so ``assert_same`` compares contents."""
    if isinstance(node, dict):
        return {k: canonical(node[k]) for k in sorted(node, key=str)}
    if isinstance(node, list):
        return [canonical(v) for v in node]
    return node


def same(a: Any, b: Any) -> None:
    assert_same(canonical(a), canonical(b))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A folder one process wrote with ``dcp.save``, and the state it holds (copied before saving)."""
    folder = tmp_path_factory.mktemp("single") / "dcp"
    model, opt = model_and_optimizer(seed=0)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), **plain_values()}
    expected = copy.deepcopy(state)
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    assert (folder / ".metadata").is_file() and list(folder.glob("*.distcp"))
    return folder, expected


def _torchrun(scenario: str, folder: Path, out: Path, log: Path) -> None:
    torchrun(2, scenario, folder, out, log=log, worker=WORKER)


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A folder two FSDP2 ranks wrote with ``dcp.save``, and the folder holding their full tensors."""
    tmp = tmp_path_factory.mktemp("ranked")
    _torchrun("save", tmp / "dcp", tmp / "out", tmp / "log.txt")
    return tmp / "dcp", tmp / "out"


def assert_equals_full(loaded: dict[str, Any], full: dict[str, Any]) -> None:
    assert set(loaded["model"]) == set(full["model"]) and full["model"]
    for name, tensor in full["model"].items():
        assert_same(tensor, loaded["model"][name], name)
    assert set(loaded["optim"]["state"]) == set(full["optim"]) and full["optim"]
    for index, entries in full["optim"].items():
        for key, tensor in entries.items():
            assert_same(tensor, loaded["optim"]["state"][index][key], f"{index}.{key}")


# -- one process ----------------------------------------------------------------------------------------

def test_a_folder_loads_verifies_imports_restores_and_exports_back_bit_for_bit(single, tmp_path, capsys):
    folder, expected = single
    loaded = mpckpt.load(folder)
    same(loaded, expected)
    assert list(loaded["optim"]["state"]) == [0, 1, 2, 3, 4, 5]  # the ids optimizer.load_state_dict matches

    assert main(["verify", str(folder)]) == 0
    assert "ok" in (out := capsys.readouterr().out) and "no checksums" in out
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "model.2.weight" in out and "bfloat16" in out and "no checksums" in out and "optim.param_groups.0.lr" in out

    root = tmp_path / "root"
    assert main(["import-dcp", str(folder), str(root), "--step", "7"]) == 0
    same(mpckpt.load(root), expected)
    before = sorted(p.name for p in root.iterdir())
    for step in ("7", "3"):  # the step is taken; a step before the newest
        assert main(["import-dcp", str(folder), str(root), "--step", step]) == 2
        assert "step" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == before
    assert main(["verify", str(root)]) == 0  # checksums now

    model, opt = model_and_optimizer(seed=1)
    state = {"model": model, "optim": opt, **plain_values()}
    with mpckpt.Checkpointer(root, workers=1, keep_in_memory=False) as ckpt:
        assert ckpt.restore(state) == 7
    same(model.state_dict(), expected["model"])
    same(opt.state_dict(), expected["optim"])

    back = tmp_path / "back"
    assert main(["export", str(root), "7", "--to", str(back), "--format", "dcp"]) == 0
    same(mpckpt.load(back), expected)
    model, opt = model_and_optimizer(seed=2)  # unsharded, through DCP's own reader
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=back, no_dist=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    same(model.state_dict(), expected["model"])
    same(opt.state_dict(), expected["optim"])


def test_export_refuses_a_folder_that_is_not_empty_and_a_step_given_to_a_dcp_folder(single, tmp_path, capsys):
    folder, _ = single
    root = tmp_path / "root"
    assert main(["import-dcp", str(folder), str(root), "--step", "1"]) == 0
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["export", str(root), "1", "--to", str(target), "--format", "dcp"]) == 2
    assert "not empty" in capsys.readouterr().err and sorted(os.listdir(target)) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(root), "1", "--to", str(empty), "--format", "dcp"]) == 0
    assert (empty / ".metadata").is_file()
    assert main(["info", str(folder), "3"]) == 2
    assert "no steps" in capsys.readouterr().err
    with pytest.raises(mpckpt.errors.CheckpointNotFoundError, match="no steps"):
        mpckpt.load(folder, step=3)


# -- two ranks --------------------------------------------------------------------------------------------

def test_a_two_rank_fsdp_folder_round_trips_and_loads_sharded_through_dcp(ranked, tmp_path, capsys):
    folder, out = ranked
    full = torch.load(out / "full.pt")
    loaded = mpckpt.load(folder)
    assert_equals_full(loaded, full)
    assert loaded["epoch"] == 2
    assert main(["verify", str(folder)]) == 0
    assert main(["info", str(folder)]) == 0
    assert "__1_0.distcp" in capsys.readouterr().out  # both ranks' files hold chunks

    root = tmp_path / "root"
    assert main(["import-dcp", str(folder), str(root), "--step", "2"]) == 0
    assert_equals_full(mpckpt.load(root), full)
    back = tmp_path / "back"
    assert main(["export", str(root), "2", "--to", str(back), "--format", "dcp"]) == 0
    same(mpckpt.load(back), loaded)
    _torchrun("load", back, tmp_path / "out", tmp_path / "log.txt")  # fresh FSDP2 ranks, resharded by DCP
    reloaded = torch.load(tmp_path / "out" / "loaded.pt")
    assert_equals_full({"model": reloaded["model"], "optim": {"state": reloaded["optim"]}}, full)


def test_chunks_that_overlap_or_reach_past_their_tensor_are_refused(ranked, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    for case, offsets in (("overlap", (3, 0)), ("past", (5, 0))):
        folder = tmp_path / case
        shutil.copytree(ranked[0], folder)
        with open(folder / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # the test's own folder: trusted
        tensor = metadata.state_dict_metadata["model.0.weight"]  # [7, 12]: rows 0-3 and 4-6
        moved = tensor.chunks[1]
        info = metadata.storage_data.pop(MetadataIndex("model.0.weight", moved.offsets))
        tensor.chunks[1] = ChunkStorageMetadata(torch.Size(offsets), moved.sizes)
        metadata.storage_data[MetadataIndex("model.0.weight", offsets)] = info
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(CorruptCheckpointError, match="'model.0.weight'.*(overlap|reach past)"):
            mpckpt.load(folder)


# -- what is refused -----------------------------------------------------------------------------------------

class RunsCode:
    """Pickles as a call of ``os.system``: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class OpensFile:
    """Pickles as a call of ``open`` (``io.open``: creates the marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def crafted(folder: Path, tmp_path: Path, payload: str) -> tuple[Path, Path]:
    """A copy of ``folder`` whose ``.metadata`` would create a marker file when unpickled."""
    copy_ = tmp_path / f"crafted-{payload}"
    shutil.copytree(folder, copy_)
    marker = tmp_path / f"marker-{payload}"
    if payload == "whole":  # the metadata itself is the call
        data = pickle.dumps(RunsCode(marker))
    else:  # DCP's real metadata with a call hidden in its planner data
        with open(folder / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # the test's own folder, written above: trusted
        metadata.planner_data["epoch"] = OpensFile(marker)
        data = pickle.dumps(metadata)
    (copy_ / ".metadata").write_bytes(data)
    return copy_, marker


@pytest.mark.parametrize("payload", ["whole", "nested"])
def test_a_metadata_file_that_would_run_code_is_refused_everywhere(single, tmp_path, capsys, payload):
    folder, marker = crafted(single[0], tmp_path, payload)
    offending = "posix.system" if payload == "whole" else "io.open"  # open pickles as io.open
    with pytest.raises(StateError, match=offending) as refused:
        mpckpt.load(folder)
    assert f"{folder}/.metadata" in str(refused.value) and "allow_pickle" in str(refused.value)
    root = tmp_path / "root"
    for argv in (["info", str(folder)], ["verify", str(folder)],
                 ["import-dcp", str(folder), str(root), "--step", "1"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"{folder}/.metadata" in err and offending in err, (argv, err)
    assert not marker.exists() and not root.exists()


@pytest.mark.parametrize("module,name", [("torch.distributed.checkpoint.metadata", "Metadata"),
                                         ("pathlib", "PosixPath")])
def test_a_metadata_file_cannot_change_an_admitted_class_for_the_process(tmp_path, module, name):
    """Pickle's BUILD on a class object sets attributes on it: the file gets a class of its own load."""
    import importlib

    folder = tmp_path / "dcp"
    folder.mkdir()
    # GLOBAL module.name, then BUILD with the slot state {"tampered": torch.Size}
    (folder / ".metadata").write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode()
                                       + b"N}X\x08\x00\x00\x00tamperedctorch\nSize\ns\x86b.")
    with pytest.raises(CorruptCheckpointError, match="not a Metadata"):
        mpckpt.load(folder)
    assert not hasattr(getattr(importlib.import_module(module), name), "tampered")


def test_a_truncated_or_damaged_data_file_is_a_clear_error(single, tmp_path, capsys):
    truncated = tmp_path / "truncated"
    shutil.copytree(single[0], truncated)
    data_file = next(truncated.glob("*.distcp"))
    size = data_file.stat().st_size
    os.truncate(data_file, size // 2)
    with pytest.raises(CorruptCheckpointError, match="truncated") as e:
        mpckpt.load(truncated)
    assert str(data_file) in str(e.value)
    assert main(["verify", str(truncated)]) == 1
    assert str(data_file) in capsys.readouterr().err
    assert main(["import-dcp", str(truncated), str(tmp_path / "root"), "--step", "1"]) == 1
    assert not (tmp_path / "root").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(single[0], damaged)
    data_file = next(damaged.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[:64] = b"\xff" * 64  # the first item's zip header
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="does not decode.*no checksums"):
        mpckpt.load(damaged)
    assert main(["verify", str(damaged)]) == 1


def test_a_value_weights_only_refuses_is_refused_by_key_unless_pickles_are_allowed(tmp_path, capsys):
    folder = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3), "ratio": fractions.Fraction(1, 3)}, checkpoint_id=folder, no_dist=True)
    with pytest.raises(StateError, match="'ratio'.*allow_pickle"):
        mpckpt.load(folder)
    assert main(["import-dcp", str(folder), str(tmp_path / "root"), "--step", "1"]) == 1
    assert "'ratio'" in capsys.readouterr().err
    assert mpckpt.load(folder, allow_pickle=True)["ratio"] == fractions.Fraction(1, 3)
