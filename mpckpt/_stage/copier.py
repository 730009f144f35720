"""The copy into shared memory: the only part of a save that training waits for.

``copy_wave`` copies every piece of one wave into its slab through typed views that are
built once per (layout, slab) and cached on the slab, so a repeated save costs one
``copy_`` per tensor and nothing else. CUDA tensors are copied device-to-host on the current
stream (into page-locked slabs when pinning succeeded) and synchronised before returning.

``estimate_state_bytes`` sizes the first slab before training has produced optimizer
state, so the slab can be created and touched at open instead of inside the first save.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
from collections.abc import Callable
from typing import Any

import torch

from mpckpt import _dtypes
from mpckpt._stage.arena import Slab
from mpckpt._stage.layout import Layout, WavePlan
from mpckpt._stage.snapshot import FlatState


def _views(slab: Slab, layout: Layout, wave_index: int, wave: WavePlan) -> list[torch.Tensor]:
    key = (layout.key, wave_index)
    views = slab.views.get(key)
    if views is None:
        views = []
        for shard in wave.shards:
            for p in shard.pieces:
                raw = slab.tensor[p.offset:p.offset + p.nbytes]
                views.append(raw.view(_dtypes.stored_dtype(p.code)).view(p.shape))
        slab.views[key] = views
    return views


@torch.no_grad()  # sources may be parameters that require grad; the copy is not part of training
def copy_wave(flat: FlatState, layout: Layout, wave_index: int, slab: Slab, *,
              only: Callable[[int], bool] | None = None) -> None:
    """Copy the pieces of wave ``wave_index`` of ``flat`` into ``slab`` (those ``only`` accepts)."""
    wave = layout.waves[wave_index]
    views = _views(slab, layout, wave_index, wave)
    sources = flat.sources
    if only is None and not flat.on_cuda and wave.whole_leaves is not None:  # the common case, fast
        torch._foreach_copy_(views, [sources[i] for i in wave.whole_leaves])
        return
    if flat.on_cuda:
        _copy_pieces(wave.copy_plan, views, sources, only, cuda=True, non_blocking=slab.pinned)
        torch.cuda.current_stream().synchronize()
    else:
        _copy_pieces(wave.copy_plan, views, sources, only, cuda=False, non_blocking=False)


_FEED_BYTES = 4 << 20  # copied, then fed on while still in the cache (``copy_wave_fed``)


def copy_wave_fed(flat: FlatState, layout: Layout, wave_index: int, slab: Slab,
                  feed: Callable[[int, memoryview], None], pool: concurrent.futures.Executor) -> bool:
    """Copy wave ``wave_index`` into ``slab`` shard by shard on ``pool``'s threads (``memmove``,
    which releases the GIL; large pieces in chunks), handing the slab bytes to ``feed(shard index,
    bytes)`` in file order each time about ``_FEED_BYTES`` have landed, while still in the cache
    (a checksum then costs little more than the copy).

    Only for CPU leaves whose memory is contiguous; False, nothing copied, for any other state:
    copy it with ``copy_wave`` and read it after.
    """
    wave = layout.waves[wave_index]
    sources = flat.sources
    if flat.on_cuda or any(not sources[p.leaf].is_contiguous() for s in wave.shards for p in s.pieces):
        return False
    base = slab.tensor.data_ptr()
    view = memoryview(slab.segment.mmap)

    def one_shard(index: int) -> None:
        pieces = wave.shards[index].pieces
        fed = pieces[0].offset if pieces else 0  # INVARIANT: a shard's pieces tile its slab range in order
        for p in pieces:
            src = sources[p.leaf].data_ptr() + (p.chunk[0] * p.itemsize if p.chunk else 0)
            for at in range(0, p.nbytes, _FEED_BYTES):
                n = min(_FEED_BYTES, p.nbytes - at)
                ctypes.memmove(base + p.offset + at, src + at, n)
                end = p.offset + at + n
                if end - fed >= _FEED_BYTES:
                    feed(index, view[fed:end])
                    fed = end
        if pieces and fed < pieces[-1].offset + pieces[-1].nbytes:
            feed(index, view[fed:pieces[-1].offset + pieces[-1].nbytes])

    try:
        for done in [pool.submit(one_shard, i) for i in range(len(wave.shards))]:
            done.result()
    finally:
        view.release()
    return True


def _copy_pieces(plan: list[tuple[int, tuple[int, int] | None]], views: list[torch.Tensor], sources: list[torch.Tensor],
                 only: Callable[[int], bool] | None, *, cuda: bool, non_blocking: bool) -> None:
    # INVARIANT: ``plan`` and ``views`` list the wave's pieces in the same order.
    dsts, srcs = [], []
    for dst, (leaf, chunk) in zip(views, plan, strict=True):
        if only is not None and not only(leaf):
            continue
        src = sources[leaf]
        if chunk is not None:
            src = src.reshape(-1)[chunk[0]:chunk[1]]
        dsts.append(dst)
        srcs.append(src)
    if cuda:  # device to host, asynchronous into page-locked slabs: one copy each, on the stream
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=non_blocking)
    elif dsts:
        # one call for the whole wave: with many small tensors the per-call cost of copy_
        # from Python is as large as the copy itself
        torch._foreach_copy_(dsts, srcs)


# Extra state tensors (as multiples of the parameters' bytes) that one optimizer step creates.
_OPTIMIZER_STATE_FACTOR = {
    "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0, "RAdam": 2.0, "SparseAdam": 2.0,
    "SGD": 1.0, "RMSprop": 1.0, "Adadelta": 2.0, "Adagrad": 0.0, "Rprop": 2.0, "ASGD": 1.0, "LBFGS": 2.0,
}


def _future_optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    params = [p for group in opt.param_groups for p in group["params"] if p not in opt.state]
    if not params:
        return 0
    factor = _OPTIMIZER_STATE_FACTOR.get(type(opt).__name__, 2.0)
    if any(group.get("amsgrad") for group in opt.param_groups):
        factor += 1.0
    per_param_scalars = 64 * len(params)  # the "step" counters
    return int(sum(p.numel() * p.element_size() for p in params) * factor) + per_param_scalars


def estimate_state_bytes(state: Any, flat: FlatState) -> int:
    """Bytes of ``state`` once its optimizers have taken a step (exact if they already have)."""
    extra = 0
    values = state.values() if isinstance(state, dict) else [state]
    for value in values:
        if isinstance(value, torch.optim.Optimizer):
            extra += _future_optimizer_bytes(value)
    return flat.nbytes + extra
