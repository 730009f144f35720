"""Recovery after a node loss with ``peer_copies``: restore from a peer's memory against storage,
what replication costs a training loop, and what a copy moves.

Two simulated nodes x 1 rank (``harness/nodes.py``: each node its own hostname and ``/dev/shm``,
loopback between them), a gloo group on CPU. Each rank trains the house workload (``_harness``:
``nn.Linear`` layers with Adam, ``--gib`` GiB with the moments) and saves it as its own
(``{"model": PerRank(model), "optim": PerRank(optim)}``): every rank's snapshot is ``--gib`` GiB,
as each rank's shards are in a sharded (FSDP) job. The ranks step in lockstep (one tiny
all_reduce per step), without gradient traffic. ``memory_budget`` is ``--budget-x`` (4.4) times the
state: three slabs and a copy (docs/benchmarks.md, "Node loss", says why not 2 + peer_copies), and each
node's /dev/shm has room besides. ``--state replicated`` saves the model and
optimizer as plain replicated state instead (DDP-like): each replicated tensor is written by one
rank, so each rank's snapshot is about ``--gib / 2`` GiB and a restore reads the rest from the
other rank's snapshot.

(1) ``recovery``: phase 1 launches the job on both nodes, trains and saves ``--steps`` steps,
    waiting for each save's future (the copy to the other node is then in place, or the commit
    is); node 1 is lost (its processes and /dev/shm), the job killed, node 1 replaced by a fresh
    node; phase 2 relaunches the job, which restores into a fresh model and takes one step.
    Cases, ``--reps`` each, interleaved, a fresh cluster and root each time:

    - ``peer``: ``peer_copies=1``, ``mode="memory"`` saves: rank 1 restores from node 0's memory;
    - ``disk``: ``peer_copies=0``, async saves to a local-disk root (warm page cache): storage;
    - ``s3``: ``peer_copies=0``, async saves to moto's S3 server on 127.0.0.1: storage.

    Reported for rank 1 (the replaced node) and rank 0 (the surviving one): ``last_restore``'s
    seconds, source and bytes, ``Checkpointer`` open seconds, and the time from the launch call
    (torchrun started on both nodes) to the end of the first training step after the restore.

(2) ``loop``: one launch per configuration (no node loss): ``--loop-steps`` iterations of a
    training step and a save every step, without waiting on the futures: ``none`` (no save),
    ``mode="memory"`` and async storage saves (local disk), each with ``peer_copies`` 0 and 1;
    and ``mode="memory"`` with ``peer_copies=1`` every ``--sparse-every`` steps. Reported: the
    median and mean iteration time (training step + the ``save`` call; the first 2 iterations
    left out), the median ``save`` call and ``blocked_ms``, and the fraction of saves whose copy
    got through (``peer_copies``; the loop's last save is waited for, so it always does).

(3) ``floor``: the same bytes as one snapshot sent by each rank to the other at once (as the
    2-node ring does) over the job's gloo group in 32 MiB pieces, plain ``isend``/``irecv``:
    the transport's floor for a copy, against the copies of (1)'s phase 1 (save returned to
    future resolved, waited on at once, so at full speed).

    .venv/bin/python bench/peer_recovery.py --gib 1 --reps 3                        # as root
    .venv/bin/python bench/peer_recovery.py --gib 0.05 --reps 1 --parts recovery   # a quick look

Needs root (mount + UTS namespaces, ``harness.nodes``) and moto (``scripts/setup.sh --test``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

STARTED = time.time()  # this process's start (a worker's: right after Python started)
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)

CASES = ("peer", "disk", "s3")
LOOP_CONFIGS = (("none", 0, 1), ("memory", 0, 1), ("memory", 1, 1), ("async", 0, 1), ("async", 1, 1),
                ("memory", 1, 0))  # (save, peer_copies, every: 0 = --sparse-every)
JOB_TIMEOUT_S = 600.0
CHUNK = 32 << 20
GIB = 1 << 30
MIB = 1 << 20
LABELS = {"peer": "peer_copies=1, `mode=\"memory\"` saves", "disk": "storage: local disk (warm page cache)",
          "s3": "storage: S3 (moto on 127.0.0.1)"}


# -- the workers (one rank each, under torchrun on a simulated node) ------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    imported = time.time()
    import _harness as h

    import mpckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    grouped = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker == "floor":
        return floor(args, rank, world, out)
    fresh = args.worker == "restore"
    work = (h.fresh_workload if fresh else h.build_workload)(args.gib, hidden=args.hidden, batch=args.batch)
    if not fresh:  # every rank its own weights (as every shard of a sharded job differs)
        with torch.no_grad():
            for p in work.model.parameters():
                p.add_(rank * 1e-3)
    state: dict[str, Any] = ({"model": work.model, "optim": work.optimizer} if args.state == "replicated"
                             else {"model": mpckpt.PerRank(work.model), "optim": mpckpt.PerRank(work.optimizer)})
    state_bytes = h.state_bytes(h.state_tensors(work)) if not fresh else None
    built = time.time()

    def lockstep() -> None:
        dist.all_reduce(torch.zeros(1))

    options = json.loads(args.storage_options) if args.storage_options else None
    ckpt = None
    if args.save != "none":
        ckpt = mpckpt.Checkpointer(args.root, peer_copies=args.copies, keep_in_memory=True, keep_last=2,
                                   memory_budget=args.budget, storage_options=options, timeout_s=120)
    opened = time.time()
    doc: dict[str, Any] = {"rank": rank, "world": world, "state_bytes": state_bytes, "started": STARTED,
                           "imported": imported, "grouped": grouped, "built": built, "opened": opened}
    if args.worker == "train":
        saves = []
        for step in range(1, args.steps + 1):
            h.train_step(work)
            lockstep()
            t0 = time.perf_counter()
            future = ckpt.save(step, state, mode=args.save)
            returned = time.perf_counter()
            future.result(timeout=300)
            resolved = time.perf_counter()
            if args.save != "memory":
                ckpt.wait(300)  # an async save's copy may land after its commit
            waited = time.perf_counter()
            saves.append({"step": step, "call_s": returned - t0, "resolve_s": resolved - returned,
                          "wait_s": waited - returned, **future.stats.as_dict()})
        doc["saves"] = saves
        (out / f"train-r{rank}.json").write_text(json.dumps(doc))
        while True:  # the bench loses a node and kills the job, as a crash would
            time.sleep(1)
    elif args.worker == "restore":
        remote = trace_remote_reads()
        step = ckpt.restore(state)
        restored = time.time()
        last = ckpt.last_restore
        h.train_step(work)
        stepped = time.time()
        doc.update(step=step, restored=restored, stepped=stepped, remote=remote.summary(),
                   source=None if last is None else last.source, seconds=None if last is None else last.seconds,
                   bytes=None if last is None else last.bytes)
        (out / f"restored-r{rank}.json").write_text(json.dumps(doc))
        lockstep()
        ckpt.close()
    elif args.worker == "loop":
        futures, iters, trains = [], [], []
        for step in range(1, args.loop_steps + 1):
            t0 = time.perf_counter()
            h.train_step(work)
            lockstep()
            t1 = time.perf_counter()
            if ckpt is not None and step % args.every == 0:
                futures.append(ckpt.save(step, state, mode=args.save))
            t2 = time.perf_counter()
            iters.append(t2 - t0)
            trains.append(t1 - t0)
        loop_end = time.perf_counter()
        if ckpt is not None:
            ckpt.wait(300)
            for f in futures:
                f.result(timeout=300)
        drained = time.perf_counter()
        doc.update(iter_s=iters, train_s=trains, drain_s=drained - loop_end,
                   saves=[f.stats.as_dict() for f in futures])
        (out / f"loop-r{rank}.json").write_text(json.dumps(doc))
        if ckpt is not None:
            ckpt.close()
    dist.destroy_process_group()


class RemoteReads:
    """Calls of mpckpt's reads from another node's memory during a restore: count, bytes, summed seconds
    (over the reader threads), and the span from the first call's start to the last one's end."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.calls, self.bytes, self.seconds = 0, 0, 0.0
        self.first: float | None = None
        self.last = 0.0

    def add(self, started: float, ended: float, nbytes: int) -> None:
        with self.lock:
            self.calls += 1
            self.bytes += nbytes
            self.seconds += ended - started
            self.first = started if self.first is None else min(self.first, started)
            self.last = max(self.last, ended)

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes, "summed_s": self.seconds,
                "span_s": self.last - self.first if self.first is not None else 0.0}


