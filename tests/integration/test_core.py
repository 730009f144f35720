"""The whole save -> snapshot -> upload -> commit -> restore path on local disk, for real."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

import mpckpt
from mpckpt import _testing
from mpckpt._system import shm as _shm
from mpckpt.errors import UploadError
from tests.backends import ctl_url
from tests.conftest import assert_same, make_model, train_step
from tests.waiting import wait_until


def test_model_and_adam_roundtrip_bit_identical(tmp_path):
    model, opt = make_model()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    state = {"model": model, "optim": opt, "sched": sched, "epoch": 0}
    snapshots = {}
    with mpckpt.Checkpointer(tmp_path / "run", workers=2, memory_budget="64MiB") as ckpt:
        assert ckpt.restore(state) is None
        for step in range(12):
            train_step(model, opt, step)
            sched.step()
            state["epoch"] = step
            ckpt.save(step, state, metrics={"loss": 1.0 / (step + 1)})
            snapshots[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    assert ckpt.steps() == list(range(12))
    assert ckpt.latest_step == 11
    assert ckpt.best(2, "loss") == [11, 10]
    loaded = mpckpt.load(tmp_path / "run", step=7)
    assert_same(snapshots[7]["model"], loaded["model"])
    assert loaded["epoch"] == 7

    model2, opt2 = make_model(seed=1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    state2 = {"model": model2, "optim": opt2, "sched": sched2, "epoch": -1}
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as again:
        assert again.restore(state2) == 11
    assert state2["epoch"] == 11
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert sched2.state_dict() == sched.state_dict()


DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().view(shape)
    return raw.view(dtype).view(shape)


def test_every_dtype_noncontiguous_empty_and_plain_values(tmp_path):
    state = {f"t_{str(d)[6:]}": _random(d, (3, 5), i) for i, d in enumerate(DTYPES)}
    state["noncontig"] = torch.arange(60, dtype=torch.float32).view(6, 10)[:, ::3]
    state["transposed"] = torch.randn(4, 7).t()
    state["empty"] = torch.empty(0, 3)
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    state["plain"] = {"int": 3, 7: "int key", "nan": float("nan"), "inf": float("-inf"), "none": None,
                      "tuple": (1, 2.5, "x"), "bytes": b"\x00\x01", "dtype": torch.bfloat16,
                      "size": torch.Size([2, 3]), "list": [1, [2, 3]], True: False}
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        ckpt.save(0, state, mode="sync")
    loaded = mpckpt.load(tmp_path)
    expected = dict(state)
    expected["noncontig"] = state["noncontig"].contiguous()
    expected["transposed"] = state["transposed"].contiguous()
    assert_same(expected, loaded)
    assert torch.equal(loaded["noncontig"], state["noncontig"])


def test_shared_storage_comes_back_shared(tmp_path):
    emb = torch.randn(10, 4)
    flat = torch.arange(20, dtype=torch.float32)
    state = {"embed": emb, "lm_head": emb, "a": flat[:10].view(2, 5), "b": flat[5:].view(3, 5)}
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, state)
    loaded = mpckpt.load(tmp_path)
    assert loaded["embed"] is loaded["lm_head"]
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    loaded["a"][1, 0] = -1.0  # element 5 of the shared storage
    assert loaded["b"][0, 0] == -1.0


def test_shards_are_plain_safetensors(tmp_path):
    model, _ = make_model(width=32)
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        ckpt.save(3, {"model": model})
    folder = tmp_path / "step_0000000003"
    shards = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    assert len(shards) == 2  # balanced over two uploaders
    seen = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            for key in f.keys():
                seen[key] = f.get_tensor(key)
    for name, value in model.state_dict().items():
        assert torch.equal(seen[f"model.{name}"], value)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == set(shards) | {"skeleton.json"}
    for rel, entry in manifest["files"].items():
        assert (folder / rel).stat().st_size == entry["size"]


def test_commits_in_save_order_when_uploads_finish_out_of_order(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    opts = {"delay": {r"step_0000000001\.": 1.5}, "marker_dir": str(markers)}
    with mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=2, storage_options=opts) as ckpt:
        futures = [ckpt.save(s, {"x": torch.full((1000,), float(s))}) for s in range(4)]
        wait_until(lambda: {2, 3} <= {r.step for r in ckpt._rt.ledger.pending() if r.settled}, 30,
                   "steps 2 and 3 written (every file uploaded) while step 1 still uploads")
        # A window for the wrong commit to show (not synchronisation: no event marks a commit that must
        # not happen): steps 2 and 3 are written, step 1 is still uploading: nothing after 0 may be committed
        time.sleep(0.2)
        assert not futures[1].done()
        assert ckpt.latest_step == 0
        assert not futures[2].done() and not futures[3].done()
        order = [f.result(30).stats for f in futures]
    assert [s.status for s in order] == ["committed"] * 4
    assert ckpt.steps() == [0, 1, 2, 3]
    seq = [json.loads((tmp_path / "run" / f"step_{s:010d}" / "manifest.json").read_text())["seq"] for s in range(4)]
    assert seq == sorted(seq)


def _shm_bytes_of_this_process() -> int:
    mine = f"{_shm.PREFIX}{os.getpid()}-"
    total = 0
    for name in _shm.list_segments():
        if name.startswith(mine):
            try:
                total += os.stat(os.path.join(_shm.SHM_DIR, name)).st_size
            except FileNotFoundError:
                pass
    return total


class ShmSampler:
    """Measures this process's mpckpt shared memory from the outside, every few ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _shm_bytes_of_this_process())
            time.sleep(0.002)  # the sampling period of a measurement, not synchronisation

    def __enter__(self) -> ShmSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_budget_is_never_exceeded_and_a_state_four_times_larger_saves(tmp_path):
    budget = 8 << 20
    state = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB: 4x the budget
    state["big"] = torch.randn(3 << 20)  # one tensor larger than the whole budget
    with ShmSampler() as sampler, mpckpt.Checkpointer(tmp_path, memory_budget=budget, workers=2) as ckpt:
        for step in range(3):
            ckpt.save(step, state)
        ckpt.wait()
        peak_reported = ckpt.stats.peak_shm_bytes
    assert 0 < sampler.peak <= budget
    assert peak_reported <= budget
    loaded = mpckpt.load(tmp_path)
    assert_same(state, loaded)


