"""Peer copies (``peer_copies=1``) across simulated nodes (``harness.nodes``): what a node loss leaves restorable.

Each test: phase 1 launches ``peer_worker.py`` on every node, trains and saves every step (async to
storage, or ``mode="memory"``), waits for each save (its copies included) and dumps every rank's local
state after each save; then nodes are lost (their processes and ``/dev/shm``), the job is killed as a
crash would end it, the lost nodes are replaced by fresh ones (empty ``/dev/shm``) and phase 2
relaunches the job, which restores into a fresh model (other weights), optimizer, generators and
blob. Every rank's restored local state must equal, bit for bit, what it held after saving the step
restored, and ``last_restore.source`` must say where its own snapshot came from.

- 2 nodes x 1 rank, DDP, memory-only saves: node 1 lost -> the newest (memory-only) step, rank 0
  ``memory``, rank 1 ``peer``; every save's future reports one copy.
- 2 nodes x 2 ranks, FSDP2, overlapped async saves: node 1 lost -> ranks 2, 3 ``peer``.
- 4 nodes x 1 rank, DDP, memory-only saves: node 2 lost -> rank 2 ``peer``, the others ``memory``.
- 4 nodes x 1 rank, FSDP2: nodes 1 and 2 lost (rank 1's snapshot and its only copy) -> the last step
  on storage, not the newer memory-only ones, every rank ``storage``.
- A flipped byte in the copy of rank 1 held on node 0: rank 1 reads its step from storage (a warning
  says why), never the wrong byte.
- The receiving rank's budget has no room for a copy: saves succeed, the sender's futures report no
  copy, a warning names the budget.
- Node 1 lost while rank 0's copy to it is in flight: rank 0's future resolves (no copy), no copy of
  that step is published on node 1, and the restart restores bit for bit.
- Every upload fails (the root's filesystem is full) and one rank's save raised an earlier failure the
  other's did not (their save sequence numbers then differ): node 1 lost -> the newest step, an
  uploaded one that failed, from rank 0's memory and rank 1's copy.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from harness.nodes import Cluster, Job, Node, namespaces_unavailable
from mpckpt._keep.record import KeptRecord
from mpckpt.format.checksums import file_checksums
from tests.conftest import assert_same
from tests.waiting import wait_until

if (_why := namespaces_unavailable()) is not None:
    pytest.skip(_why, allow_module_level=True)

WORKER = Path(__file__).with_name("peer_worker.py")
JOB_TIMEOUT_S = 120
RESOLVE_S = 60  # a save's future after its copy's receiver died: twice the bound of a receiver's answer
_PEER_DATA = re.compile(r"mpckpt-peer-[0-9]+-[0-9a-f]{16}-r([0-9]+)-[0-9a-f]{32}")
_PEER_RECORD = re.compile(r"mpckpt-peer-[0-9]+-[0-9a-f]{16}-r([0-9]+)\.[0-9]+\.record")


class Run:
    """One test's cluster, storage root and output folder, and the worker options both phases share."""

    def __init__(self, cluster: Cluster, tmp: Path, nproc: int, *options: Any) -> None:
        self.cluster, self.tmp, self.nproc = cluster, tmp, nproc
        self.root, self.out, self.logs = tmp / "root", tmp / "out", tmp / "logs"
        self.options = [str(o) for o in options]
        self.world = nproc * len(cluster.nodes)

    def launch(self, scenario: str, *extra: Any) -> Job:
        return self.cluster.launch(WORKER, [scenario, self.root, self.out, *self.options, *map(str, extra)],
                                   nproc_per_node=self.nproc, log_dir=self.logs)

    def wait_for(self, job: Job, names: list[str], timeout_s: float = JOB_TIMEOUT_S, poll_s: float = 0.05) -> None:
        """Until every file ``names`` is in the output folder (failing with the logs if the agent of a node
        alive ends first)."""
        def arrived() -> bool:
            if all((self.out / n).exists() for n in names):
                return True
            ended = [a.poll() is not None for a, n in zip(job.agents, self.cluster.nodes, strict=True) if n.alive]
            assert not any(ended), f"an agent ended while waiting for {names}"
            return False

        self.until(job, arrived, timeout_s, f"the files {names}", poll_s=poll_s)

    @staticmethod
    def until(job: Job, predicate: Callable[[], bool], timeout_s: float, what: str, *, poll_s: float) -> None:
        """``wait_until``; when it fails, the job is killed and the test fails with its logs."""
        try:
            wait_until(predicate, timeout_s, what, poll_s=poll_s)
        except AssertionError as e:
            job.kill()
            pytest.fail(f"{e}; logs:\n{job.logs()}")

    def train(self, *extra: Any) -> list[dict[str, Any]]:
        """Phase 1: every rank trains and saves, then lingers (its job is left running)."""
        self.job = self.launch("train", *extra)
        self.wait_for(self.job, [f"train-r{r}.json" for r in range(self.world)])
        return [json.loads((self.out / f"train-r{r}.json").read_text()) for r in range(self.world)]

    def crash(self, lost: list[int]) -> None:
        """Nodes ``lost`` lost, the rest of the job killed, the lost nodes replaced by fresh ones."""
        for i in lost:
            self.cluster.nodes[i].lose()
        self.job.kill()
        for i in lost:
            assert self.cluster.replace(i).shm_listing() == []

    def restore(self) -> list[dict[str, Any]]:
        """Phase 2: every rank restores into fresh objects; what each restored."""
        job = self.launch("restore")
        codes = job.wait(JOB_TIMEOUT_S)
        self.phase2_logs = job.logs()
        assert codes == [0] * len(codes), self.phase2_logs
        return [json.loads((self.out / f"restored-r{r}.json").read_text()) for r in range(self.world)]

    def assert_restored(self, rank: int, step: int) -> None:
        """Rank ``rank``'s restored local state is, bit for bit, what it held after saving ``step``."""
        assert_same(torch.load(self.out / f"restored-r{rank}.pt"), torch.load(self.out / f"saved-{step}-r{rank}.pt"),
                    f"rank {rank}")

    def on_storage(self, step: int) -> bool:
        return (self.root / f"step_{step:010d}").exists()


