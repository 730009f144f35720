"""Which node a rank is on and who holds copies of whose snapshot (``mpckpt._peer.node``), and the
restore plan computed from what every rank holds (``mpckpt._peer.inventory.Plan``)."""

from __future__ import annotations

import os

import pytest

from mpckpt._peer.inventory import Held, Plan
from mpckpt._peer.node import Placement, node_id
from mpckpt.config import Config
from mpckpt.errors import ConfigError


def test_node_id_is_the_override_else_host_boot_and_shm_device():
    assert node_id({"MPCKPT_NODE_ID": "rack3-n7"}) == "rack3-n7"
    mine = node_id({})
    assert mine.endswith(f"/{os.stat('/dev/shm').st_dev}") and mine.count("/") >= 2
    assert node_id({"MPCKPT_NODE_ID": " "}) == mine  # blank: not an override


def _nodes(*counts: int) -> tuple[str, ...]:
    return tuple(f"n{i}" for i, c in enumerate(counts) for _ in range(c))


@pytest.mark.parametrize("counts", [(1, 1), (2, 2), (1, 1, 1, 1), (3, 3, 3), (2, 2, 2, 2, 2)])
@pytest.mark.parametrize("copies", [1, 2])
def test_every_copy_is_on_another_node_and_every_node_sends_and_receives_alike(counts, copies):
    placement = Placement(_nodes(*counts), copies)
    nodes = placement.nodes
    want = min(copies, len(counts) - 1)
    received = {n: 0 for n in set(nodes)}
    for rank in range(len(nodes)):
        targets = placement.targets(rank)
        assert len(targets) == want
        assert len({nodes[t] for t in targets}) == want, "two copies on one node"
        assert all(nodes[t] != nodes[rank] for t in targets), "a copy on the rank's own node"
        local = placement.ranks_on(nodes[rank]).index(rank)
        assert all(placement.ranks_on(nodes[t]).index(t) == local for t in targets), "not the same local rank"
        for t in targets:
            received[nodes[t]] += 1
            assert rank in placement.sources(t)
    assert len(set(received.values())) == 1, received  # constant per node: no hot spot


def test_the_first_copy_goes_to_the_next_node_around_the_ring():
    placement = Placement(_nodes(2, 2, 2), 1)
    assert [placement.targets(r) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert placement.sources(0) == [4]


def test_one_node_gets_no_copies_and_uneven_nodes_map_by_local_index():
    assert Placement(_nodes(4), 1).targets(0) == []
    uneven = Placement(_nodes(2, 1), 1)
    assert uneven.targets(0) == [2] and uneven.targets(1) == [2] and uneven.targets(2) == [0]


def test_peer_copies_setting_and_its_errors():
    assert Config.resolve(environ={}).peer_copies == 0
    assert Config.resolve(environ={"MPCKPT_PEER_COPIES": "2"}).peer_copies == 2
    with pytest.raises(ConfigError, match="MPCKPT_PEER_COPIES"):
        Config.resolve(environ={"MPCKPT_PEER_COPIES": "-1"})
    with pytest.raises(ConfigError, match="keep_in_memory"):
        Config.resolve(peer_copies=1, keep_in_memory=False, environ={})


def _held(rank: int, step: int, *, own: bool, seq: int = -1, tag: str = "a") -> Held:
    return Held(rank, step, seq, own, ((f"r{rank}.safetensors", 10, f"{tag}{rank}{step}"),))


def test_the_plan_takes_a_step_only_when_every_rank_is_held_and_reads_the_nearest_holder():
    # node A: ranks 0 (own 5, copy of 1's 5); node B replaced: rank 1 holds nothing
    plan = Plan(1, ["A", "B"], [[_held(0, 5, own=True), _held(1, 5, own=False)], []])
    assert plan.complete() == {5}
    assert plan.holder(1, 5, reader=1) == (0, _held(1, 5, own=False))  # rank 1 reads its part from rank 0
    assert plan.remote(5) and plan.servers(5) == [0]
    assert plan.manifest(5).world_size == 2 and set(plan.manifest(5).files) == {"r0.safetensors", "r1.safetensors"}
    # both partners lost: nothing held for rank 1
    assert Plan(0, ["A", "B"], [[_held(0, 5, own=True)], []]).complete() == set()
    # a stale copy of another save of step 5 disagrees with the rank's own: not from memory
    stale = Plan(0, ["A", "B"], [[_held(0, 5, own=True), _held(1, 5, own=False, tag="old")], [_held(1, 5, own=True)]])
    assert stale.complete() == set()
    # its own copy first, then its node, then another node
    both = Plan(1, ["A", "B"], [[_held(0, 5, own=True), _held(1, 5, own=False)], [_held(1, 5, own=True)]])
    assert both.holder(1, 5, reader=1)[0] == 1 and both.holder(1, 5, reader=0)[0] == 0
    assert both.holder(1, 5, reader=0)[0] == 0  # rank 0 reads rank 1's part from the copy on its own node
    assert both.servers(5) == [0]  # only rank 1 reads across nodes (rank 0's part, from rank 0)
