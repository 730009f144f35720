"""Shared pieces of the benchmarks: the workload, the physical floor, memory sampling, output.

Every script in ``bench/`` measures against the same things, so they live here once:

- ``Workload``: a deterministic stack of ``nn.Linear`` layers with Adam, sized so that
  parameters + the two Adam moments come to ``gib`` GiB, and a fixed synthetic batch.
  ``train_step`` is forward, backward, ``optimizer.step()``; ``fresh_workload`` is the same
  model before its first step (a started or restarted trainer's, Adam without moments).
- ``ShmFloor``: the physical floor of a snapshot, a bare ``copy_`` of every state tensor
  into shared memory that was allocated and touched (zero-filled) once, before timing.
- ``run_child`` / ``MemorySampler``: a benchmark case runs in a fresh subprocess (so memory
  peaks and leftover threads of one case never leak into the next); the parent samples the
  child's process tree every ``sample_ms`` and collects the child's one JSON result line.
  Sampling from the parent keeps the sampler off the measured process's GIL.
- ``TreeCpu``: the CPU of process trees a benchmark starts and kills itself (orphans included),
  and other processes' share meanwhile.
- ``kept_in_memory`` / ``remove_kept_in_memory``: the snapshots mpckpt keeps in /dev/shm
  (``keep_in_memory``) for a benchmark's own roots, removed without touching anyone else's.
- ``markdown_table`` / ``write_json`` / ``machine_info``: what every script prints and keeps.

Memory is reported as the peak over samples of the summed PSS of the process tree (each
shared-memory page counted once, split among the processes that map it), next to the peak
of summed USS plus the growth of /dev/shm. USS alone misses pages shared between the
trainer and its uploaders; USS + /dev/shm counts twice the shared memory that only one
process maps (the floor, DCP's thread executor). PSS has neither problem, so it is the
headline figure; the other is in the JSON.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch import nn

GIB = 1 << 30
MIB = 1 << 20
RESULT_PREFIX = "BENCH-RESULT "
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


# -- workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model, its Adam optimizer and one fixed batch: everything a training step touches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    layers: int
    hidden: int

    @property
    def state(self) -> dict[str, Any]:
        """What a checkpointer is given: the objects themselves (``state_dict()`` is theirs to call)."""
        return {"model": self.model, "optim": self.optimizer}


def layers_for(gib: float, hidden: int) -> int:
    """Layers of ``hidden x hidden`` so that params + 2 Adam moments (fp32) come to ``gib`` GiB."""
    per_layer = (hidden * hidden + hidden) * 4 * 3
    return max(1, round(gib * GIB / per_layer))


def build_workload(gib: float, *, hidden: int = 2048, batch: int = 16, seed: int = 0) -> Workload:
    """The deterministic model of ``gib`` GiB of checkpoint state, with one warm-up step taken.

    The warm-up step creates Adam's moments, so the state has its final size before any
    timing starts (the same for every mode).
    """
    work = fresh_workload(gib, hidden=hidden, batch=batch, seed=seed)
    train_step(work)
    return work


def fresh_workload(gib: float, *, hidden: int = 2048, batch: int = 16, seed: int = 0) -> Workload:
    """``build_workload``'s model before any step: Adam without moments yet, as a trainer has
    just after it starts (or restarts, before its restore fills them in)."""
    torch.manual_seed(seed)
    layers = layers_for(gib, hidden)
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(hidden, hidden))
        if i < layers - 1:
            blocks.append(nn.ReLU())
    model = nn.Sequential(*blocks)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # keep activations bounded through a deep stack
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    inputs = torch.randn(batch, hidden)
    targets = torch.randn(batch, hidden)
    return Workload(model, optimizer, inputs, targets, layers, hidden)


def train_step(work: Workload) -> float:
    """One training step: forward, backward, optimizer step. Returns the loss."""
    work.optimizer.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(work.model(work.inputs), work.targets)
    loss.backward()
    work.optimizer.step()
    return float(loss.detach())


def state_tensors(work: Workload) -> list[torch.Tensor]:
    """Every tensor a checkpoint of the workload holds: model state dict + optimizer state."""
    tensors = list(work.model.state_dict().values())
    for per_param in work.optimizer.state.values():
        tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return tensors


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- snapshots kept in memory (``keep_in_memory``) -------------------------------------------
def kept_in_memory(root: str, rank: int = 0) -> bool:
    """Whether a complete snapshot of local ``root`` (and ``rank``) is kept in this node's /dev/shm."""
    from mpckpt._keep.store import base_name, record_names

    return bool(record_names(base_name(os.path.abspath(root), rank)))


