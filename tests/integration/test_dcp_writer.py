"""torch.distributed.checkpoint through mpckpt: ``StorageWriter`` and ``StorageReader`` with real files,
real processes (torchrun, gloo on CPU) and real servers (moto's S3, Azurite).

- One process: ``dcp.save`` then ``dcp.load`` bit for bit; the checkpoint is an ordinary one
  (``mpckpt.load`` nested as given to DCP, ``mpckpt verify``, retention, ``restore`` from the snapshot kept
  in memory); ``checkpoint_id`` names a step; a checkpoint ``ckpt.save`` wrote reads through DCP too.
- DCP's raw bytes items (an ``io.BytesIO`` value) stored without pickle, handed back as ``io.BytesIO``,
  in one process and at 2, 1 and 3 ranks.
- A ``.metadata`` pickle planted in the root and in the checkpoint folder is never unpickled.
- FSDP2 on 2 ranks saving with ``dcp.async_save``, loaded at 1 and 3 ranks into fresh models and
  optimizers (``get_state_dict`` / ``set_state_dict``), bit for bit; and a multi-rank checkpoint of
  mpckpt's own ``ckpt.save`` loaded through DCP at both sizes.
- A rank SIGKILLed inside DCP's save: the step never commits.
- S3 (moto) and Azure (Azurite) through the writer and the reader.
- What is refused: DCP's process executor (its future fails with an error naming the thread executor),
  a ``checkpoint_id`` naming no step, ranks holding different keys.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import mpckpt
from harness.servers import s3_options
from mpckpt.cli import main as cli_main
from mpckpt.errors import ConfigError
from mpckpt.integrations._dcp_state import check_same_keys
from mpckpt.integrations.dcp import StorageReader, StorageWriter
from tests.conftest import assert_same, make_model, train_step
from tests.launch import ranks_without_agent, tail, torchrun, worker_env

WORKER = str(Path(__file__).with_name("dcp_worker.py"))

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch, "name": "run7"}


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = make_model(width=16, depth=2, seed=seed)
    train_step(model, opt, seed)
    return model, opt


# -- one process ---------------------------------------------------------------------------------

def test_one_process_saves_and_loads_bit_exactly_as_an_ordinary_checkpoint(tmp_path):
    root = tmp_path / "root"
    model, opt = _trained(0)
    saved = _state(model, opt, 3)
    with mpckpt.Checkpointer(root, workers=1, keep=mpckpt.KeepLast(1), trigger=mpckpt.EveryNSteps(1000)) as ckpt:
        assert not ckpt.should_save(10)  # the trigger is asked before DCP is called; a DCP save always saves
        dcp.save(saved, storage_writer=StorageWriter(ckpt, 10))
        assert ckpt.steps() == [10]
        train_step(model, opt, 1)
        saved = _state(model, opt, 4)
        dcp.save(saved, storage_writer=StorageWriter(ckpt), checkpoint_id=f"{root}/step_0000000020")
        ckpt.wait()
        assert ckpt.steps() == [20]  # retention (KeepLast(1)) deleted step 10
        fresh, fresh_opt = _trained(5)
        target = _state(fresh, fresh_opt, 0)
        target["name"] = ""
        dcp.load(target, storage_reader=StorageReader(ckpt))
        assert_same(target, saved)
        ckpt.close(leave_in_memory=True)
    loaded = mpckpt.load(root)  # nested as given to DCP; DCP's keys of the optimizer's state are strings
    assert_same(loaded["model"], saved["model"])
    assert loaded["epoch"] == 4 and loaded["name"] == "run7"
    assert_same(loaded["optim"]["state"], {str(k): v for k, v in saved["optim"]["state"].items()})
    assert cli_main(["verify", str(root)]) == 0
    again, _ = make_model(width=16, depth=2, seed=7)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:  # the snapshot kept in shared memory serves restore
        assert ckpt.restore({"model": again, "epoch": 0, "name": ""}, strict=False) == 20
        assert ckpt.last_restore is not None and ckpt.last_restore.source == "memory"
    assert_same(again.state_dict(), saved["model"])


def test_dcp_bytes_items_are_stored_as_raw_bytes_and_come_back_as_bytesio(tmp_path):
    blob = io.BytesIO(b"\x00raw\xffbytes, not a pickle")
    blob.seek(4)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:  # allow_pickle is off
        dcp.save({"x": torch.arange(4.0), "blob": blob, "empty": io.BytesIO()}, storage_writer=StorageWriter(ckpt, 1))
        ckpt.wait()
        target: dict[str, Any] = {"x": torch.zeros(4), "blob": None, "empty": None}
        dcp.load(target, storage_reader=StorageReader(ckpt))
    skeleton = (tmp_path / "step_0000000001" / "skeleton.json").read_text()
    assert '"pickle"' not in skeleton and '"bytesio"' in skeleton
    for got in (target, mpckpt.load(tmp_path)):
        assert isinstance(got["blob"], io.BytesIO) and isinstance(got["empty"], io.BytesIO)
        assert got["blob"].getvalue() == blob.getvalue() and got["blob"].tell() == 4
        assert got["empty"].getvalue() == b""
        assert torch.equal(got["x"], torch.arange(4.0))


def test_a_checkpoint_of_ckpt_save_loads_through_dcp(tmp_path):
    model, opt = _trained(0)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(5, {"model": model, "epoch": 2, "shared": [model[0].weight, model[0].weight[:2]]}, mode="sync")
        fresh, _ = make_model(width=16, depth=2, seed=3)
        target = {"model": fresh.state_dict(), "epoch": 0, "shared": [torch.zeros(16, 16), torch.zeros(2, 16)]}
        dcp.load(target, storage_reader=StorageReader(ckpt, "5"))
    assert_same(fresh.state_dict(), model.state_dict())
    assert target["epoch"] == 2
    assert torch.equal(target["shared"][1], model[0].weight[:2].detach())


def test_a_planted_dcp_metadata_pickle_is_never_unpickled(tmp_path):
    """DCP's ``.metadata`` is a pickle: StorageReader never opens one, not even in the checkpoint folder."""
    root, marker = tmp_path / "root", tmp_path / "unpickled"
    model, opt = _trained(0)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        dcp.save(_state(model, opt, 1), storage_writer=StorageWriter(ckpt, 1))
    bait = pickle.dumps(_Bait(str(marker)))
    (root / ".metadata").write_bytes(bait)
    (root / "step_0000000001" / ".metadata").write_bytes(bait)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        target = _state(*_trained(1), 0)
        dcp.load(target, storage_reader=StorageReader(ckpt, 1))
    assert_same(target["model"], model.state_dict())
    assert not marker.exists()
    with contextlib.suppress(Exception):  # the bait is live: DCP's own reader runs it
        dcp.FileSystemReader(str(root / "step_0000000001")).read_metadata()
    assert marker.exists()