def peer_files(node: Node, pattern: re.Pattern[str], rank: int) -> list[str]:
    return [n for n in node.shm_listing() if (m := pattern.fullmatch(n)) and int(m.group(1)) == rank]


def peer_records(node: Node, rank: int, at_most: int | None = 2) -> list[KeptRecord]:
    """The published copies of ``rank``'s snapshots held on ``node``, oldest first: in a running or
    cleanly ended job at most two (the newest, and the newest step copied for every rank)."""
    names = peer_files(node, _PEER_RECORD, rank)
    assert at_most is None or len(names) <= at_most, names
    records = [KeptRecord.from_bytes(node.shm_path(n).read_bytes(), path=n) for n in names]
    return sorted(records, key=lambda r: r.step)


def peer_record(node: Node, rank: int) -> KeptRecord | None:
    """The newest published copy of ``rank``'s snapshot held on ``node``, if any."""
    records = peer_records(node, rank)
    return records[-1] if records else None


def receiving(node: Node, old: str) -> bool:
    """Whether bytes of a new copy of rank 0's snapshot landed on ``node`` (a data file but ``old``
    whose first page is no longer all zeros, as ``posix_fallocate`` left it)."""
    for name in set(peer_files(node, _PEER_DATA, 0)) - {old}:
        try:
            with open(node.shm_path(name), "rb") as f:
                if f.read(4096).strip(b"\0"):
                    return True
        except FileNotFoundError:
            pass
    return False


def assert_whole(node: Node, record: KeptRecord) -> None:
    """The copy ``record`` names on ``node`` holds every file it lists, each matching its checksum."""
    data = node.shm_path(record.data).read_bytes()
    for rel, span in record.spans.items():
        assert span.offset + span.nbytes <= len(data), rel
        got = file_checksums(span.header, memoryview(data)[span.offset:span.offset + span.nbytes], 0)[0]
        assert got == span.checksum, rel


def sources(views: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(v["step"], v["source"]) for v in views]


# -- a node lost: its ranks restore from the copies --------------------------------------------------

def test_ddp_two_nodes_node_lost_restores_a_memory_only_step_from_the_copy(tmp_path: Path) -> None:
    with Cluster(2, shm_size="512m", name_prefix="pa") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--steps", 3, "--memory-from", 1)
        seen = run.train()
        for rank, doc in enumerate(seen):
            memory = [s for s in doc["saves"] if s["mode"] == "memory"]
            assert [(s["step"], s["status"], s["peer_copies"]) for s in memory] == [(1, "in_memory", 1),
                                                                                     (2, "in_memory", 1)], (rank, doc)
        assert peer_record(cluster.nodes[0], 1).step == 2 and peer_record(cluster.nodes[1], 0).step == 2
        run.crash([1])
        views = run.restore()
    assert sources(views) == [(2, "memory"), (2, "peer")], views
    assert not run.on_storage(2) and not run.on_storage(1) and run.on_storage(0)  # memory-only steps
    for rank in range(2):
        run.assert_restored(rank, 2)


