"""Copies of CUDA tensors into a slab: on a stream of mpckpt's own per device, small ones gathered.

A save of a state on a GPU copies device to host. ``DeviceCopies.start`` enqueues the copies of
one wave's CUDA pieces on a side stream of each device, ordered after everything training had
queued on that device's current stream (an event recorded there, waited for by the side stream),
and returns, per device, an event that completes when the bytes are in the slab:

- a large piece (``_SMALL_BYTES`` or more, or a chunk of a tensor larger than a wave) is one
  asynchronous device-to-host copy;
- small pieces are first gathered on the device into a bucket of mpckpt's own (at most
  ``_BUCKET_BYTES`` per device), laid out as they are in the slab, with one fused
  ``torch._foreach_copy_`` per dtype (a kernel launch per hundred-odd tensors); then each run of
  them that is contiguous in the slab goes down in one copy. 20,000 small tensors cost a few
  hundred launches and a few dozen copies, not 20,000 copies (the launch, about 5 us each, is
  what a copy per tensor costs beyond the bytes).

Pieces whose source is on the CPU (an optimizer's step counters) are copied on the host at once.
Slabs are page-locked (``Slab.pin``: registered with CUDA) so the copies run at full speed and
asynchronously; an unregistered slab (registration refused) still gets correct, slower copies.

The callers order the rest: an eager save waits for the events on the host (``wait``); an
overlapped one makes training's stream wait for them on the GPU (``stream_wait``): at once for
what the next forward may change in place, before the next optimizer step for parameters and
moments; its background thread waits on the host before anything reads the slab.

INVARIANTS: a source stays referenced (by the ``FlatState`` the caller holds) until the event of
its copy has completed, so the caching allocator cannot hand its memory to other work meanwhile;
a bucket is allocated on its side stream and used only there, so the next chunk's gather into it
is ordered after the previous chunk's copy out of it; one wave is enqueued at a time in a process
(``_lock``), so two checkpointers never interleave their gathers in one bucket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpckpt._stage.arena import Slab
from mpckpt._stage.layout import WavePlan
from mpckpt._stage.written import allocate

_SMALL_BYTES = 1 << 20   # pieces below this are gathered on the device first
_BUCKET_BYTES = 64 << 20  # at most this much device memory per device for the gathers
_ALIGN = 16              # the largest element size: a bucket place keeps its piece's slab alignment

_SUBSETS_KEPT = 4         # restrictions of one plan to a set of leaves kept at a time

Events = list[tuple[torch.device, Any]]  # (device, torch.cuda.Event) pairs
# which leaves to copy: all (None), a set (its restricted plan is kept), or a test of each leaf
Selection = frozenset[int] | Callable[[int], bool] | None


@dataclass
class _Group:
    """Small pieces of one dtype, gathered by one ``torch._foreach_copy_``."""

    places: list[torch.Tensor]  # their places in the bucket, as the slab views them
    leaves: list[int]


@dataclass
class _Chunk:
    """Small pieces that fit the bucket at once: gathered, then copied down span by span."""

    groups: list[_Group]
    items: list[tuple[int, int, int, int]]  # (leaf, slab offset, bucket offset, bytes), in slab order
    spans: list[tuple[int, int, int]]       # (slab offset, bucket offset, bytes) covering every item


@dataclass
class _OnDevice:
    device: torch.device
    stream: Any
    bucket: torch.Tensor | None = None
    direct: list[int] = field(default_factory=list)  # piece numbers copied one by one
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass
class _Plan:
    key: Any                       # the ``FlatState.key`` it was made for (devices too: see ``plan``)
    host: list[int]                # piece numbers whose source is on the CPU
    devices: list[_OnDevice]
    # restricted to a set of leaves (``restricted``): id of the set -> (the set, the plan)
    subsets: dict[int, tuple[frozenset[int], _Plan]] = field(default_factory=dict)

    def restricted(self, pieces: list[Any], only: Selection) -> _Plan:
        """This plan for the leaves ``only`` accepts. A frozenset's restriction is made once and
        kept (an overlapped save passes the same two sets each time: a few per plan); a callable's
        each time."""
        if only is None:
            return self
        if not isinstance(only, frozenset):
            return self._restrict(pieces, only)
        held = self.subsets.get(id(only))
        if held is not None and held[0] is only:
            return held[1]
        if len(self.subsets) >= _SUBSETS_KEPT:
            self.subsets.clear()
        plan = self.subsets[id(only)] = (only, self._restrict(pieces, only.__contains__))
        return plan[1]

    def _restrict(self, pieces: list[Any], accepts: Callable[[int], bool]) -> _Plan:
        devices = []
        for on in self.devices:
            chunks = []
            for chunk in on.chunks:
                groups = []
                for group in chunk.groups:
                    chosen = [i for i, leaf in enumerate(group.leaves) if accepts(leaf)]
                    if chosen:
                        groups.append(_Group([group.places[i] for i in chosen], [group.leaves[i] for i in chosen]))
                items = [item for item in chunk.items if accepts(item[0])]
                if items:
                    chunks.append(_Chunk(groups, items, _spans(items)))
            direct = [k for k in on.direct if accepts(pieces[k].leaf)]
            devices.append(_OnDevice(on.device, on.stream, on.bucket, direct, chunks))
        return _Plan(self.key, [k for k in self.host if accepts(pieces[k].leaf)], devices)


class DeviceCopies:
    """The side streams and gather buckets of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._buckets: dict[torch.device, torch.Tensor] = {}

    def start(self, sources: list[torch.Tensor], key: Any, wave: WavePlan, views: list[torch.Tensor], slab: Slab,
              only: Selection) -> Events:
        """Enqueue the copy of the wave's pieces (those ``only`` selects) into ``slab``; CPU sources
        are copied before this returns. ``views``: the slab's views of the pieces, in wave order."""
        pieces = wave.pieces
        with self._lock:
            plan = self.plan(sources, key, wave, views).restricted(pieces, only)
        if plan.host:
            torch._foreach_copy_([views[k] for k in plan.host], [_source(sources, pieces[k]) for k in plan.host])
        if not plan.devices:
            return []
        if not slab.pinned:
            allocate(slab)  # (a sparse slab is never written through its map)
            slab.pin()
        events: Events = []
        with self._lock:
            for on in plan.devices:
                events.append((on.device, self._enqueue(on, sources, pieces, views, slab.tensor)))
        return events

    def _enqueue(self, on: _OnDevice, sources: list[torch.Tensor], pieces: list[Any], views: list[torch.Tensor],
                 base: torch.Tensor) -> Any:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(on.device))  # after everything training queued so far
        on.stream.wait_event(ready)
        with torch.cuda.stream(on.stream):
            if on.direct:
                torch._foreach_copy_([views[k] for k in on.direct], [_source(sources, pieces[k]) for k in on.direct],
                                     non_blocking=True)
            for chunk in on.chunks:
                for group in chunk.groups:
                    torch._foreach_copy_(group.places, [sources[leaf] for leaf in group.leaves])
                assert on.bucket is not None
                for at, bucket_at, n in chunk.spans:
                    base[at:at + n].copy_(on.bucket[bucket_at:bucket_at + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(on.stream)
        return done

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, sources: list[torch.Tensor], key: Any, wave: WavePlan, views: list[torch.Tensor]) -> _Plan:
        """Where each piece of the wave is copied from, made once per state (under ``_lock``): a
        repeated save of the same tensors (the flatten memo's hit, which compares their devices too,
        gives the very same ``key`` object) reuses it; any other state is planned again."""
        cached = wave.__dict__.get("_device_plan")
        if cached is not None and cached.key is key:
            return cached
        pieces = wave.pieces
        host: list[int] = []
        small: dict[torch.device, list[int]] = {}
        devices: dict[torch.device, _OnDevice] = {}
        for k, p in enumerate(pieces):
            source = sources[p.leaf]
            if not source.is_cuda:
                host.append(k)
                continue
            on = devices.get(source.device)
            if on is None:
                on = devices[source.device] = _OnDevice(source.device, self._stream(source.device))
            if p.chunk is None and 0 < p.nbytes < _SMALL_BYTES:
                small.setdefault(source.device, []).append(k)
            elif p.nbytes:
                on.direct.append(k)
        for device, ks in small.items():
            on = devices[device]
            chunks = _chunks([pieces[k] for k in ks])
            on.bucket = self._bucket(on, max(used for _, used in chunks))
            on.chunks = [_chunk(items, [views[k] for k in ks_of], on.bucket)
                         for (items, _), ks_of in zip(chunks, _split(ks, chunks), strict=True)]
        plan = _Plan(key, host, list(devices.values()))
        wave.__dict__["_device_plan"] = plan
        return plan

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _bucket(self, on: _OnDevice, nbytes: int) -> torch.Tensor:
        bucket = self._buckets.get(on.device)
        if bucket is None or bucket.numel() < nbytes:
            with torch.cuda.stream(on.stream):  # its blocks belong to the side stream (INVARIANTS)
                bucket = self._buckets[on.device] = torch.zeros(nbytes, dtype=torch.uint8, device=on.device)
        return bucket


def _chunks(pieces: list[Any]) -> list[tuple[list[tuple[int, int, int, int]], int]]:
    """Small pieces (in slab order) cut into chunks that fit the bucket: per chunk its items
    (leaf, slab offset, bucket offset, bytes) and the bucket bytes it uses. A run of pieces
    contiguous in the slab is contiguous in the bucket; each run starts at a bucket offset
    congruent to its slab offset modulo ``_ALIGN``, so every piece keeps its dtype's alignment."""
    out: list[tuple[list[tuple[int, int, int, int]], int]] = []
    items: list[tuple[int, int, int, int]] = []
    used, slab_end = 0, -1
    for p in pieces:
        at = used if p.offset == slab_end else -(-used // _ALIGN) * _ALIGN + p.offset % _ALIGN
        if items and at + p.nbytes > _BUCKET_BYTES:
            out.append((items, used))
            items, used = [], 0
            at = p.offset % _ALIGN
        items.append((p.leaf, p.offset, at, p.nbytes))
        used, slab_end = at + p.nbytes, p.offset + p.nbytes
    if items:
        out.append((items, used))
    return out


def _split(ks: list[int], chunks: list[tuple[list[Any], int]]) -> list[list[int]]:
    out, at = [], 0
    for items, _ in chunks:
        out.append(ks[at:at + len(items)])
        at += len(items)
    return out


def _chunk(items: list[tuple[int, int, int, int]], views: list[torch.Tensor], bucket: torch.Tensor) -> _Chunk:
    groups: dict[torch.dtype, _Group] = {}
    for (leaf, _, at, n), view in zip(items, views, strict=True):
        place = bucket[at:at + n].view(view.dtype).view(view.shape)
        group = groups.setdefault(view.dtype, _Group([], []))
        group.places.append(place)
        group.leaves.append(leaf)
    return _Chunk(list(groups.values()), items, _spans(items))


def _spans(items: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """The (slab offset, bucket offset, bytes) runs covering the items."""
    spans: list[list[int]] = []
    for _, at, bucket_at, n in items:
        if spans and spans[-1][0] + spans[-1][2] == at and spans[-1][1] + spans[-1][2] == bucket_at:
            spans[-1][2] += n
        else:
            spans.append([at, bucket_at, n])
    return [(a, b, n) for a, b, n in spans]


def _source(sources: list[torch.Tensor], piece: Any) -> torch.Tensor:
    source = sources[piece.leaf]
    if piece.chunk is not None:
        source = source.reshape(-1)[piece.chunk[0]:piece.chunk[1]]
    return source


def wait(events: Events) -> None:
    """Block until the copies behind ``events`` are in the slab."""
    for _, event in events:
        event.synchronize()


def stream_wait(events: Events) -> None:
    """Make the current stream of each device wait, on the GPU, for the copies behind ``events``."""
    for device, event in events:
        torch.cuda.current_stream(device).wait_event(event)


_COPIES: DeviceCopies | None = None
_COPIES_LOCK = threading.Lock()


def device_copies() -> DeviceCopies:
    """This process's side streams and buckets (made on first use, by a save of a CUDA state)."""
    global _COPIES
    with _COPIES_LOCK:
        if _COPIES is None:
            _COPIES = DeviceCopies()
        return _COPIES
