"""How the multi-rank commit scales with the number of ranks: latency and store requests per rank.

mpckpt commits a multi-rank checkpoint through the job's torch.distributed store
(``mpckpt._commit.ranked.StoreCoordinator``): every rank posts its part, rank 0 waits for all
parts, writes the global manifest and posts the outcome, every other rank waits for it. This
script runs that protocol, unchanged, for world sizes 2 .. 1024 simulated on one machine:

- one ``torch.distributed.TCPStore`` server (``is_master=True``, ``wait_for_workers=False``,
  127.0.0.1, the libuv server torchrun's agent also runs);
- one thread per simulated rank, each with its own TCPStore client (its own TCP connection,
  as a rank process has) under a ``PrefixStore`` private to the world size and the run token
  (as ``Checkpointer`` scopes it), wrapped in a counting proxy;
- per rank a small ``Manifest`` listing two files named with the rank prefix (its shard file
  and its skeleton); rank 0 writes the merged global manifest through a real local backend
  (``open_backend(spec_for_url(tmpdir))``: manifest fsync, rename, fsync of the root), into a
  staging folder made first with ``staging_name(name, run=token)`` + ``prepare_staging``.

``--steps`` consecutive steps per world size (all threads released together at each step).
Per step: the *commit latency* is the time from the moment the last rank's part was posted
(its ``set`` returned) to the moment the last rank had the outcome (its ``commit`` returned);
the *coordinator* time is from that same moment to rank 0's ``commit`` returning (merging the
parts, writing the manifest, posting the outcome); *woken* is from the coordinator's outcome
``set`` to the other ranks' ``wait`` returning; *CPU* is the thread CPU time of one rank's
``commit`` call (inflated here by the threads' contention for the GIL); *parse alone* is
what a rank does with the outcome it read (``json.loads`` + ``Manifest.from_summary``: the
outcome carries the manifest's summary, not its file list), timed afterwards in one thread
with nothing else running. The table gives the median over the steps
after the first, and the store requests per rank and step: the coordinator's and the
min..max over the other ranks (counted calls of set, get, wait, check, multi_get,
delete_key, add, compare_set), the bytes the coordinator's ``multi_get`` returned, and the
bytes of outcome the store sent to all ranks together (every rank gets the summary).

What it does not show: the network between hosts, and ranks that run in parallel. Every
client talks to the server over loopback, and the simulated ranks are threads of one process
sharing its GIL and the machine's 2 cores: the work each rank does around its requests runs
one rank after another here, so beyond a few dozen ranks the measured latency is mostly that
queue (about ranks x CPU per
rank), not the protocol. The request counts and the bytes are exact.

    .venv/bin/python bench/commit_scale.py --ranks 2,4,8,16,32,64,128,256,512,1024 --steps 4 \\
        --chart docs/bench_commit_scale.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import _harness as h
import torch.distributed as dist

from mpckpt._commit.ranked import StoreCoordinator
from mpckpt.format.manifest import FileEntry, Manifest, checksum
from mpckpt.format.names import checkpoint_name, rank_prefix, rank_skeleton_name
from mpckpt.storage import open_backend, spec_for_url

OPS = ("set", "get", "wait", "check", "multi_get", "delete_key", "add", "compare_set")
COLUMNS = [
    ("ranks", "ranks", 0), ("latency_ms", "commit latency ms (last post -> last outcome)", 1),
    ("coordinator_ms", "coordinator ms (last post -> manifest written, outcome posted)", 1),
    ("coordinator_told_ms", "last post -> outcome posted ms", 1),
    ("woken_p50_ms", "others woken p50 ms", 1), ("woken_max_ms", "others woken max ms", 1),
    ("parse_alone_ms", "outcome parse ms (alone)", 2), ("cpu_others_p50_ms", "other rank CPU ms p50 (threads)", 2),
    ("ops_coordinator", "store requests, coordinator", 0), ("ops_others", "store requests, other ranks", 0),
    ("multi_get_kib", "multi_get KiB", 1), ("manifest_kib", "manifest KiB", 1),
    ("outcome_mib_served", "outcome MiB the store sent (all ranks)", 1),
]


class CountingStore:
    """A rank's store: forwards every call, counts it, and notes when this rank's part was posted."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store, self._rank = store, rank
        self.counts = dict.fromkeys(OPS, 0)
        self.posted_at = self.waited_at = self.outcome_at = 0.0
        self.multi_get_bytes = self.get_bytes = 0

    def reset(self) -> None:
        self.counts = dict.fromkeys(OPS, 0)
        self.posted_at = self.waited_at = self.outcome_at = 0.0
        self.multi_get_bytes = self.get_bytes = 0

    def set(self, key: str, value: Any) -> None:
        self.counts["set"] += 1
        self._store.set(key, value)
        if key.endswith(f"/p{self._rank}"):
            self.posted_at = time.perf_counter()
        elif key.endswith("/outcome"):
            self.outcome_at = time.perf_counter()

    def get(self, key: str) -> bytes:
        self.counts["get"] += 1
        out = self._store.get(key)
        self.get_bytes += len(out)
        return out

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.counts["wait"] += 1
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)
        self.waited_at = time.perf_counter()

    def check(self, keys: list[str]) -> bool:
        self.counts["check"] += 1
        return self._store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.counts["multi_get"] += 1
        out = self._store.multi_get(keys)
        self.multi_get_bytes += sum(len(v) for v in out)
        return out

    def delete_key(self, key: str) -> bool:
        self.counts["delete_key"] += 1
        return self._store.delete_key(key)

    def add(self, key: str, amount: int) -> int:
        self.counts["add"] += 1
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.counts["compare_set"] += 1
        return self._store.compare_set(key, expected, desired)