def test_fsdp2_two_nodes_of_two_ranks_node_lost_restores_from_the_copies(tmp_path: Path) -> None:
    with Cluster(2, shm_size="512m", name_prefix="pb") as cluster:
        run = Run(cluster, tmp_path, 2, "--model", "fsdp", "--steps", 3, "--overlap")
        seen = run.train()
        for rank, doc in enumerate(seen):  # a storage save's stats count its copies too
            assert [(s["status"], s["peer_copies"]) for s in doc["saves"]] == [("committed", 1)] * 3, (rank, doc)
        assert [peer_record(cluster.nodes[0], r).step for r in (2, 3)] == [2, 2]
        assert [peer_record(cluster.nodes[1], r).step for r in (0, 1)] == [2, 2]
        run.crash([1])
        views = run.restore()
    assert sources(views) == [(2, "memory"), (2, "memory"), (2, "peer"), (2, "peer")], views
    for rank in range(4):
        run.assert_restored(rank, 2)


def test_ddp_four_nodes_one_lost_its_rank_restores_from_the_next_node(tmp_path: Path) -> None:
    with Cluster(4, shm_size="512m", name_prefix="pc") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--steps", 2, "--memory-from", 1)
        run.train()
        for i in range(4):  # the ring: node i holds the copy of rank i - 1
            assert peer_record(cluster.nodes[i], (i - 1) % 4).step == 1, i
        run.crash([2])
        views = run.restore()
    assert sources(views) == [(1, "memory"), (1, "memory"), (1, "peer"), (1, "memory")], views
    assert not run.on_storage(1)
    for rank in range(4):
        run.assert_restored(rank, 1)


def test_a_snapshot_and_its_only_copy_lost_restores_the_last_step_on_storage(tmp_path: Path) -> None:
    """Nodes 1 and 2 lost: rank 1's snapshot and its copy are both gone; the memory-only steps 2 and 3
    are not whole anywhere, so every rank restores step 1 from storage (nodes 0 and 3 still hold theirs)."""
    with Cluster(4, shm_size="512m", name_prefix="pd") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "fsdp", "--steps", 4, "--memory-from", 2)
        run.train()
        run.crash([1, 2])
        views = run.restore()
    assert sources(views) == [(1, "storage")] * 4, views
    assert run.on_storage(1) and not run.on_storage(2) and not run.on_storage(3)
    for rank in range(4):
        run.assert_restored(rank, 1)


# -- damage, a full budget, a loss mid-copy ------------------------------------------------------------

def test_a_flipped_byte_in_a_peer_copy_is_never_restored(tmp_path: Path) -> None:
    with Cluster(2, shm_size="512m", name_prefix="pe") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "fsdp", "--steps", 2, "--blob-mb", 4)
        run.train()
        cluster.nodes[1].lose()
        run.job.kill()
        node0 = cluster.nodes[0]
        record = peer_record(node0, 1)
        assert record is not None and record.step == 1
        data = record.data
        span = max(record.spans.values(), key=lambda s: s.nbytes)
        at = span.offset + span.nbytes // 2  # inside the data of rank 1's largest shard
        path = node0.shm_path(data)
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
        cluster.replace(1)
        views = run.restore()
    assert sources(views) == [(1, "memory"), (1, "storage")], views
    for rank in range(2):
        run.assert_restored(rank, 1)
    stored = mpckpt.load(run.root, step=1)["blob"]  # what storage holds, per rank
    assert torch.equal(torch.load(run.out / "restored-r1.pt")["blob"], stored[1])
    assert re.search(r"cannot be read from peer \(.*(checksum|does not match)", run.phase2_logs), run.phase2_logs