def test_sync_returns_after_commit_and_async_after_snapshot(tmp_path):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"delay": {r"step_0000000002\.": 1.0}, "marker_dir": str(markers)}
    with mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=1, storage_options=opts) as ckpt:
        f1 = ckpt.save(1, {"x": torch.ones(10)}, mode=mpckpt.UploadMode.SYNC)
        assert f1.done() and ckpt.latest_step == 1
        f2 = ckpt.save(2, {"x": torch.ones(10)}, mode="async")
        assert not f2.done() and ckpt.latest_step == 1
        assert f2.result(30).name == "step_0000000002"
        assert f2.stats.blocked_ms > 0 and f2.stats.persist_ms > 0 and f2.stats.bytes == 40
    assert ckpt.stats.committed == 2


def test_background_failure_surfaces_once_with_step_and_earlier_checkpoints_intact(tmp_path):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"fail": {r"step_0000000002\..*shard": "disk on fire"}, "marker_dir": str(markers)}
    ckpt = mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=2, storage_options=opts)
    ckpt.save(1, {"x": torch.ones(10)})
    ckpt.save(2, {"x": torch.ones(10) * 2})
    with pytest.raises(UploadError, match="step 2.*disk on fire") as info:
        ckpt.wait()
    assert info.value.step == 2
    ckpt.save(3, {"x": torch.ones(10) * 3})  # surfaced once: the next save does not raise it again
    ckpt.close()
    assert ckpt.steps() == [1, 3]
    assert sorted(os.listdir(tmp_path / "run")) == [".mpckpt.lock", "step_0000000001", "step_0000000003"]


def test_exit_raises_a_pending_failure(tmp_path):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"fail": {"shard": "no space"}, "marker_dir": str(markers)}
    with pytest.raises(UploadError, match="step 5"):
        with mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=1, storage_options=opts) as ckpt:
            ckpt.save(5, {"x": torch.ones(3)})


def test_dead_uploader_is_replaced_and_its_job_retried(tmp_path, caplog):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"kill_worker": [r"step_0000000001\..*shard-00000"], "marker_dir": str(markers)}
    state = {"a": torch.randn(1000), "b": torch.randn(1000)}
    with caplog.at_level("WARNING", logger="mpckpt"), \
            mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=2, storage_options=opts) as ckpt:
        pids_before = set(ckpt.uploader_pids)
        ckpt.save(1, state)
        ckpt.wait(timeout_s=60)
        assert ckpt.stats.worker_restarts == 1 and ckpt.stats.job_retries == 1
        assert any("uploader process" in r.getMessage() and "of step 1; writing it again (attempt 2 of" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert set(ckpt.uploader_pids) != pids_before
    assert ckpt.steps() == [1]
    assert_same(state, mpckpt.load(tmp_path / "run"))


def test_skip_policy_drops_with_a_warning_and_counts(tmp_path):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"delay": {r"step_0000000000\.": 1.0}, "marker_dir": str(markers)}
    state = {"x": torch.randn(1 << 20)}  # 4 MiB with a 6 MiB budget: one in flight at a time
    with mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=1, memory_budget="6MiB", policy="skip",
                             storage_options=opts) as ckpt:
        ckpt.save(0, state)
        with pytest.warns(UserWarning, match="step 1 skipped"):
            f1 = ckpt.save(1, state)
        assert f1.result(5).name is None and f1.stats.status == "skipped"
    assert ckpt.stats.skipped == 1 and ckpt.steps() == [0]


