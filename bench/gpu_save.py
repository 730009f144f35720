"""What ``save()`` blocks a training loop for when the state lives on a GPU, against the pinned
device-to-host floor and DCP's ``async_save`` with its pinned stager.

For each tensor count of ``--tensors``, in a fresh subprocess: a ``ModuleList`` of
``Linear(h, h)`` layers on ``--device`` with ``torch.optim.Adam`` after one real step, so the
state holds about that many tensors (per layer: weight, bias and Adam's ``exp_avg``,
``exp_avg_sq`` and ``step`` of each, 8 tensors) and ``--gib`` GiB (params + two moments). A
training step is a forward of a fixed batch through every layer (``y + tanh(layer(y))``),
backward, ``optimizer.step()``. On CUDA every timed call starts after ``torch.cuda.synchronize()``
so earlier work is not billed to it. Modes (``--modes``), all on the same tensors:

  floor        one ``copy_(non_blocking=True)`` per state tensor into page-locked host tensors
               allocated beforehand, then ``synchronize()``: the D2H floor of a per-tensor copy
  floor_one    the same bytes as one contiguous device buffer, one D2H copy: the bandwidth floor
  eager        ``Checkpointer(dir, workers=2)``, ``prepare(state)``, then ``--saves`` saves with a
               training step before each (not timed), each timed from the call to its return; the
               previous commit is waited for (``wait()``) outside the timing. Then ``mpckpt.load``
               of the last one is compared with the live state (the mode fails if it differs)
  overlap      ``overlap=True``; each save sits between a plain training step (the baseline) and
               the step it overlaps: blocked = time in ``save()`` + how much longer that step took
               than the plain one (``step extra``: the whole step, since the copy shares the GPU
               with forward and backward, not only the barrier before ``optimizer.step()``);
               ``wait`` = the save's own ``stats.barrier_ms``. Pairing keeps drift out of it
  first        a fresh ``Checkpointer`` with neither ``prepare`` nor ``restore``: its first save,
               timed after the uploaders are up (``wait()``)
  dcp          ``get_state_dict`` + ``dcp.async_save`` with ``DefaultStager(StagingOptions(
               use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
               use_non_blocking_copy=cuda))`` on a one-rank gloo group, saves as in ``eager``;
               blocked = from the call until ``staging_completion`` is done (the loop may not step
               the optimizer before), ``in call`` = until ``async_save`` returns. The upload is
               waited for (``upload_completion``) outside the timing. Where that stager fails,
               ``BlockingAsyncStager(cache_staged_state_dict=True)`` (pinned, cached, staging in
               the call), the row named so and the failure kept in the JSON
  dcp_overlap  the same, placed as in ``overlap``: the step after the save waits for
               ``staging_completion`` only before ``optimizer.step()`` (DCP's overlapped use);
               blocked = the call + the step's extra time, ``wait`` = that staging wait
  restore      (only when named) ``restore`` into the live model and optimizer, each timed from the
               call until the device is done, a fresh ``Checkpointer`` each time: from the snapshot
               kept in shared memory (``close(leave_in_memory=True)`` before) and from storage
               (``keep_in_memory=False``), every restore checked to give back a weight changed
               before it; against the host-to-device floor (one ``copy_(non_blocking=True)`` per
               tensor from page-locked tensors made beforehand, and the same bytes as one copy).
               ``source``: where each restore said it read from
  pin_parts    (only when named) what an unprepared first save pays for its memory, part by
               part: a shared-memory slab made, registered with CUDA, copied into; against
               ``pin_memory=True`` (cudaHostAlloc) and a copy into an unregistered slab

In the overlapped modes the save's upload runs during the step it overlaps (as in training);
its commit is waited for after that step. Adam's ``step`` counters stay on the host (torch's
default), so every mode, the floor included, copies them host to host. Each mode reports its
first save and the median of the rest (steady), ``steady / floor`` against ``floor``'s steady. A
fresh stager per DCP mode, so both have a first save that allocates and pins its staging memory.
``--device cpu`` is a smoke run on a machine without a GPU: the same code, plain host memory, no
pinning, no streams. Prints one markdown table; every figure goes to ``--out`` (JSON).

    .venv/bin/python bench/gpu_save.py                    # 16, 2,000, 20,000 tensors, 1 GiB, cuda
    .venv/bin/python bench/gpu_save.py --device cpu --gib 0.05 --tensors 16,200 --saves 3
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _harness as h
import torch
from torch import nn

MODES = ["floor", "floor_one", "eager", "overlap", "first", "dcp", "dcp_overlap", "pin_parts", "restore"]
DEFAULT_MODES = MODES[:-2]  # pin_parts, restore: asked for by name
TENSORS_PER_LAYER = 8  # weight, bias; Adam's exp_avg, exp_avg_sq and step of each


@dataclass
class Work:
    model: nn.ModuleList
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    cuda: bool

    @property
    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optimizer}

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.model.state_dict().values())
        return out + [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def forward_backward(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        y = self.inputs
        for layer in self.model:
            y = y + torch.tanh(layer(y))
        y.square().mean().backward()

    def train_step(self) -> None:
        self.forward_backward()
        self.optimizer.step()


def build(tensors: int, gib: float, device: str) -> Work:
    """Layers of ``Linear(h, h)`` holding about ``tensors`` tensors and ``gib`` GiB with Adam."""
    layers = max(1, round(tensors / TENSORS_PER_LAYER))
    per_layer = gib * h.GIB / (4 * 3 * layers)  # h*h + h floats, three times (param, two moments)
    hidden = max(1, int((math.sqrt(1 + 4 * per_layer) - 1) / 2))
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(hidden, hidden, device=device) for _ in range(layers)])
    work = Work(model, torch.optim.Adam(model.parameters(), lr=1e-5),
                torch.randn(8, hidden, device=device), device == "cuda")
    work.train_step()  # Adam's moments exist from here on
    work.sync()
    return work


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3


# -- floors ----------------------------------------------------------------------------------
def floor(work: Work, saves: int, *, one: bool) -> dict[str, list[float]]:
    """``floor``: one copy per state tensor into page-locked (cpu: plain) host tensors made and
    touched beforehand; ``floor_one`` (``one``): the same bytes as one device buffer, one copy."""
    sources = work.tensors()
    if one:
        sources = [torch.ones(h.state_bytes(sources), dtype=torch.uint8, device=work.inputs.device)]
    dst = [torch.zeros(t.shape, dtype=t.dtype, pin_memory=work.cuda) for t in sources]
    out = []
    for _ in range(saves):
        work.sync()
        started = time.perf_counter()
        for d, src in zip(dst, sources, strict=True):
            d.copy_(src, non_blocking=work.cuda)
        work.sync()
        out.append(_ms(started))
    return {"blocked_ms": out}


# -- the loops of saves, one for every subject ----------------------------------------------
@dataclass
class Subject:
    """How one checkpointer saves: ``save(step)`` returns a handle; ``staged(handle)`` waits until
    the optimizer may step (returns the ms waited); ``settle(handle)`` waits for the upload, not
    timed (returns the ms the save made the loop wait inside ``optimizer.step()``, if it knows)."""

    save: Callable[[int], Any]
    staged: Callable[[Any], float]
    settle: Callable[[Any], float]


def _step_ms(work: Work, before_step: Callable[[], float] = lambda: 0.0) -> tuple[float, float]:
    """One training step from now until the device is done, and what ``before_step`` (run before
    ``optimizer.step()``) returned. Nothing synchronises first: what still runs is billed to it."""
    started = time.perf_counter()
    work.forward_backward()
    before = before_step()
    work.optimizer.step()
    work.sync()
    return _ms(started), before


def eager_saves(work: Work, saves: int, subject: Subject) -> dict[str, list[float]]:
    """Saves with a training step before each (not timed); blocked = the call + until staged."""
    out: dict[str, list[float]] = {"call_ms": [], "blocked_ms": []}
    for step in range(saves):
        if step:
            work.train_step()  # each save copies a changed state
        work.sync()
        started = time.perf_counter()
        handle = subject.save(step)
        out["call_ms"].append(_ms(started))
        subject.staged(handle)
        out["blocked_ms"].append(_ms(started))
        subject.settle(handle)
    return out


def overlapped_saves(work: Work, saves: int, subject: Subject) -> dict[str, list[float]]:
    """Each save between two training steps: a plain one (the baseline, paired so that a busy
    machine's drift hits both) and the one after the save; blocked = the call + the difference."""
    out: dict[str, list[float]] = {k: [] for k in ("base_ms", "call_ms", "extra_ms", "wait_ms", "blocked_ms")}
    work.train_step()  # not timed: a first step after opening is no baseline
    for step in range(saves):
        work.sync()
        out["base_ms"].append(_step_ms(work)[0])
        work.sync()
        started = time.perf_counter()
        handle = subject.save(step)
        out["call_ms"].append(_ms(started))
        step_ms, staged_ms = _step_ms(work, functools.partial(subject.staged, handle))
        out["extra_ms"].append(step_ms - out["base_ms"][-1])
        out["wait_ms"].append(staged_ms + subject.settle(handle))
        out["blocked_ms"].append(out["call_ms"][-1] + out["extra_ms"][-1])
    return out


# -- mpckpt ----------------------------------------------------------------------------------
def mpckpt_saves(work: Work, saves: int, root: str, mode: str) -> dict[str, list[float]]:
    """``eager`` (then the last save loaded back and compared), ``overlap`` or ``first``."""
    import mpckpt

    with mpckpt.Checkpointer(root, workers=2, keep_last=1, overlap=mode == "overlap") as ckpt:
        if mode == "first":
            ckpt.wait()  # no prepare: the uploaders are up, as after a script's first steps
        else:
            ckpt.prepare(work.state)

        def settle(future: Any) -> float:
            ckpt.wait()  # the next save starts with nothing uploading
            return future.stats.barrier_ms  # the optimizer step pre-hook's wait for the copy

        subject = Subject(lambda step: ckpt.save(step, work.state), lambda _f: 0.0, settle)
        if os.environ.get("GPU_SAVE_PROFILE") and mode != "first":
            subject.save = _profiled(subject.save, os.environ["GPU_SAVE_PROFILE"], f"{len(work.tensors())} {mode}")
        if mode == "overlap":
            out = overlapped_saves(work, saves, subject)
        else:
            out = eager_saves(work, 1 if mode == "first" else saves, subject)
    if mode == "eager":
        loaded = mpckpt.load(root)["model"]["0.weight"].cpu()
        assert torch.equal(loaded, work.model[0].weight.detach().cpu()), "mpckpt.load differs from the live state"
    return out


def _profiled(save: Callable[[int], Any], path: str, title: str) -> Callable[[int], Any]:
    """``save`` under cProfile from its second call on; the heaviest functions appended to
    ``path`` after every call (``GPU_SAVE_PROFILE``: where a save's host time goes; the timed
    figures of a profiled run are not comparable)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()

    def wrapped(step: int) -> Any:
        if not step:
            return save(step)
        profile.enable()
        try:
            return save(step)
        finally:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
            with open(path, "a") as f:
                f.write(f"== {title}, saves 1..{step}\n" + text.getvalue()[-6000:])

    return wrapped


# -- DCP -------------------------------------------------------------------------------------
def dcp_saves(work: Work, saves: int, root: str, *, overlapped: bool) -> dict[str, Any]:
    """``async_save`` with a pinned, cached stager (fresh, so its first save allocates): the
    ``DefaultStager`` (asynchronous staging); where it fails (torch 2.11 on an H100 failed every
    staging with ``KeyError: <class 'type'>`` from its copy table), ``BlockingAsyncStager(
    cache_staged_state_dict=True)``, the pinned cached stager before it (staging inside the call),
    with the failure kept under ``default_stager_error``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return {**_dcp_saves_with(work, saves, root, overlapped=overlapped, blocking=False), "stager": "default"}
    except Exception as e:  # noqa: BLE001  (named in the result; the other stager is measured)
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"[:300]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    out = _dcp_saves_with(work, saves, root, overlapped=overlapped, blocking=True)
    return {**out, "stager": "blocking", "default_stager_error": error}


def _dcp_saves_with(work: Work, saves: int, root: str, *, overlapped: bool, blocking: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # pinning needs CUDA and use_non_blocking_copy asserts an accelerator: both only on cuda
    stager = BlockingAsyncStager(cache_staged_state_dict=work.cuda) if blocking else DefaultStager(StagingOptions(
        use_pinned_memory=work.cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=work.cuda))

    def save(step: int) -> Any:
        model_sd, optim_sd = get_state_dict(work.model, work.optimizer)
        path = os.path.join(root, f"dcp-{step}")
        return path, dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, async_stager=stager)

    def staged(handle: Any) -> float:  # (a blocking stager's async_save returns once staged: a plain future)
        started = time.perf_counter()
        if hasattr(handle[1], "staging_completion"):
            handle[1].staging_completion.result()  # the parameters may not change before
        return _ms(started)

    def settle(handle: Any) -> float:
        getattr(handle[1], "upload_completion", handle[1]).result()
        shutil.rmtree(handle[0])
        return 0.0

    try:
        return (overlapped_saves if overlapped else eager_saves)(work, saves, Subject(save, staged, settle))
    finally:
        stager.close()


# -- restores ---------------------------------------------------------------------------------
def restores(work: Work, repeats: int, root: str) -> dict[str, Any]:
    """``restore``: see the module's docstring."""
    import mpckpt

    roots = {"memory": os.path.join(root, "memory"), "storage": os.path.join(root, "storage")}
    tensors = work.tensors()
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=work.cuda).copy_(t) for t in tensors]
    one = torch.empty(h.state_bytes(tensors), dtype=torch.uint8, pin_memory=work.cuda)
    one_dst = torch.empty_like(one, device=work.inputs.device)
    out: dict[str, Any] = {f"{k}_ms": [] for k in ("memory", "storage", "floor", "floor_one")}
    out["source"] = []
    for repeat in range(repeats):
        for source, where in roots.items():
            # saved by a process that then leaves (its snapshot kept in memory for the memory root)
            ckpt = mpckpt.Checkpointer(where, workers=2, keep_last=1, keep_in_memory=source == "memory")
            ckpt.save(repeat, work.state, mode="sync")
            ckpt.close(leave_in_memory=True)
            expected = work.model[0].weight.detach().clone()
            with torch.no_grad():
                work.model[0].weight.add_(1.0)  # the restore must give the saved bytes back
            ckpt = mpckpt.Checkpointer(where, workers=2, keep_last=1, keep_in_memory=source == "memory")
            try:
                work.sync()
                started = time.perf_counter()
                ckpt.restore(work.state)
                work.sync()
                out[f"{source}_ms"].append(_ms(started))
                last = ckpt.last_restore
                out["source"].append(f"{source}:{last.source if last else None}")
                assert torch.equal(work.model[0].weight, expected), f"restore from {source} gave other bytes"
            finally:
                ckpt.close()
        work.sync()
        started = time.perf_counter()
        for t, host in zip(tensors, pinned, strict=True):
            t.copy_(host, non_blocking=work.cuda)
        work.sync()
        out["floor_ms"].append(_ms(started))
        started = time.perf_counter()
        one_dst.copy_(one, non_blocking=work.cuda)
        work.sync()
        out["floor_one_ms"].append(_ms(started))
    h.remove_kept_in_memory([roots["memory"]])
    return out