def test_no_room_in_the_receivers_budget_for_a_copy_saves_go_on_without_it(tmp_path: Path) -> None:
    """Rank 1's budget holds its own two slabs of a 16 MiB state, not a third 16 MiB for rank 0's copy."""
    with Cluster(2, shm_size="512m", name_prefix="pf") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--steps", 3, "--memory-from", 1, "--blob-mb", 16,
                  "--budget", "256MiB", "--budget-rank", "1=48MiB")
        seen = run.train()
        listing = [n.shm_listing() for n in cluster.nodes]
        logs = run.job.logs()
        run.job.kill()
    for rank, doc in enumerate(seen):
        assert [s["status"] for s in doc["saves"]] == ["committed", "in_memory", "in_memory"], (rank, doc, logs)
    assert [s["peer_copies"] for s in seen[0]["saves"][1:]] == [0, 0], (seen, logs)  # rank 1 refused them
    assert [s["peer_copies"] for s in seen[1]["saves"][1:]] == [1, 1], (seen, logs)  # rank 0 has room
    assert "no room in its memory budget" in logs, logs
    assert not [n for n in listing[1] if _PEER_RECORD.fullmatch(n)], listing
    assert [n for n in listing[0] if _PEER_RECORD.fullmatch(n)], listing
    assert "Traceback" not in logs, logs


def test_partner_node_lost_mid_copy_the_future_resolves_and_nothing_partial_is_published(tmp_path: Path) -> None:
    """Rank 0's 128 MiB snapshot of step 1 (memory only) is being copied to node 1 when node 1 is frozen
    and lost: rank 0's future resolves without a copy (within RESOLVE_S), node 1 never published that
    copy, every copy left on node 0 is whole, and the restart restores bit for bit from memory whatever
    is whole (step 1 if rank 1's small copy reached node 0 first, else step 0: copied for every rank,
    so held beside the newest)."""
    with Cluster(2, shm_size="1g", name_prefix="pg") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--blob-mb", 1, "--blob-mb-rank", "0=128",
                  "--budget", "512MiB")
        run.job = run.launch("inflight", "--wait-s", RESOLVE_S)
        node0, node1 = cluster.nodes
        run.wait_for(run.job, ["started-r0"], poll_s=0.001)
        old = peer_record(node1, 0)  # the copy of step 0
        assert old is not None and old.step == 0, "the copy of step 1 was in place before the test looked"
        run.until(run.job, lambda: receiving(node1, old.data), 60,  # the bytes of rank 0's step 1 landing on node 1
                  "node 1 receiving rank 0's step 1", poll_s=0.0005)
        for pid in node1.pids():  # frozen mid-transfer
            os.kill(pid, signal.SIGSTOP)
        held = peer_record(node1, 0)
        assert held is not None and held.step == 0, "the copy of step 1 was published before the freeze"
        node1.lose()
        run.wait_for(run.job, ["inflight-r0.json"], timeout_s=RESOLVE_S + 30)
        doc = json.loads((run.out / "inflight-r0.json").read_text())
        logs = run.job.logs()
        run.job.kill()
        copy = peer_record(node0, 1)  # rank 1's small step 1 may have reached node 0 first
        assert copy is not None and copy.step in (0, 1)
        assert_whole(node0, copy)
        cluster.replace(1)
        views = run.restore()
    # step 0 was copied for every rank: rank 0 holds its own snapshot of it beside step 1's, node 0 the copy
    expected = [(copy.step, "memory"), (copy.step, "peer")]
    assert sources(views) == expected, (views, copy.step)
    for rank in range(2):
        run.assert_restored(rank, copy.step)
    assert doc["first"]["peer_copies"] == 1, doc
    assert doc["resolved"], f"rank 0's future of step 1 did not resolve within {RESOLVE_S} s of the loss: {doc}\n{logs}"
    assert doc["peer_copies"] == 0 and doc["status"] == "in_memory", (doc, logs)
    assert re.search(r"mpckpt: the copy of step 1 to rank 1 .*fail", logs), logs


def test_memory_saves_every_step_a_node_lost_mid_training_restores_from_the_copies(tmp_path: Path) -> None:
    """A save to memory every step, the loop never waiting for the copies (8 MiB per rank): the
    copies go in rounds that newer snapshots never overtake, and each rank holds the newest step
    copied for every rank beside its newest. Node 1 lost while training goes on: every rank
    restores from memory (rank 0 its own, rank 1 the copy on node 0), not storage, bit for bit,
    a step of the memory saves."""
    steps = 40
    with Cluster(2, shm_size="512m", name_prefix="pm") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--steps", steps, "--memory-from", 1, "--blob-mb", 8,
                  "--budget", "256MiB", "--no-wait")
        run.job = run.launch("train")
        run.wait_for(run.job, [f"saved-{steps // 2}-r0.pt"], poll_s=0.005)
        cluster.nodes[1].lose()  # mid-training: the copies of the newest steps are in flight
        run.job.kill()
        copies = [r.step for r in peer_records(cluster.nodes[0], 1)]
        cluster.replace(1)
        views = run.restore()
    step = views[0]["step"]
    assert sources(views) == [(step, "memory"), (step, "peer")], (views, copies, run.phase2_logs)
    assert step >= 1 and step in copies, (views, copies)
    for rank in range(2):
        run.assert_restored(rank, step)