def trace_remote_reads() -> RemoteReads:
    """Time ``read_remote`` as the restore calls it (the bench's wrapper; the library is unchanged)."""
    from mpckpt._peer import inventory

    seen, real = RemoteReads(), inventory.read_remote

    def timed(link: Any, holder: int, number: int, offset: int, out: memoryview) -> None:
        t0 = time.perf_counter()
        real(link, holder, number, offset, out)
        seen.add(t0, time.perf_counter(), len(out))

    inventory.read_remote = timed
    return seen


def floor(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    """Each rank sends ``--floor-bytes`` to the next and receives as many from the previous, at once."""
    import torch
    import torch.distributed as dist

    n = args.floor_bytes
    send, recv = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    recv.zero_()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    runs = []
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            ops = [dist.P2POp(dist.isend, send[start:start + CHUNK], nxt),
                   dist.P2POp(dist.irecv, recv[start:start + CHUNK], prv)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        runs.append(time.perf_counter() - t0)
    (out / f"floor-r{rank}.json").write_text(json.dumps({"rank": rank, "bytes": n, "runs_s": runs}))
    dist.destroy_process_group()


# -- the bench's side ---------------------------------------------------------------------------
def worker_args(args: argparse.Namespace, scenario: str, root: str, out: Path, *, save: str, copies: int,
                options: dict[str, Any] | None, every: int = 1) -> list[str]:
    argv = ["--worker", scenario, "--root", root, "--out", str(out), "--gib", str(args.gib), "--hidden",
            str(args.hidden), "--batch", str(args.batch), "--state", args.state, "--save", save, "--copies",
            str(copies), "--budget", str(budget_bytes(args)), "--steps", str(args.steps), "--loop-steps",
            str(args.loop_steps), "--reps", str(args.reps), "--every", str(every)]
    if options:
        argv += ["--storage-options", json.dumps(options)]
    return argv


def budget_bytes(args: argparse.Namespace) -> int:
    """``--budget-x`` times the state (the library's advice: about (2 + peer_copies) times the state)."""
    return int(args.budget_x * args.gib * GIB) + 64 * MIB


def shm_size(args: argparse.Namespace) -> str:
    """Each node's /dev/shm (a tmpfs: a cap, not an allocation). Room for what a relaunch finds there (the
    kept snapshot, the copy of the other rank's, the killed process's spare slab) besides the budget: the
    budget is fitted to the free space at open, and a copy that no longer fits it is dropped."""
    return f"{math.ceil((args.budget_x + 4) * args.gib * 1024) + 512}m"


def wait_files(job: Any, cluster: Any, paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if any(a.poll() is not None for a in job.agents) or time.monotonic() > deadline:
            logs = job.logs(tail=4000)
            job.kill()
            raise RuntimeError(f"waiting for {[p.name for p in paths]}: an agent ended or {timeout_s:.0f} s "
                               f"passed; logs:\n{logs}")
        time.sleep(0.05)


def run_job(job: Any, timeout_s: float) -> None:
    codes = job.wait(timeout_s)
    if codes != [0] * len(codes):
        raise RuntimeError(f"the job ended with {codes}; logs:\n{job.logs(tail=6000)}")


def peer_copy_extent(node: Any, rank: int) -> int | None:
    """Bytes of the copy of ``rank``'s snapshot published on ``node`` (its files' extent), if any."""
    from mpckpt._keep.record import KeptRecord

    names = [n for n in node.shm_listing() if n.startswith("mpckpt-peer-") and n.endswith(".record")
             and n.split(".")[0].endswith(f"-r{rank}")]
    if not names:
        return None
    records = [KeptRecord.from_bytes(node.shm_path(n).read_bytes(), path=n) for n in names]
    record = max(records, key=lambda r: r.step)
    return max((s.offset + s.nbytes for s in record.spans.values()), default=0)


def recovery_rep(args: argparse.Namespace, case: str, work: str, endpoint: str | None,
                 cpu: Any) -> dict[str, Any]:
    from harness.nodes import Cluster
    from harness.servers import free_port, s3_options

    tag = f"{case}-{uuid.uuid4().hex[:8]}"
    out, logs = Path(work) / tag / "out", Path(work) / tag / "logs"
    if case == "s3":
        assert endpoint is not None
        root, options = f"s3://bench-{uuid.uuid4().hex[:12]}/run", {**s3_options(endpoint), "create": True}
    else:
        root, options = os.path.join(work, tag, "root"), None
    save, copies = ("memory", 1) if case == "peer" else ("async", 0)
    common = dict(save=save, copies=copies, options=options)
    port = free_port()  # both launches: the relaunch is the same job (an object store's writer lease is the job's)
    with Cluster(2, shm_size=shm_size(args), name_prefix="prb") as cluster:
        job = cluster.launch(__file__, worker_args(args, "train", root, out, **common), log_dir=logs,
                             master_port=port)
        for pid in (a.pid for a in job.agents):
            cpu.watch(pid)
        wait_files(job, cluster, [out / f"train-r{r}.json" for r in range(2)], JOB_TIMEOUT_S)
        trained = [json.loads((out / f"train-r{r}.json").read_text()) for r in range(2)]
        extent = peer_copy_extent(cluster.nodes[0], 1) if copies else None
        cluster.nodes[1].lose()
        job.kill()
        fresh = cluster.replace(1)
        assert fresh.shm_listing() == [], fresh.shm_listing()
        launched = time.time()
        job = cluster.launch(__file__, worker_args(args, "restore", root, out, **common), log_dir=logs,
                             master_port=port)
        for pid in (a.pid for a in job.agents):
            cpu.watch(pid)
        run_job(job, JOB_TIMEOUT_S)
        restored = [json.loads((out / f"restored-r{r}.json").read_text()) for r in range(2)]
    if any(doc["step"] is None for doc in restored):  # nothing restored: keep the logs to look at
        raise RuntimeError(f"{case}: a rank restored nothing ({restored}); logs in {logs}")
    shutil.rmtree(Path(work) / tag, ignore_errors=True)
    if case == "s3":  # moto holds what it stores: empty the bucket for the next repetition
        import s3fs

        fs = s3fs.S3FileSystem(**s3_options(endpoint), skip_instance_cache=True)
        fs.rm(root.removeprefix("s3://").split("/")[0], recursive=True)
    row: dict[str, Any] = {"case": case, "copy_extent": extent, "saves": [t["saves"] for t in trained],
                           "state_bytes": trained[0]["state_bytes"]}
    for r, doc in enumerate(restored):
        row[f"r{r}"] = {"step": doc["step"], "source": doc["source"], "seconds": doc["seconds"], "bytes": doc["bytes"],
                        "start_s": doc["built"] - launched, "python_s": doc["started"] - launched,
                        "open_s": doc["opened"] - doc["built"], "restore_wall_s": doc["restored"] - doc["opened"],
                        "first_step_s": doc["stepped"] - doc["restored"], "to_first_step_s": doc["stepped"] - launched,
                        "remote": doc["remote"]}
    return row


def start_moto(work: str) -> tuple[subprocess.Popen, str]:
    from harness.servers import free_port

    port = free_port()
    log = open(os.path.join(work, "moto.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=work)
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto did not listen within 60 s")


def recovery_part(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import _harness as h

    from harness.servers import stop_server

    cases = [c for c in args.cases.split(",") if c]
    moto, endpoint = start_moto(work) if "s3" in cases else (None, None)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    foreign: dict[str, list[float]] = {c: [] for c in cases}
    try:
        for rep in range(args.reps):
            for case in cases:
                h.wait_for_quiet(args.wait_quiet_s)
                print(f"[peer_recovery] recovery {case} ({rep + 1}/{args.reps}) ...", file=sys.stderr, flush=True)
                with h.TreeCpu() as cpu:
                    if moto is not None:
                        cpu.watch(moto.pid)
                    row = recovery_rep(args, case, work, endpoint, cpu)
                foreign[case].append(cpu.foreign_pct())
                row["foreign_cpu_pct"] = foreign[case][-1]
                runs[case].append(row)
                r1, r0 = row["r1"], row["r0"]
                print(f"  rank 1: {r1['source']} step {r1['step']} restore {r1['seconds']:.3f} s, launch to first step "
                      f"{r1['to_first_step_s']:.2f} s; rank 0: {r0['source']} {r0['seconds']:.3f} s; other procs CPU "
                      f"{row['foreign_cpu_pct']}%", file=sys.stderr, flush=True)
    finally:
        if moto is not None:
            stop_server(moto)
    rows = []
    for case in cases:
        rs = runs[case]
        med = {k: h.median([r["r1"][k] for r in rs]) for k in ("seconds", "to_first_step_s", "python_s", "start_s",
                                                                "open_s", "restore_wall_s", "first_step_s")}
        rows.append({"case": case, "what": LABELS[case], "r1_restore_s": med["seconds"],
                     "r1_to_first_step_s": med["to_first_step_s"], "r1_python_s": med["python_s"],
                     "r1_start_s": med["start_s"], "r1_open_s": med["open_s"], "r1_first_step_s": med["first_step_s"],
                     "r1_runs": ", ".join(f"{r['r1']['seconds']:.2f}" for r in rs),
                     "r1_source": ",".join(sorted({r["r1"]["source"] for r in rs})),
                     "r1_gib": h.median([r["r1"]["bytes"] for r in rs]) / GIB,
                     "r0_restore_s": h.median([r["r0"]["seconds"] for r in rs]),
                     "r0_source": ",".join(sorted({r["r0"]["source"] for r in rs})),
                     "steps": ",".join(sorted({str(r["r1"]["step"]) for r in rs})),
                     "foreign_cpu_pct": max(foreign[case])})
    return {"rows": rows, "runs": runs}


def loop_part(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import _harness as h

    from harness.nodes import Cluster

    rows, runs = [], []
    with Cluster(2, shm_size=shm_size(args), name_prefix="prl") as cluster:
        for save, copies, every in LOOP_CONFIGS:
            every = every or args.sparse_every
            h.wait_for_quiet(args.wait_quiet_s)
            print(f"[peer_recovery] loop save={save} peer_copies={copies} every {every} ...", file=sys.stderr,
                  flush=True)
            tag = f"loop-{save}-{copies}-{every}-{uuid.uuid4().hex[:6]}"
            out, root = Path(work) / tag / "out", os.path.join(work, tag, "root")
            with h.TreeCpu() as cpu:
                job = cluster.launch(__file__, worker_args(args, "loop", root, out, save=save, copies=copies,
                                                           options=None, every=every),
                                     log_dir=Path(work) / tag / "logs")
                for a in job.agents:
                    cpu.watch(a.pid)
                run_job(job, JOB_TIMEOUT_S)
            docs = [json.loads((out / f"loop-r{r}.json").read_text()) for r in range(2)]
            shutil.rmtree(Path(work) / tag, ignore_errors=True)
            iters = [x for d in docs for x in d["iter_s"][2:]]
            trains = [x for d in docs for x in d["train_s"][2:]]
            saves = [s for d in docs for s in d["saves"] if s["step"] > 2]
            row = {"save": save, "copies": copies, "every": every, "iter_ms": 1e3 * h.median(iters),
                   "iter_mean_ms": 1e3 * sum(iters) / len(iters),
                   "train_ms": 1e3 * h.median(trains), "save_call_ms": 1e3 * h.median(
                       [a - b for d in docs for k, (a, b) in enumerate(zip(d["iter_s"], d["train_s"], strict=True))
                        if k >= 2 and (k + 1) % every == 0]),
                   "blocked_ms": h.median([s["blocked_ms"] for s in saves]) if saves else None,
                   "copied": f"{sum(1 for s in saves if s['peer_copies'] >= 1)}/{len(saves)}" if copies else "-",
                   "statuses": ",".join(sorted({s["status"] for s in saves})) if saves else "-",
                   "drain_s": max(d["drain_s"] for d in docs), "foreign_cpu_pct": cpu.foreign_pct()}
            rows.append(row)
            runs.append({"save": save, "copies": copies, "docs": docs})
            print(f"  iteration {row['iter_ms']:.0f} ms (train {row['train_ms']:.0f}), blocked {row['blocked_ms']} ms, "
                  f"copied {row['copied']}, other procs CPU {row['foreign_cpu_pct']}%", file=sys.stderr, flush=True)
    base = rows[0]["iter_mean_ms"]
    for row in rows:
        row["x_none"] = row["iter_mean_ms"] / base
    return {"rows": rows, "runs": runs}


def floor_part(args: argparse.Namespace, work: str, nbytes: int) -> dict[str, Any]:
    import _harness as h

    from harness.nodes import Cluster

    h.wait_for_quiet(args.wait_quiet_s)
    print(f"[peer_recovery] gloo floor, {nbytes / MIB:.0f} MiB each way ...", file=sys.stderr, flush=True)
    out = Path(work) / "floor"
    argv = worker_args(args, "floor", "-", out, save="none", copies=0, options=None)
    argv += ["--floor-bytes", str(nbytes)]
    with Cluster(2, shm_size="256m", name_prefix="prf") as cluster, h.TreeCpu() as cpu:
        job = cluster.launch(__file__, argv, log_dir=Path(work) / "floor-logs")
        for a in job.agents:
            cpu.watch(a.pid)
        run_job(job, JOB_TIMEOUT_S)
    docs = [json.loads((out / f"floor-r{r}.json").read_text()) for r in range(2)]
    slowest = [max(a, b) for a, b in zip(docs[0]["runs_s"], docs[1]["runs_s"], strict=True)]
    return {"bytes": nbytes, "runs_s": slowest, "seconds": h.median(slowest),
            "gb_per_s": nbytes / 1e9 / h.median(slowest), "foreign_cpu_pct": cpu.foreign_pct()}


def copy_figures(recovery: dict[str, Any] | None) -> dict[str, Any] | None:
    """From the peer case's phase 1: bytes per copy and how fast the copies went (waited for at once)."""
    if not recovery or not recovery["runs"].get("peer"):
        return None
    import _harness as h

    resolve, calls, extents = [], [], []
    for run in recovery["runs"]["peer"]:
        if run["copy_extent"]:
            extents.append(run["copy_extent"])
        for saves in run["saves"]:
            for s in saves[1:]:  # the first save makes the slabs
                resolve.append(s["resolve_s"])
                calls.append(s["call_s"])
    extent = h.median(extents)
    return {"copy_bytes": extent, "state_bytes": recovery["runs"]["peer"][0]["state_bytes"],
            "resolve_s": h.median(resolve), "call_s": h.median(calls), "gb_per_s": extent / 1e9 / h.median(resolve),
            "gb_per_s_from_call": extent / 1e9 / (h.median(resolve) + h.median(calls))}


RECOVERY_COLUMNS = [("what", "case", 0), ("r1_source", "rank 1 source", 0), ("r1_restore_s", "rank 1 restore s", 3),
                    ("r1_runs", "runs s", 0), ("r1_to_first_step_s", "launch to first step s", 2),
                    ("r1_start_s", "launch to built s", 2), ("r1_open_s", "open s", 2),
                    ("r1_first_step_s", "first step s", 2), ("r1_gib", "read GiB", 2),
                    ("r0_source", "rank 0 source", 0), ("r0_restore_s", "rank 0 restore s", 3),
                    ("foreign_cpu_pct", "other procs CPU % (max)", 0)]
LOOP_COLUMNS = [("save", "save", 0), ("copies", "peer_copies", 0), ("every", "every", 0),
                ("iter_ms", "iteration ms (median)", 0), ("iter_mean_ms", "(mean)", 0), ("x_none", "mean x no save", 2), ("train_ms", "train step ms", 0), ("save_call_ms", "save call ms", 0),
                ("blocked_ms", "blocked_ms", 0), ("copied", "copies through", 0), ("statuses", "status", 0),
                ("drain_s", "drain s", 1), ("foreign_cpu_pct", "other procs CPU %", 0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default="recovery,loop,floor")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=3, help="saves of phase 1")
    parser.add_argument("--loop-steps", type=int, default=16)
    parser.add_argument("--sparse-every", type=int, default=4, help="the last loop row saves every N steps")
    parser.add_argument("--wait-quiet-s", type=float, default=120, help="wait (at most) for a quiet VM before each run")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--budget-x", type=float, default=4.4,
                        help="memory_budget in times the state (3 slabs and a copy: see the doc)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--state", choices=["per_rank", "replicated"], default="per_rank")
    parser.add_argument("--work", help="a folder for roots and logs (default: a fresh one under bench/results)")
    parser.add_argument("--json", default=os.path.join(REPO_DIR, "bench", "results", "peer_recovery.json"))
    # the workers'
    parser.add_argument("--worker", choices=["train", "restore", "loop", "floor"])
    parser.add_argument("--root")
    parser.add_argument("--out")
    parser.add_argument("--save", default="memory")
    parser.add_argument("--copies", type=int, default=0)
    parser.add_argument("--budget", type=int)
    parser.add_argument("--storage-options")
    parser.add_argument("--floor-bytes", type=int)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import _harness as h

    from harness.nodes import namespaces_unavailable

    why = namespaces_unavailable()
    if why:
        raise SystemExit(f"peer_recovery: {why}")
    work, remove = h.target_dir(args.work, "peer_recovery-")
    parts = [p for p in args.parts.split(",") if p]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_DIR).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "mpckpt"], capture_output=True, text=True,
                           cwd=REPO_DIR).stdout.split("\n")
    result: dict[str, Any] = {"command": " ".join(sys.argv), "gib": args.gib, "reps": args.reps, "state": args.state,
                              "commit": commit, "mpckpt_uncommitted": [d for d in dirty if d],
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": h.machine_info()}
    try:
        if "recovery" in parts:
            result["recovery"] = recovery_part(args, work)
            result["copy"] = copy_figures(result["recovery"])
        if "loop" in parts:
            result["loop"] = loop_part(args, work)
        if "floor" in parts:
            nbytes = (result.get("copy") or {}).get("copy_bytes") or int(args.gib * GIB)
            result["floor"] = floor_part(args, work, int(nbytes))
    finally:
        if remove:
            shutil.rmtree(work, ignore_errors=True)
    h.write_json(args.json, result)
    if "recovery" in result:
        print(f"\n(1) node 1 lost after {args.steps} saves, replaced, job relaunched; {args.gib:g} GiB per rank "
              f"({args.state}), medians of {args.reps}\n")
        print(h.markdown_table(result["recovery"]["rows"], RECOVERY_COLUMNS))
        by = {r["case"]: r for r in result["recovery"]["rows"]}
        if "peer" in by:
            for other in ("disk", "s3"):
                if other in by:
                    print(f"{other} / peer: restore x{by[other]['r1_restore_s'] / by['peer']['r1_restore_s']:.2f}, "
                          f"launch to first step x{by[other]['r1_to_first_step_s'] / by['peer']['r1_to_first_step_s']:.2f}")
    if result.get("copy"):
        c = result["copy"]
        print(f"\n(3) a copy: {c['copy_bytes'] / MIB:.1f} MiB (state {c['state_bytes'] / MIB:.1f} MiB); save returned "
              f"to copy in place {c['resolve_s']:.3f} s = {c['gb_per_s']:.2f} GB/s; save call {c['call_s']:.3f} s")
    if "floor" in result:
        f = result["floor"]
        print(f"    gloo floor, both ways at once: {f['seconds']:.3f} s = {f['gb_per_s']:.2f} GB/s "
              f"(runs {', '.join(f'{x:.3f}' for x in f['runs_s'])})")
    if "loop" in result:
        print(f"\n(2) {args.loop_steps} iterations (first 2 left out), both ranks pooled\n")
        print(h.markdown_table(result["loop"]["rows"], LOOP_COLUMNS))
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