def remove_kept_in_memory(roots: Iterable[str], ranks: Iterable[int] = (0,)) -> list[str]:
    """Remove the snapshots kept in memory for local ``roots`` that no live process keeps; return
    their base names. Only these roots' (``mpckpt gc`` would also remove other people's)."""
    from mpckpt._keep.store import base_name, list_kept, remove_kept

    wanted = {base_name(os.path.abspath(root), rank) for root in roots for rank in ranks}
    return [k.base for k in list_kept() if k.base in wanted and remove_kept(k.base)]


# -- the physical floor ------------------------------------------------------------------------
class ShmFloor:
    """Preallocated, pre-touched shared memory with one typed view per source tensor.

    ``copy()`` is the least any snapshot into shared memory can cost: one ``copy_`` per
    tensor into pages that already exist, with no bookkeeping at all.
    """

    ALIGN = 64

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.sources = list(tensors)
        offsets, total = [], 0
        for t in self.sources:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        self.buffer = torch.empty(max(total, self.ALIGN), dtype=torch.uint8).share_memory_()
        self.buffer.zero_()  # touch every page once, before timing
        self.views = [
            self.buffer[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for off, t in zip(offsets, self.sources, strict=True)
        ]
        self.nbytes = total

    def copy(self) -> float:
        """Copy every tensor in; return the milliseconds it took."""
        started = time.perf_counter()
        for dst, src in zip(self.views, self.sources, strict=True):
            dst.copy_(src)
        return (time.perf_counter() - started) * 1e3


# -- memory sampling ---------------------------------------------------------------------------
def shm_used_bytes() -> int:
    return shutil.disk_usage("/dev/shm").used


def shm_free_bytes() -> int:
    return shutil.disk_usage("/dev/shm").free


def memory_available_bytes() -> int:
    """MemAvailable of /proc/meminfo: what can be allocated without swapping (psutil reads it)."""
    return int(psutil.virtual_memory().available)


class MemorySampler:
    """Samples a process tree every ``interval_s``: peak summed PSS, and peak USS + /dev/shm growth."""

    def __init__(self, pid: int, *, interval_s: float = 0.02) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.shm_base = shm_used_bytes()
        self.peak_pss = 0
        self.peak_uss_shm = 0
        self.peak_shm_delta = 0
        self.peak_processes = 0
        self.samples = 0
        self.cpu_s: dict[int, float] = {}  # CPU seconds last seen of every process of the tree
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        pss = uss = 0
        for proc in procs:
            try:
                info = proc.memory_full_info()
                pss += getattr(info, "pss", info.rss)
                uss += getattr(info, "uss", info.rss)
                t = proc.cpu_times()
                self.cpu_s[proc.pid] = t.user + t.system
            except psutil.Error:
                continue  # a process that just exited
        shm_delta = max(0, shm_used_bytes() - self.shm_base)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_uss_shm = max(self.peak_uss_shm, uss + shm_delta)
        self.peak_shm_delta = max(self.peak_shm_delta, shm_delta)
        self.peak_processes = max(self.peak_processes, len(procs))
        self.samples += 1

    @property
    def tree_cpu_s(self) -> float:
        """CPU seconds of the whole process tree, grandchildren (a fork server's) included."""
        return sum(self.cpu_s.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_mib": round(self.peak_pss / MIB, 1),
            "peak_uss_plus_shm_mib": round(self.peak_uss_shm / MIB, 1),
            "peak_shm_delta_mib": round(self.peak_shm_delta / MIB, 1),
            "peak_processes": self.peak_processes,
            "memory_samples": self.samples,
        }


# -- child processes ---------------------------------------------------------------------------
def warm_page_cache(folder: str, *, chunk: int = 64 << 20) -> None:
    """Read every file under ``folder`` once (untimed), so that timed reads find it in the page cache."""
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(chunk):
                    pass


def read_files_into(paths: Sequence[str], buffer: memoryview | Sequence[memoryview], *, threads: int,
                    chunk: int = 64 << 20) -> float:
    """Read ``paths`` one after another into ``buffer`` (at least their total size; several buffers
    are filled one after another) with ``chunk``-byte ``preadv`` calls on ``threads`` threads: the
    read floor. Returns the seconds the reads took."""
    import concurrent.futures

    buffers = [buffer] if isinstance(buffer, memoryview) else list(buffer)
    jobs: list[tuple[str, int, memoryview]] = []
    index, used = 0, 0  # the buffer being filled, and how much of it is
    for path in paths:
        size, start = os.path.getsize(path), 0
        while start < size:
            while len(buffers[index]) == used:
                index, used = index + 1, 0
            n = min(chunk, size - start, len(buffers[index]) - used)
            jobs.append((path, start, buffers[index][used:used + n]))
            start, used = start + n, used + n

    def read(job: tuple[str, int, memoryview]) -> None:
        path, start, view = job
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            while pos < len(view):
                pos += os.preadv(fd, [view[pos:]], start + pos)
        finally:
            os.close(fd)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    return time.perf_counter() - started


def emit_result(result: dict[str, Any]) -> None:
    """Called in a child: hand one JSON result to the parent on stdout."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_each(script: str, items: Sequence[str], child_args: list[str], *, label: str, repeats: int = 1,
             pythonpath: str | None = None, sample_ms: float = 1000) -> list[dict[str, Any]]:
    """``script --child ITEM *child_args`` in a fresh process for each item, ``repeats`` times over
    (with ``pythonpath``: the children import that checkout's mpckpt); their results, in order."""
    if pythonpath:
        os.environ["PYTHONPATH"] = os.path.abspath(pythonpath)
    name = os.path.splitext(os.path.basename(script))[0]
    rows = []
    for _ in range(repeats):
        for item in items:
            print(f"[{name}] {label}: {item} ...", file=sys.stderr, flush=True)
            run = run_child([os.path.abspath(script), "--child", item, *child_args], sample_ms=sample_ms)
            if run.get("status") == "error":
                raise SystemExit(f"child for {item} failed: {run['error']}")
            rows.append(run)
    return rows


def run_child(argv: list[str], *, sample_ms: float = 20, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``python argv`` in a fresh process, sample its memory, return its result + memory peaks.

    Also returns ``foreign_cpu_pct``: the CPU time other processes on the machine used while
    the child ran, in % of all cores (a shared machine makes figures noisy; this says how much).
    The child's other output (warnings, progress) passes through to stderr.
    """
    sync_disk()
    busy0, own0, self0, wall0 = _busy_cpu_s(), _own_cpu_s(), _self_cpu_s(), time.monotonic()
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, cwd=REPO_DIR)
    result: dict[str, Any] | None = None
    with MemorySampler(proc.pid, interval_s=sample_ms / 1e3) as sampler:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
            else:
                sys.stderr.write(line)
        rc = proc.wait(timeout=timeout_s)
    wall = time.monotonic() - wall0
    # the child's tree is counted from sampling: processes started by a fork server are not
    # waited-for children, so rusage alone would call the child's own uploaders "foreign"
    own = max(_own_cpu_s() - own0, _self_cpu_s() - self0 + sampler.tree_cpu_s)
    foreign = max(0.0, (_busy_cpu_s() - busy0) - own)
    if rc != 0 or result is None:
        return {"status": "error", "error": f"child {' '.join(argv[1:3])} exited with {rc} and no result"}
    result.update(sampler.as_dict())
    result["foreign_cpu_pct"] = round(100 * foreign / wall / (os.cpu_count() or 1), 1)
    return result


class TreeCpu:
    """CPU seconds of every process of the trees under the pids ``watch``ed, orphans (a killed
    trainer's uploaders) included, sampled every ``interval_s``; and the machine's, to tell how
    much CPU other processes used meanwhile (``foreign_pct``). For benchmarks that start, kill
    and restart processes themselves, where ``run_child``'s accounting does not fit."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.roots: list[int] = []
        self.procs: dict[int, psutil.Process] = {}
        self.cpu_s: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.interval_s = interval_s

    def watch(self, pid: int) -> None:
        self.roots.append(pid)

    def __enter__(self) -> TreeCpu:
        self.busy0, self.wall0 = _busy_cpu_s(), time.monotonic()
        self.self0 = _self_cpu_s()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        for pid in list(self.roots):
            try:
                for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    self.procs.setdefault(p.pid, p)
            except psutil.Error:
                continue
        for pid, p in list(self.procs.items()):
            try:
                t = p.cpu_times()
                self.cpu_s[pid] = t.user + t.system
            except psutil.Error:
                continue  # ended: its last sample stands

    def foreign_pct(self) -> float:
        """Other processes' CPU while it ran, in % of all cores."""
        wall = time.monotonic() - self.wall0
        own = sum(self.cpu_s.values()) + _self_cpu_s() - self.self0
        return round(max(0.0, 100 * ((_busy_cpu_s() - self.busy0) - own) / wall / (os.cpu_count() or 1)), 1)


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, everything but idle and iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _self_cpu_s() -> float:
    """CPU seconds of this (the driver) process alone."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its waited-for children (the benchmark itself)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def wait_for_quiet(max_wait_s: float, *, busy_pct: float = 15.0) -> float:
    """Wait (at most ``max_wait_s``) until other processes use under ``busy_pct`` % of the CPUs.

    Returns the busy % last seen. On a shared machine this keeps other people's jobs out of
    the figures as far as possible; ``foreign_cpu_pct`` says how far that worked.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        seen = psutil.cpu_percent(interval=1.0)
        if seen < busy_pct or time.monotonic() >= deadline:
            return seen

def sync_disk() -> None:
    """Flush dirty pages of earlier cases so their writeback does not slow the next one."""
    if hasattr(os, "sync"):
        os.sync()


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


# -- figures and output ------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile, linearly interpolated (``statistics.quantiles``' inclusive method)."""
    if not values:
        return math.nan
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line ``y = slope * x + intercept``; returns (slope, intercept)."""
    n = len(xs)
    if n < 2:
        return math.nan, math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else math.nan
    return slope, my - slope * mx


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, int]]) -> str:
    """``columns``: (key, header, digits). Missing values print as '-'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k), d) for k, _, d in columns) + " |")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    disk = shutil.disk_usage(REPO_DIR)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "shm_gib": round(shutil.disk_usage("/dev/shm").total / GIB, 1),
        "disk_gib": round(disk.total / GIB),
        "filesystem": _filesystem(REPO_DIR),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _filesystem(path: str) -> str:
    best = None
    for part in psutil.disk_partitions(all=True):
        if path.startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    return f"{best.fstype} on {best.device}" if best else "unknown"


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def target_dir(requested: str | None, prefix: str) -> tuple[str, bool]:
    """The folder to write into and whether to remove it afterwards.

    Default: a fresh folder under ``bench/results/`` (same disk as the repository, gitignored).
    """
    if requested:
        os.makedirs(requested, exist_ok=True)
        return requested, False
    import tempfile

    os.makedirs(RESULTS_DIR, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=RESULTS_DIR), True