def test_coalesce_replaces_a_queued_checkpoint(tmp_path):
    markers = tmp_path / "m"
    markers.mkdir()
    opts = {"delay": {r"step_0000000000\.": 2.0}, "marker_dir": str(markers)}
    state = {"x": torch.randn(1 << 20)}  # 4 MiB, budget for two in flight
    with mpckpt.Checkpointer(ctl_url(tmp_path / "run"), workers=1, memory_budget="10MiB", policy="coalesce",
                             storage_options=opts) as ckpt:
        ckpt.save(0, state)          # uploading (slow)
        # the worker took step 0's job (seq 0): the next one queues
        wait_until(lambda: _testing.upload_started(ckpt, 0), 30, "the upload of step 0 started")
        f1 = ckpt.save(1, state)     # queued behind it
        f2 = ckpt.save(2, state)     # budget full: replaces step 1
        assert f1.result(30).name is None and f1.stats.status == "coalesced"
        assert f2.result(30).name == "step_0000000002"
    assert ckpt.steps() == [0, 2] and ckpt.stats.coalesced == 1


def test_metrics_reported_without_a_checkpoint_are_kept_in_stats(tmp_path):
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        assert ckpt.report({"loss": torch.tensor(0.5), "step": 3}) is None
        assert ckpt.report({"loss": 0.25}) is None  # the step follows the last saved one (none yet: 0)
        ckpt.save(7, {"x": torch.ones(2)}, mode="sync")
        assert ckpt.report({"acc": 0.9}) is None
        assert ckpt.stats.reported == [{"step": 3, "loss": 0.5}, {"step": 0, "loss": 0.25}, {"step": 8, "acc": 0.9}]
        assert ckpt.stats.as_dict()["reported"] == ckpt.stats.reported
        assert ckpt.steps() == [7]  # metrics alone commit nothing


def test_directory_checkpoints_upload_commit_and_read_back(tmp_path):
    src = tmp_path / "hf"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "weights.bin").write_bytes(os.urandom(3000))
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "model.ckpt").write_bytes(b"lightning")
    with mpckpt.Checkpointer(tmp_path / "run", workers=2) as ckpt:
        fut = ckpt.report({"loss": 0.5}, checkpoint=mpckpt.Checkpoint.from_directory(src), step=10)
        fut.result(30)
        ckpt.report({"loss": 0.4}, checkpoint=mpckpt.Checkpoint.from_directory(keep), step=11, mode="sync")
        stored = ckpt.checkpoint(10)
        assert stored.files() == ["config.json", "sub/weights.bin"]
        with stored.as_directory() as d:
            assert open(os.path.join(d, "config.json")).read() == '{"a": 1}'
        out = ckpt.checkpoint(11).to_directory(tmp_path / "out")
        assert open(os.path.join(out, "model.ckpt"), "rb").read() == b"lightning"
    assert not src.exists()   # ASYNC: deleted after upload
    assert keep.exists()      # SYNC: kept
    assert ckpt.best(1, "loss") == [11]


def test_no_upload_moves_a_folder_into_place(tmp_path):
    src = tmp_path / "written_in_place"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.report({"loss": 1.0}, checkpoint=mpckpt.Checkpoint.from_directory(src), step=0, mode="no_upload")
        assert ckpt.latest_step == 0
    assert (tmp_path / "run" / "step_0000000000" / "files" / "a.txt").read_text() == "hello"


def test_keep_last_deletes_old_checkpoints(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1, keep_last=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"x": torch.ones(4) * step}, mode="sync")
    assert ckpt.steps() == [3, 4]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step_")) == ["step_0000000003", "step_0000000004"]


def test_no_segments_left_after_exit(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        ckpt.save(0, {"x": torch.randn(10000)})
        assert _shm_bytes_of_this_process() > 0
    assert _shm_bytes_of_this_process() == 0


def test_memory_filesystem_uses_in_process_uploaders(tmp_path):
    url = f"memory://mpckpt-test-{os.getpid()}-{tmp_path.name}"
    model, opt = make_model()
    train_step(model, opt, 0)
    state = {"model": model, "optim": opt}
    with mpckpt.Checkpointer(url, workers=2) as ckpt:
        assert _testing.uploads_in_process(ckpt)
        ckpt.save(0, state)
        ckpt.save(1, state, mode="sync")
    assert ckpt.steps() == [0, 1]
    loaded = mpckpt.load(url)
    assert_same(model.state_dict(), loaded["model"])


def test_load_takes_the_folder_of_one_checkpoint(tmp_path):
    """``mpckpt.load`` of ``<root>/step_...`` (what Ray's ``Result.checkpoint.path`` names) loads that step."""
    with mpckpt.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((3,), float(step))})
    assert torch.equal(mpckpt.load(tmp_path / "step_0000000001")["w"], torch.full((3,), 1.0))
    assert torch.equal(mpckpt.load(f"{tmp_path}/step_0000000002/")["w"], torch.full((3,), 2.0))
    with pytest.raises(mpckpt.errors.CheckpointNotFoundError, match="step 1, not of step 2"):
        mpckpt.load(tmp_path / "step_0000000001", step=2)
    with pytest.raises(mpckpt.errors.CheckpointNotFoundError):
        mpckpt.load(tmp_path / "step_0000000003")  # no such checkpoint: read as a root, which has none