# -- the parts of an unprepared first save --------------------------------------------------
def pin_parts(work: Work) -> dict[str, float]:
    """What a first save of a GPU state pays for its memory, part by part, for the state's bytes
    (milliseconds, one try each): a shared-memory slab made (``Segment.create``: every page
    allocated) and registered with CUDA (``Slab.pin``: ``cudaHostRegister``), one device-to-host
    copy into it; against page-locked memory from CUDA's allocator (``pin_memory=True``:
    ``cudaHostAlloc``) and one copy into it, and one copy into an unregistered slab (pageable)."""
    from mpckpt._stage.arena import Slab, _unpin
    from mpckpt._system.shm import Segment

    nbytes = h.state_bytes(work.tensors())
    source = torch.ones(nbytes, dtype=torch.uint8, device=work.inputs.device)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        work.sync()
        started = time.perf_counter()
        result = fn()
        work.sync()
        out[name] = _ms(started)
        return result

    slabs: list[Any] = []
    try:
        slabs.append(Slab(timed("shm_create_ms", lambda: Segment.create(nbytes))))
        registered = slabs[0]
        if work.cuda:
            out["pinned"] = float(timed("register_ms", registered.pin))
            timed("copy_into_registered_ms", lambda: registered.tensor.copy_(source, non_blocking=True))
            host = timed("cuda_host_alloc_ms", lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            timed("copy_into_host_alloc_ms", lambda: host.copy_(source, non_blocking=True))
            del host
        slabs.append(Slab(Segment.create(nbytes)))
        pageable = slabs[1]
        timed("copy_into_pageable_slab_ms", lambda: pageable.tensor.copy_(source))
    finally:
        for slab in slabs:
            if slab.pinned:
                _unpin(slab.tensor)
            del slab.tensor  # (the map goes with the last view of it)
            slab.segment.close()
            slab.segment.unlink()
    return out


# -- one tensor count (the child) ------------------------------------------------------------
def run_mode(mode: str, work: Work, saves: int, root: str) -> dict[str, Any]:
    where = os.path.join(root, mode)
    if mode == "pin_parts":
        return {"parts_ms": pin_parts(work)}
    if mode == "restore":
        return restores(work, saves, where)
    if mode in ("floor", "floor_one"):
        return floor(work, saves, one=mode == "floor_one")
    if mode in ("eager", "overlap", "first"):
        return mpckpt_saves(work, saves, where, mode)
    os.makedirs(where, exist_ok=True)
    return dcp_saves(work, saves, where, overlapped=mode == "dcp_overlap")


def child(tensors: int, gib: float, saves: int, device: str, modes: list[str]) -> dict[str, Any]:
    work = build(tensors, gib, device)
    state = work.tensors()
    result: dict[str, Any] = {
        "tensors": len(state), "requested": tensors, "bytes": h.state_bytes(state), "layers": len(work.model),
        "hidden": work.inputs.shape[1], "device_tensors": sum(t.device.type == device for t in state),
        "device": torch.cuda.get_device_name(0) if work.cuda else "cpu", "modes": {}}
    os.makedirs(h.RESULTS_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_save-", dir=h.RESULTS_DIR) as root:
        try:
            for mode in modes:
                print(f"[gpu_save] {tensors} tensors: {mode} ...", file=sys.stderr, flush=True)
                try:
                    result["modes"][mode] = run_mode(mode, work, saves, root)
                except Exception as e:  # noqa: BLE001  (kept in the result: the other modes still run)
                    traceback.print_exc()
                    result["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            h.remove_kept_in_memory([os.path.join(root, m) for m in modes])
    return result


# -- the parent: one child per tensor count, one table ---------------------------------------
COLUMNS = [("tensors", "tensors", 0), ("mib", "MiB", 0), ("mode", "mode", 0), ("first", "first ms", 1),
           ("steady", "steady ms", 1), ("x_floor", "steady / floor", 2), ("call", "in call ms", 1),
           ("extra", "step extra ms", 1), ("wait", "wait ms", 1), ("error", "error", 0)]


def _steady(values: list[float] | None) -> float | None:
    return h.median(values[1:]) if values and len(values) > 1 else None


def table_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    floor_ms = _steady(run["modes"].get("floor", {}).get("blocked_ms"))
    for mode, figures in run["modes"].items():
        blocked, steady = figures.get("blocked_ms"), _steady(figures.get("blocked_ms"))
        if figures.get("stager") == "blocking":  # the DefaultStager failed: its error is in the JSON
            mode = f"{mode} (blocking stager)"
        rows.append({"tensors": f"{run['tensors']:,}", "mib": run["bytes"] / h.MIB, "mode": mode,
                     "first": blocked[0] if blocked else None, "steady": steady,
                     "x_floor": steady / floor_ms if steady is not None and floor_ms else None,
                     "call": _steady(figures.get("call_ms")), "extra": _steady(figures.get("extra_ms")),
                     "wait": _steady(figures.get("wait_ms")), "error": figures.get("error")})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", default="16,2000,20000", help="comma list of tensor counts, one subprocess each")
    p.add_argument("--gib", type=float, default=1.0, help="params + Adam's two moments, GiB")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run without a GPU")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "gpu_save.json"))
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.child is not None:
        h.emit_result(child(args.child, args.gib, args.saves, args.device, modes))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; --device cpu runs the smoke test")
    runs: list[dict[str, Any]] = []
    for count in [int(n) for n in args.tensors.split(",") if n]:
        run = h.run_child([os.path.abspath(__file__), "--child", str(count), "--gib", str(args.gib), "--saves",
                           str(args.saves), "--device", args.device, "--modes", ",".join(modes)],
                          sample_ms=1000)  # reading the child's smaps often slows what it times
        if run.get("status") == "error":  # a crashed child: the other counts still run
            run = {"tensors": count, "bytes": 0, "modes": {"-": {"error": run["error"]}}}
        runs.append(run)
        # after every child: what was measured survives a run cut short
        h.write_json(args.out, {"benchmark": "gpu_save", "args": vars(args), "machine": h.machine_info(), "rows": runs})
    print(f"device: {runs[0].get('device', '-')}; blocked time of one save, {args.saves} saves per mode")
    print(h.markdown_table([r for run in runs for r in table_rows(run)], COLUMNS))
    for run in runs:  # (restore: from memory and storage against the host-to-device floors)
        figures = run["modes"].get("restore", {})
        if "memory_ms" in figures:
            print(f"{run['tensors']:,} tensors, restore p50 ms: " + ", ".join(
                f"{k[:-3]} {h.median(figures[k]):.1f}" for k in ("memory_ms", "storage_ms", "floor_ms", "floor_one_ms"))
                + f"; sources {sorted(set(figures['source']))}")
    for run in runs:  # (pin_parts: the memory of a first save, part by part)
        if "parts_ms" in run["modes"].get("pin_parts", {}):
            parts = run["modes"]["pin_parts"]["parts_ms"]
            print(f"{run['tensors']:,} tensors, first-save memory parts: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    if any("error" in f for run in runs for f in run["modes"].values()):
        raise SystemExit("some modes failed: see the error column and " + args.out)


if __name__ == "__main__":
    main()
