"""The two-phase commit of a multi-rank checkpoint (``_commit.ranked``), rank by rank, on threads.

Each simulated rank has its own client of one real TCPStore on 127.0.0.1 and a real local
backend; only the training processes are left out (tests/integration/test_distributed.py
runs whole jobs under torchrun).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from mpckpt._commit.ranked import StoreCoordinator
from mpckpt.errors import RankError
from mpckpt.format.manifest import FileEntry, Manifest, checksum
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name, rank_prefix, rank_skeleton_name
from mpckpt.storage import open_backend, spec_for_url


class CountingStore:
    """A store client that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return method(*args, **kwargs)

        return counted


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


def _client(server: Any) -> CountingStore:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    return CountingStore(dist.PrefixStore("mpckpt/test/", client))


def _rank_files(backend: Any, staging: str, rank: int) -> dict[str, FileEntry]:
    files = {}
    for rel in (rank_skeleton_name(rank), f"{rank_prefix(rank)}shard-00000.safetensors"):
        data = f"{rel} of rank {rank}".encode()
        backend.write_file(f"{staging}/{rel}", [data])
        files[rel] = FileEntry(len(data), checksum(data))
    return files


def _run(tmp_path, server, world: int, step: int, act, timeout_s: float = 20.0):
    """Run ``act(rank, coordinator, backend, staging)`` on one thread per rank; results by rank."""
    backend = open_backend(spec_for_url(str(tmp_path)))
    staging = backend.staging_name(checkpoint_name(step), run="t0")
    backend.prepare_staging(staging)
    stores = [_client(server) for _ in range(world)]
    coordinators = [StoreCoordinator(backend, stores[r], rank=r, world_size=world, timeout_s=timeout_s)
                    for r in range(world)]
    results: dict[int, Any] = {}

    def one(rank: int) -> None:
        try:
            results[rank] = act(rank, coordinators[rank], backend, staging)
        except BaseException as e:  # noqa: BLE001 - compared by the test
            results[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank never returned"
    return results, stores, backend


def _commit(step: int):
    def act(rank, coordinator, backend, staging):
        files = _rank_files(backend, staging, rank)
        manifest = Manifest(step=step, seq=0, kind="state", files=files, world_size=1)
        return coordinator.commit(staging, checkpoint_name(step), manifest)
    return act


@pytest.mark.parametrize("world", [1, 2, 5])
def test_every_rank_gets_the_one_global_manifest(tmp_path, server, world):
    results, _, backend = _run(tmp_path, server, world, 3, _commit(3))
    manifests = [results[r] for r in range(world)]
    assert all(isinstance(m, Manifest) for m in manifests), manifests
    stored = Manifest.from_bytes(backend.read_bytes(f"{checkpoint_name(3)}/{MANIFEST_NAME}"), path="m")
    assert stored.to_bytes() == manifests[0].to_bytes() and manifests[0].complete
    # the other ranks learn the summary (no file list: the store sends it to every rank), the same one
    assert all(not m.complete and m.files == {} for m in manifests[1:])
    assert all(json.dumps(m.summary()) == json.dumps(stored.summary()) for m in manifests)
    assert stored.world_size == world and stored.format_version == 4 and stored.ranked
    assert set(stored.files) == {rel for r in range(world) for rel in
                                 (rank_skeleton_name(r), f"{rank_prefix(r)}shard-00000.safetensors")}


def test_a_rank_that_never_reports_is_named_on_every_rank_and_nothing_commits(tmp_path, server):
    def act(rank, coordinator, backend, staging):
        if rank == 2:
            return "died"  # posts nothing, as a rank killed before its part
        return _commit(5)(rank, coordinator, backend, staging)

    started = time.monotonic()
    results, _, backend = _run(tmp_path, server, 3, 5, act, timeout_s=1.5)
    assert time.monotonic() - started < 30  # bounded by timeout_s, never a hang
    for rank in (0, 1):
        assert isinstance(results[rank], RankError), results[rank]
        assert results[rank].ranks == [2] and "rank 2" in str(results[rank])
    assert not backend.exists(f"{checkpoint_name(5)}/{MANIFEST_NAME}")
    assert not [n for n in backend.list_names() if n.startswith(".tmp.")]  # the coordinator aborted it


def test_a_failed_part_fails_the_step_everywhere_with_its_cause(tmp_path, server):
    def act(rank, coordinator, backend, staging):
        if rank == 1:
            coordinator.abandon(7, staging, "failed", "StorageFullError: disk full")
            return "abandoned"
        return _commit(7)(rank, coordinator, backend, staging)

    results, _, backend = _run(tmp_path, server, 3, 7, act)
    for rank in (0, 2):
        assert isinstance(results[rank], RankError) and results[rank].ranks == [1], results[rank]
        assert "disk full" in str(results[rank])
    assert not backend.exists(f"{checkpoint_name(7)}/{MANIFEST_NAME}")


def test_a_coordinator_that_never_answers_is_named(tmp_path, server):
    def act(rank, coordinator, backend, staging):
        if rank == 0:
            return "died"
        return _commit(9)(rank, coordinator, backend, staging)

    results, _, _ = _run(tmp_path, server, 2, 9, act, timeout_s=1.0)
    assert isinstance(results[1], RankError) and results[1].ranks == [0], results[1]
    assert "rank 0 did not finish" in str(results[1])


def test_a_step_every_rank_dropped_is_dropped_without_error(tmp_path, server):
    def act(rank, coordinator, backend, staging):
        coordinator.abandon(4, staging, "dropped", "coalesced")
        return "dropped"

    results, stores, backend = _run(tmp_path, server, 3, 4, act)
    assert all(results[r] == "dropped" for r in range(3))
    outcome = json.loads(stores[1].store.get("4/outcome"))
    assert outcome["status"] == "dropped"
    assert not backend.exists(f"{checkpoint_name(4)}/{MANIFEST_NAME}")


def test_store_requests_per_rank_do_not_grow_with_the_world(tmp_path, server):
    calls = {}
    for world in (2, 8):
        _, stores, _ = _run(tmp_path / str(world), server, world, 11 + world, _commit(11 + world))
        calls[world] = [s.calls for s in stores]
    assert calls[2][1] == calls[8][1] == calls[8][7]  # every other rank: the same few requests
    assert calls[2][0] == calls[8][0]                 # the coordinator too (one wait, one multi_get)
    assert max(calls[8]) <= 6


def test_a_rank_that_gave_up_wins_over_a_late_coordinator(tmp_path, server):
    """Rank 1 stops waiting and fails the step; the coordinator, later, must not commit it."""
    gave_up = threading.Event()

    def act(rank, coordinator, backend, staging):
        if rank == 0:  # its own uploads were slow: it comes to commit once rank 1 has given up
            assert gave_up.wait(60), "rank 1 never gave up"
            return _commit(6)(rank, coordinator, backend, staging)
        try:
            return _commit(6)(rank, coordinator, backend, staging)
        finally:
            gave_up.set()

    results, _, backend = _run(tmp_path, server, 2, 6, act, timeout_s=1.0)
    assert isinstance(results[1], RankError) and results[1].ranks == [0], results[1]
    assert isinstance(results[0], RankError), results[0]  # it found the step already failed
    assert not backend.exists(f"{checkpoint_name(6)}/{MANIFEST_NAME}")


def test_a_step_one_rank_dropped_is_dropped_on_every_rank(tmp_path, server):
    from mpckpt._commit.coordinator import StepDropped

    def act(rank, coordinator, backend, staging):
        if rank == 1:
            coordinator.abandon(8, staging, "dropped", "skipped")
            return "dropped"
        return _commit(8)(rank, coordinator, backend, staging)

    results, _, backend = _run(tmp_path, server, 3, 8, act)
    for rank in (0, 2):
        assert isinstance(results[rank], StepDropped) and "rank 1" in str(results[rank]), results[rank]
    assert not backend.exists(f"{checkpoint_name(8)}/{MANIFEST_NAME}")
    assert not [n for n in backend.list_names() if n.startswith(".tmp.")]  # the others' files went with it