def test_a_rank_killed_while_copies_are_in_flight_restarts_from_its_own_memory(tmp_path: Path) -> None:
    """The same loop (a save to memory every step, copies in flight): rank 0's process SIGKILLed, its
    node alive. The job is killed and relaunched on the same nodes: every rank restores the newest
    step every rank held from its own memory (no copy needed), bit for bit; the copy that was being
    received when it died was never published."""
    steps = 40
    with Cluster(2, shm_size="512m", name_prefix="pk") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--steps", steps, "--memory-from", 1, "--blob-mb", 8,
                  "--budget", "256MiB", "--no-wait")
        run.job = run.launch("train")
        run.wait_for(run.job, [f"saved-{steps // 2}-r0.pt"], poll_s=0.005)
        workers = [p for p in cluster.nodes[0].pids() if b"peer_worker.py" in _cmdline(p)
                   and b"torch.distributed.run" not in _cmdline(p)]
        assert workers, "rank 0's training process was not found on node 0"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        run.job.kill()
        for node in cluster.nodes:
            for rank in range(2):
                # A kill can leave a third: between a copy's publish and the tidy that lets the older
                # go, or once rank 0's store is gone and the tidy cannot learn which steps every rank
                # holds (the budget bounds them). Every one published is whole.
                for record in peer_records(node, rank, at_most=None):
                    assert_whole(node, record)
        views = run.restore()
    step = views[0]["step"]
    assert sources(views) == [(step, "memory"), (step, "memory")], views
    assert step >= steps // 2 - 1, views  # (rank 0 may have died inside the save of the step it dumped)
    for rank in range(2):
        run.assert_restored(rank, step)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@contextmanager
def full_filesystem(where: Path) -> Iterator[None]:
    """A small tmpfs at ``where`` (mounted before the nodes start: they see it), filled but 16 KiB: room
    for the root's lock and probe, none for a shard. Skips the test where it cannot be mounted."""
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.strip()}")
    try:
        free = os.statvfs(where)
        fd = os.open(where / ".filler", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize - (16 << 10))
        finally:
            os.close(fd)
        yield
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_uploads_failing_on_a_full_root_the_newest_step_is_restored_from_the_copies(tmp_path: Path) -> None:
    """Every upload fails: the root's filesystem is full. Rank 0's save of step 1 raises step 0's
    failure instead of saving; rank 1, which looked at that failure, saves step 1: from then on the
    ranks' save sequence numbers differ by one. Steps 2 (memory) and 3 (uploaded, failed) are kept and
    copied on both; node 1 lost, the job restores step 3, rank 1 from its copy, bit for bit."""
    with full_filesystem(tmp_path / "root"), Cluster(2, shm_size="512m", name_prefix="pl") as cluster:
        run = Run(cluster, tmp_path, 1, "--model", "ddp", "--timeout-s", 5)
        run.job = run.launch("diverge")
        run.wait_for(run.job, [f"train-r{r}.json" for r in range(2)])
        seen = [json.loads((run.out / f"train-r{r}.json").read_text())["saves"] for r in range(2)]
        assert seen[0]["1"].startswith("raised UploadError: step 0: ") and "StorageFullError" in seen[0]["1"], seen
        assert [s["3"] for s in seen] == ["failed 1", "failed 1"], seen
        own = [r for r in peer_records(cluster.nodes[1], 0) if r.step == 3]
        copy = [r for r in peer_records(cluster.nodes[0], 1) if r.step == 3]
        assert own and copy and own[0].seq != copy[0].seq, (own, copy)  # rank 0's and rank 1's numbers differ
        run.crash([1])
        views = run.restore()
    assert sources(views) == [(3, "memory"), (3, "peer")], (views, run.phase2_logs)
    assert not run.on_storage(3)
    for rank in range(2):
        run.assert_restored(rank, 3)