def rank_manifest(step: int, rank: int, world: int) -> Manifest:
    """What a rank's committer hands the coordinator: its shard file and its skeleton."""
    shard = f"{rank_prefix(rank)}shard-00000.safetensors"
    files = {shard: FileEntry(64 << 20, checksum(f"{step}/{rank}/shard".encode())),
             rank_skeleton_name(rank): FileEntry(4096, checksum(f"{step}/{rank}/skeleton".encode()))}
    return Manifest(step=step, seq=step, kind="state", files=files, world_size=world)


def run_world(world: int, port: int, folder: str, steps: int, timeout_s: float) -> dict[str, Any]:
    """``steps`` commits with ``world`` simulated ranks; per-step figures."""
    backend = open_backend(spec_for_url(folder))
    token = os.urandom(8).hex()
    stores: list[CountingStore | None] = [None] * world
    posted: list[float] = [0.0] * world
    done: list[float] = [0.0] * world
    waited: list[float] = [0.0] * world
    cpu: list[float] = [0.0] * world
    errors: list[BaseException] = []
    start = threading.Barrier(world + 1)
    end = threading.Barrier(world + 1)
    staging: dict[str, str] = {}
    manifest_bytes: list[bytes] = []

    def rank_main(rank: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            store = CountingStore(dist.PrefixStore(f"ws{world}/mpckpt/{token}/", client), rank)
            stores[rank] = store
            coordinator = StoreCoordinator(backend, store, rank=rank, world_size=world, timeout_s=timeout_s)
        except BaseException as e:  # the barrier below still has to be met
            errors.append(e)
            coordinator = None
        for step in range(steps):
            start.wait()
            try:
                if coordinator is not None:
                    stores[rank].reset()  # type: ignore[union-attr]
                    part = rank_manifest(step, rank, world)
                    cpu0 = time.thread_time()
                    got = coordinator.commit(staging["path"], staging["name"], part)
                    done[rank] = time.perf_counter()
                    cpu[rank] = time.thread_time() - cpu0
                    posted[rank] = stores[rank].posted_at  # type: ignore[union-attr]
                    waited[rank] = stores[rank].waited_at  # type: ignore[union-attr]
                    if rank == 0:
                        manifest_bytes.append(got.to_bytes())
                    if rank == 0 and len(got.files) != 2 * world:
                        raise AssertionError(f"rank {rank}: the manifest lists {len(got.files)} files")
                    if rank > 0 and (got.complete or got.step != step):  # the others learn its summary
                        raise AssertionError(f"rank {rank}: the outcome is not the summary of step {step}")
            except BaseException as e:
                errors.append(e)
            end.wait()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    per_step = []
    for step in range(steps):
        name = checkpoint_name(step)
        staging["name"], staging["path"] = name, backend.staging_name(name, run=token)
        backend.prepare_staging(staging["path"])
        start.wait()
        end.wait()
        if errors:
            break
        last_post = max(posted)
        told = stores[0].outcome_at if stores[0] is not None else 0.0
        counts = [s.counts if s is not None else {} for s in stores]
        others = [sum(c.values()) for c in counts[1:]]
        per_step.append({
            "step": step, "latency_ms": (max(done) - last_post) * 1e3, "coordinator_ms": (done[0] - last_post) * 1e3,
            "post_spread_ms": (last_post - min(posted)) * 1e3,
            "coordinator_saw_parts_ms": (waited[0] - last_post) * 1e3,  # its wait for every part returned
            "coordinator_told_ms": (told - last_post) * 1e3,  # its outcome set returned
            # the other ranks: the coordinator's outcome posted -> their wait returned
            "woken_p50_ms": max(0.0, statistics.median(w - told for w in waited[1:])) * 1e3 if world > 1 else 0.0,
            "woken_max_ms": max(0.0, *(w - told for w in waited[1:])) * 1e3 if world > 1 else 0.0,
            # CPU time of one rank's commit call (its own process would have it on its own core)
            "cpu_coordinator_ms": cpu[0] * 1e3,
            "cpu_others_p50_ms": statistics.median(cpu[1:]) * 1e3 if world > 1 else 0.0,
            "ops_coordinator": sum(counts[0].values()), "ops_coordinator_by_call": counts[0],
            "ops_others_min": min(others), "ops_others_max": max(others),
            "ops_others_by_call": counts[1] if world > 1 else {},
            "multi_get_bytes": stores[0].multi_get_bytes if stores[0] is not None else 0,
            "manifest_bytes": len(manifest_bytes[-1]) if manifest_bytes else 0,
            "outcome_bytes_served": sum(s.get_bytes for s in stores if s is not None),
        })
    for t in threads:
        t.join(timeout=timeout_s)
    stores.clear()  # closes the clients' connections
    if errors:
        return {"ranks": world, "status": "error", "error": f"{type(errors[0]).__name__}: {errors[0]}",
                "steps": per_step}
    later = per_step[1:] or per_step
    parse_ms = parse_alone_ms(manifest_bytes[-1]) if manifest_bytes else None
    return {
        "ranks": world, "status": "ok", "steps": per_step,
        "latency_ms": statistics.median(s["latency_ms"] for s in later),
        "latency_max_ms": max(s["latency_ms"] for s in later),
        "coordinator_ms": statistics.median(s["coordinator_ms"] for s in later),
        "coordinator_told_ms": statistics.median(s["coordinator_told_ms"] for s in later),
        "parse_alone_ms": parse_ms,
        "woken_p50_ms": statistics.median(s["woken_p50_ms"] for s in later),
        "woken_max_ms": statistics.median(s["woken_max_ms"] for s in later),
        "cpu_coordinator_ms": statistics.median(s["cpu_coordinator_ms"] for s in later),
        "cpu_others_p50_ms": statistics.median(s["cpu_others_p50_ms"] for s in later),
        "ops_coordinator": _range([s["ops_coordinator"] for s in later]),
        "ops_others": _range([s["ops_others_min"] for s in later] + [s["ops_others_max"] for s in later]),
        "ops_coordinator_first": per_step[0]["ops_coordinator"],
        "multi_get_kib": later[-1]["multi_get_bytes"] / 1024, "manifest_kib": later[-1]["manifest_bytes"] / 1024,
        "outcome_mib_served": later[-1]["outcome_bytes_served"] / (1 << 20),
    }


def parse_alone_ms(manifest: bytes, repeats: int = 5) -> float:
    """What a non-coordinator does with the outcome it read, timed alone in this thread (no other
    rank queued for the GIL): the median of ``repeats`` times ``json.loads`` + ``Manifest.from_summary``
    (the outcome carries the manifest's summary, not its file list)."""
    summary = Manifest.from_bytes(manifest, path="manifest").summary()
    raw = json.dumps({"status": "committed", "summary": summary}, separators=(",", ":")).encode()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        doc = json.loads(raw)
        Manifest.from_summary(doc["summary"])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _range(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def chart(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    xs = [r["ranks"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [r["latency_ms"] for r in ok], "o-", label="last post -> last rank has the outcome")
    ax1.plot(xs, [r["coordinator_ms"] for r in ok], "s--", label="last post -> coordinator done")
    ax1.plot(xs, [r["coordinator_told_ms"] for r in ok], "v-.", label="last post -> outcome posted")
    ax1.plot(xs, [r["parse_alone_ms"] for r in ok], "^:", label="one rank parsing the outcome (alone)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("ranks (threads, one TCPStore client each)")
    ax1.set_ylabel("ms (median over steps)")
    ax1.set_title("commit latency (threads share one GIL: see the doc)")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    coord = [max(s["ops_coordinator"] for s in r["steps"][1:] or r["steps"]) for r in ok]
    others = [max(s["ops_others_max"] for s in r["steps"][1:] or r["steps"]) for r in ok]
    ax2.plot(xs, coord, "o-", label="coordinator (rank 0)")
    ax2.plot(xs, others, "s--", label="every other rank (max)")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, max(coord + others) + 2)
    ax2.set_xlabel("ranks")
    ax2.set_ylabel("store requests per rank and checkpoint")
    ax2.set_title("store requests per rank")
    payload = ax2.twinx()
    payload.plot(xs, [r["multi_get_kib"] for r in ok], "^:", color="gray", label="coordinator multi_get KiB")
    payload.set_yscale("log")
    payload.set_ylabel("KiB read by the coordinator's multi_get")
    lines = ax2.get_legend_handles_labels()
    more = payload.get_legend_handles_labels()
    ax2.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8,16,32,64,128,256,512,1024", help="world sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="consecutive commits per world size (first is warm-up)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="StoreCoordinator's timeout_s")
    parser.add_argument("--dir", default=None, help="root for the checkpoints (default: a temporary folder in /tmp)")
    parser.add_argument("--chart", default=None, help="PNG to draw (needs matplotlib)")
    parser.add_argument("--json", default=os.path.join(h.RESULTS_DIR, "commit_scale.json"))
    parser.add_argument("--replot", default=None, help="draw --chart from this JSON of an earlier run; run nothing")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            chart(json.load(f)["rows"], args.chart or "commit_scale.png")
        return
    print("command: " + " ".join([os.path.relpath(sys.executable, h.REPO_DIR), *sys.argv]), flush=True)
    folder = args.dir or tempfile.mkdtemp(prefix="mpckpt-commit-scale-")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=args.timeout_s))
    rows = []
    try:
        for world in [int(x) for x in args.ranks.split(",") if x.strip()]:
            root = os.path.join(folder, f"ws{world}")
            os.makedirs(root, exist_ok=True)
            t0 = time.perf_counter()
            row = run_world(world, server.port, root, args.steps, args.timeout_s)
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            print(f"ranks {world}: {row['status']} latency {h.fmt(row.get('latency_ms'))} ms, "
                  f"coordinator ops {row.get('ops_coordinator')}, others {row.get('ops_others')} "
                  f"({row['wall_s']} s){'; ' + row['error'] if row['status'] != 'ok' else ''}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            if row["status"] != "ok":
                print(f"stopping: {world} ranks did not work on this machine", flush=True)
                break
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print()
    print(h.markdown_table([r for r in rows if r["status"] == "ok"], COLUMNS))
    h.write_json(args.json, {"machine": h.machine_info(), "args": vars(args), "rows": rows})
    if args.chart:
        chart(rows, args.chart)
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
