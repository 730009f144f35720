"""The gather plan of ``_stage.device`` (small pieces laid out in a bucket, copied down in spans),
run with CPU tensors standing in for the device's: every byte lands where the plain copy puts it.

The streams and events themselves need a GPU (tests/integration/test_cuda.py)."""

from __future__ import annotations

import random

import pytest
import torch

from mpckpt._codec.snapshot import flatten
from mpckpt._stage import device
from mpckpt._stage.layout import plan_layout


def mixed_state(count: int, seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8, torch.float64]
    state = {}
    for i in range(count):
        dtype = rng.choice(dtypes)
        shape = (rng.randint(0, 40), rng.randint(1, 9)) if rng.random() < 0.8 else (rng.randint(1, 3000),)
        t = (torch.rand(shape) * 100).to(dtype) if dtype is not torch.bool else torch.rand(shape) > 0.5
        state[f"t{i:04d}"] = t
    return state


def gathered(state: dict[str, torch.Tensor], *, workers: int, bucket_bytes: int,
             only: device.Selection = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The slab bytes as the plain copy leaves them, and as the gather plan does (restricted to
    ``only`` by the plan's own ``restricted``, as ``DeviceCopies.start`` does)."""
    flat = flatten(state)
    layout = plan_layout(flat.leaves, budget_bytes=1 << 30, workers=workers)
    (wave,) = layout.waves
    plain = torch.zeros(wave.nbytes, dtype=torch.uint8)
    slab = torch.zeros(wave.nbytes, dtype=torch.uint8)
    pieces = [p for s in wave.shards for p in s.pieces]
    accepts = (lambda leaf: True) if only is None else only.__contains__ if isinstance(only, frozenset) else only

    def views(base):
        return [base[p.offset:p.offset + p.nbytes].view(flat.sources[p.leaf].dtype).view(p.shape) for p in pieces]

    plain_views = [v for v, p in zip(views(plain), pieces, strict=True) if accepts(p.leaf)]
    torch._foreach_copy_(plain_views, [flat.sources[p.leaf] for p in pieces if accepts(p.leaf)])
    small = [p for p in pieces if 0 < p.nbytes]
    chunks = device._chunks(small) if bucket_bytes is None else _with_bucket(small, bucket_bytes)
    slab_views = views(slab)
    by_piece = {id(p): v for p, v in zip(pieces, slab_views, strict=True)}
    at, planned, buckets = 0, [], []
    for items, used in chunks:
        assert used <= max(bucket_bytes, max(n for *_, n in items) + device._ALIGN)
        buckets.append(torch.full((used,), 0xAB, dtype=torch.uint8))  # stale bytes: never copied down
        planned.append(device._chunk(items, [by_piece[id(p)] for p in small[at:at + len(items)]], buckets[-1]))
        at += len(items)
    assert at == len(small)
    on = device._OnDevice(torch.device("cpu"), None, None, [], planned)
    plan = device._Plan(None, [], [on]).restricted(pieces, only)
    (on,) = plan.devices
    bucket_of = {id(item): bucket for chunk, bucket in zip(planned, buckets, strict=True) for item in chunk.items}
    for chunk in on.chunks:
        bucket = bucket_of[id(chunk.items[0])]
        for group in chunk.groups:
            for place in group.places:
                assert place.data_ptr() % place.element_size() == 0  # every dtype keeps its alignment
            torch._foreach_copy_(group.places, [flat.sources[leaf] for leaf in group.leaves])
        for start, bucket_at, n in chunk.spans:
            slab[start:start + n].copy_(bucket[bucket_at:bucket_at + n])
    return plain, slab


def _with_bucket(pieces, bucket_bytes):
    old = device._BUCKET_BYTES
    device._BUCKET_BYTES = bucket_bytes
    try:
        return device._chunks(pieces)
    finally:
        device._BUCKET_BYTES = old


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("bucket_bytes", [64 << 20, 4096, 777])
def test_gathered_pieces_land_where_the_plain_copy_puts_them(workers: int, bucket_bytes: int) -> None:
    state = mixed_state(400, seed=workers * 1000 + bucket_bytes)
    plain, slab = gathered(state, workers=workers, bucket_bytes=bucket_bytes)
    assert torch.equal(plain, slab)


def test_a_partial_copy_writes_only_the_pieces_asked_for() -> None:
    """An overlapped save copies buffers first and the rest later: neither part may overwrite the
    other's bytes with the bucket's stale ones."""
    state = mixed_state(300, seed=5)
    odd = lambda leaf: leaf % 2 == 1  # noqa: E731
    plain, slab = gathered(state, workers=2, bucket_bytes=8192, only=odd)
    assert torch.equal(plain, slab)
    assert plain.any()
    evens = frozenset(range(0, 300, 2))  # a set: its restricted plan is the one kept
    plain, slab = gathered(state, workers=2, bucket_bytes=8192, only=evens)
    assert torch.equal(plain, slab)
    assert plain.any()


def test_a_plan_keeps_its_restriction_to_a_set_and_not_to_an_equal_new_one() -> None:
    state = mixed_state(50, seed=9)
    flat = flatten(state)
    (wave,) = plan_layout(flat.leaves, budget_bytes=1 << 30, workers=1).waves
    pieces = [p for s in wave.shards for p in s.pieces]
    plan = device._Plan(None, list(range(len(pieces))), [])
    some = frozenset(range(0, 50, 3))
    first = plan.restricted(pieces, some)
    assert plan.restricted(pieces, some) is first
    assert sorted(pieces[k].leaf for k in first.host) == sorted(some)
    equal_but_new = frozenset(set(some))
    assert plan.restricted(pieces, equal_but_new) is not first  # kept by identity: never a stale set's plan
    assert plan.restricted(pieces, None) is plan
    for n in range(device._SUBSETS_KEPT + 2):  # a bounded number kept
        plan.restricted(pieces, frozenset({n}))
    assert len(plan.subsets) <= device._SUBSETS_KEPT


def test_a_run_of_contiguous_pieces_is_one_span() -> None:
    state = {f"w{i}": torch.full((64,), float(i)) for i in range(100)}  # one dtype, one shard
    flat = flatten(state)
    layout = plan_layout(flat.leaves, budget_bytes=1 << 30, workers=1)
    pieces = [p for s in layout.waves[0].shards for p in s.pieces]
    ((items, used),) = device._chunks(pieces)
    assert device._spans(items) == [(pieces[0].offset, 0, 100 * 256)]
    assert used == 100 * 256