class _Bait:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_what_is_refused(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        writer = StorageWriter(ckpt, 1)
        with pytest.raises(ConfigError, match="thread executor"):  # DCP's process executor pickles the writer
            pickle.dumps(writer)
        for bad in ("latest", "/elsewhere/step_0000000001", -1):
            with pytest.raises(ConfigError, match="names no step"):
                StorageReader(ckpt, bad)
        with pytest.raises(CheckpointException, match="ConfigError: no step to save"):  # DCP wraps what a rank raised
            dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(ckpt))
    with pytest.raises(ConfigError, match="rank 1 has 'b', rank 0 has not"):
        check_same_keys([("d0", ["a"]), ("d1", ["a", "b"])])
    check_same_keys([("d0", ["a"]), None, ("d0", ["a"])])


_PROCESS_EXECUTOR = """
import sys, torch, torch.distributed as dist, mpckpt
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from mpckpt.integrations.dcp import StorageWriter
if __name__ == "__main__":  # DCP's checkpoint process is spawned: it imports this file again
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    with mpckpt.Checkpointer(sys.argv[1], workers=1) as ckpt:
        future = dcp.async_save({"x": torch.ones(3)}, storage_writer=StorageWriter(ckpt, 1),
                                async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        try:
            future.result(timeout=120)
        except Exception as e:
            print("refused:", type(e).__name__, e)
        print("steps:", ckpt.steps())
    dist.destroy_process_group()
"""


