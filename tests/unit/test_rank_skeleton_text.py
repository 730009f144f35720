"""A rank's skeleton made from cached parts is the very JSON a plain dump of it gives, save after
save, and changes whenever what it describes changes."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import mpckpt
from mpckpt._codec.snapshot import FlattenMemo, flatten
from mpckpt._dist.plan import BLOCK_BYTES, RankPlan
from mpckpt._stage.layout import plan_layout
from mpckpt._stage.rank_skeleton import RankSkeletonText, blocks_doc, rank_leaves_doc
from mpckpt.format.skeleton import RANK_SKELETON_VERSION


def plain(flat, layout, plan, blocks, rank, world_size) -> bytes:
    doc = {"version": RANK_SKELETON_VERSION, "rank": rank, "world_size": world_size, "block_size": BLOCK_BYTES,
           "tree": flat.tree, "table": flat.table, "leaves": rank_leaves_doc(flat, layout, plan),
           "blocks": blocks_doc(blocks, rank)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def test_cached_parts_give_the_plain_dump_and_follow_every_change(tmp_path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        state = {"model": {k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in model.state_dict().items()},
                 "replicated": torch.arange(5.0), "mine": mpckpt.PerRank(torch.ones(3)), "lr": 0.1}
        memo, text = FlattenMemo(), RankSkeletonText()
        flat = flatten(state, memo=memo, distributed=True)
        kinds = set(flat.dist.kinds)
        assert kinds == {"sharded", "replicated", "local"}, kinds
        layout = plan_layout(flat.leaves, budget_bytes=1 << 30, workers=2, prefix="r0-")
        plan = RankPlan(frozenset(), {i: 0 for i, k in enumerate(flat.dist.kinds) if k == "replicated"})
        blocks = {"r0-shard-00000.safetensors": ["ab" * 8], "r0-shard-00001.safetensors": ["cd" * 8]}
        for lr in (0.1, 0.1, 0.2):  # the same state twice, then a value in the tree changes
            state["lr"] = lr
            flat = flatten(state, memo=memo, distributed=True)
            assert text(flat, layout, plan, blocks, rank=0, world_size=1) == plain(flat, layout, plan, blocks, 0, 1)
        other = RankPlan(frozenset(), {i: 3 for i in plan.writer})  # another writer: new leaves text
        assert text(flat, layout, other, blocks, rank=0, world_size=4) == plain(flat, layout, other, blocks, 0, 4)
        assert b'"writer":3' in text(flat, layout, other, blocks, rank=0, world_size=4)
        state["extra"] = torch.zeros(2)  # another state shape: new table and leaves
        flat = flatten(state, memo=memo, distributed=True)
        layout = plan_layout(flat.leaves, budget_bytes=1 << 30, workers=2, prefix="r0-")
        plan = RankPlan(frozenset(), {i: 0 for i, k in enumerate(flat.dist.kinds) if k == "replicated"})
        assert text(flat, layout, plan, {}, rank=0, world_size=1) == plain(flat, layout, plan, {}, 0, 1)
        assert b'"extra"' in text(flat, layout, plan, {}, rank=0, world_size=1)
    finally:
        dist.destroy_process_group()