def test_dcp_process_executor_gets_an_error_naming_the_thread_executor(tmp_path):
    script = tmp_path / "process_executor.py"
    script.write_text(_PROCESS_EXECUTOR)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "root"), str(tmp_path / "store")],
                          env=worker_env(), capture_output=True, text=True, timeout=240)
    assert "refused: ConfigError" in done.stdout and "thread executor" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "steps: []" in done.stdout


# -- storage backends ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [pytest.param("s3", marks=pytest.mark.s3),
                                     pytest.param("azure", marks=pytest.mark.azure)])
def test_object_stores_through_the_writer_and_the_reader(backend, request):
    server = request.getfixturevalue("moto_server" if backend == "s3" else "azurite_server")
    bucket = f"mpckpt-{uuid.uuid4().hex[:16]}"
    url, options = ((f"s3://{bucket}/run", s3_options(server, create=True)) if backend == "s3"
                    else (f"az://{bucket}/run", {"connection_string": server, "create": True}))
    model, opt = _trained(0)
    saved = _state(model, opt, 2)
    with mpckpt.Checkpointer(url, workers=1, storage_options=options) as ckpt:
        dcp.save(saved, storage_writer=StorageWriter(ckpt, 1))
        target = _state(*_trained(1), 0)
        dcp.load(target, storage_reader=StorageReader(ckpt))
    assert_same(target, saved)
    assert_same(mpckpt.load(url, storage_options=options)["model"], saved["model"])


# -- jobs ------------------------------------------------------------------------------------------------

def _job(nproc: int, *args: Any, log: Path) -> None:
    torchrun(nproc, *args, log=log, worker=WORKER)


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two FSDP2 ranks saved steps 1 and 2 with dcp.async_save, and step 3 (the model) with ckpt.save."""
    where = tmp_path_factory.mktemp("dcp-fsdp2")
    root, out = where / "root", where / "out"
    _job(2, "save", root, out, log=where / "save.txt")
    return root, out


def test_fsdp2_async_save_at_two_ranks_loads_at_one_and_three_bit_exactly(fsdp2_saved, tmp_path):
    root, out = fsdp2_saved
    views = [json.loads((out / f"save-r{r}.json").read_text()) for r in range(2)]
    assert all(v["steps"] == [1, 2, 3] and v["latest-after-1"] == 1 and v["latest-after-2"] == 2 for v in views), views
    full = torch.load(out / "full-2.pt")
    stored = mpckpt.load(root, step=2)  # mpckpt's reader, no DCP: the chunks of every rank joined
    assert_same({k: stored["model"][k[len("model."):]] for k in full if k.startswith("model.")},
                {k: v for k, v in full.items() if k.startswith("model.")})
    assert stored["step"] == 2
    assert cli_main(["verify", str(root)]) == 0
    assert cli_main(["info", str(root), "2"]) == 0 and cli_main(["ls", str(root)]) == 0
    for world in (1, 3):
        _job(world, "load", root, tmp_path / f"out-{world}", log=tmp_path / f"load-{world}.txt")
        assert_same(torch.load(tmp_path / f"out-{world}" / f"loaded-w{world}.pt"), full)
        native = torch.load(tmp_path / f"out-{world}" / f"loaded-native-w{world}.pt")
        assert_same(native, {k: v for k, v in full.items() if k.startswith("model.")})
        seen = [json.loads((tmp_path / f"out-{world}" / f"load-r{r}.json").read_text()) for r in range(world)]
        assert all(s["step"] == 2 and s["native_step"] == 3 and s["blob"] == b"\x00raw\xff2".hex() for s in seen), seen


def test_a_rank_killed_inside_dcp_save_commits_nothing(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    codes, logs = ranks_without_agent(tmp_path, [sys.executable, WORKER, "kill", str(root), str(out)])
    assert codes == [0, -signal.SIGKILL], [tail(log) for log in logs]
    seen = json.loads((out / "kill-r0.json").read_text())
    assert seen["dcp_error"] is not None, seen  # DCP's save failed on rank 0 too
    assert seen["statuses"] == ["committed", "failed"] and seen["error"] is None and seen["latest"] == 1, seen
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        assert ckpt.steps() == [1]
    assert not (root / "step_0000000002").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp.")]
