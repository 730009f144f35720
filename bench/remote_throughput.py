"""Persist throughput to object stores: mpckpt against the raw client calls, on local servers.

Starts Azurite (Azure Blob) and moto's server (S3) on 127.0.0.1, then for a state of
``--mib`` MiB (several float32 tensors) measures, median of ``--repeats`` runs each:

- mpckpt, ``workers=2``, into each store: ``written_bytes / persist_ms`` from ``SaveFuture.stats``
  (end of the snapshot to the commit) and the wall time from ``save()`` returning to
  ``result()`` returning;
- the floor on Azure: one ``BlobClient.upload_blob(data, max_concurrency=N, overwrite=True)``
  of the same bytes;
- the floor on S3: one s3fs ``fs.pipe(path, data)`` of the same bytes.

During the mpckpt runs a thread samples the uploader processes (``ckpt.uploader_pids``) every few
ms with psutil: peak RSS and peak anonymous RSS (``rss - shared``: private heap, which is where
a second copy of a shard would live; the shared-memory slab a worker reads from is ``shared``).
The anonymous peak is compared with the largest shard written.

Both servers run on this machine, so the figures measure client-side overhead against a local
server, not a network; the ratios are what carries over.

    python bench/remote_throughput.py [--mib 256] [--repeats 3] [--max-concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mpckpt  # noqa: E402
from bench._harness import MIB, RESULTS_DIR, machine_info, markdown_table, median, write_json  # noqa: E402
from harness.servers import AZURITE_BIN, azurite_connection_string, free_port, s3_options, stop_server  # noqa: E402

START_TIMEOUT_S = 60.0


# -- servers ---------------------------------------------------------------------------------
def _start(cmd: list[str], port: int, workdir: str, name: str) -> subprocess.Popen:
    log = os.path.join(workdir, f"{name}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; log:\n{open(log).read()}")
        try:
            import socket

            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s")


def start_azurite(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = os.environ.get("MPCKPT_TEST_AZURITE") or (str(AZURITE_BIN) if AZURITE_BIN.exists()
                                                      else shutil.which("azurite-blob"))
    if not binary:
        raise SystemExit("Azurite is not installed; run `bash scripts/setup.sh --test`")
    port = free_port()
    cmd = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", os.path.join(workdir, "data"),
           "--silent", "--skipApiVersionCheck", "--loose"]
    return _start(cmd, port, workdir, "azurite"), azurite_connection_string(port)


def start_moto(workdir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, workdir, "moto")
    return proc, f"http://127.0.0.1:{port}"


# -- workload --------------------------------------------------------------------------------
def make_state(total_bytes: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = total_bytes // tensors // 4
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def state_payload(state: dict[str, torch.Tensor]) -> bytes:
    """The same bytes as one buffer, for the raw-client floor."""
    return b"".join(t.numpy().tobytes() for t in state.values())


class WorkerMemory:
    """Peak RSS and peak anonymous RSS (rss - shared) of each uploader process, sampled every 5 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.base_anon = {p.pid: _anon(p) for p in self.procs}
        self.peak_rss = dict.fromkeys(self.base_anon, 0)
        self.peak_anon = dict.fromkeys(self.base_anon, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.procs:
                try:
                    info = p.memory_info()
                except psutil.Error:
                    continue
                self.peak_rss[p.pid] = max(self.peak_rss[p.pid], info.rss)
                self.peak_anon[p.pid] = max(self.peak_anon[p.pid], info.rss - info.shared)
            time.sleep(0.005)

    def __enter__(self) -> WorkerMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def as_dict(self) -> dict[str, int]:
        return {
            "peak_rss_bytes": max(self.peak_rss.values()),
            "peak_anon_bytes": max(self.peak_anon.values()),
            "peak_anon_growth_bytes": max(self.peak_anon[p] - self.base_anon[p] for p in self.peak_anon),
        }


def _anon(p: psutil.Process) -> int:
    info = p.memory_info()
    return info.rss - info.shared


# -- measurements ----------------------------------------------------------------------------
def mpckpt_runs(url: str, options: dict, state: dict, repeats: int, shard_sizes: Any) -> list[dict[str, Any]]:
    total = sum(t.numel() * t.element_size() for t in state.values())
    runs = []
    with mpckpt.Checkpointer(url, storage_options={**options, "create": True}, workers=2,
                             memory_budget=int(total * 1.25) + 64 * MIB, keep_last=1) as ckpt:
        ckpt.save(0, {"warm": torch.ones(4)}, mode="sync")  # connections and imports, not timed
        for step in range(1, repeats + 1):
            with WorkerMemory(list(ckpt.uploader_pids)) as mem:
                future = ckpt.save(step, state)
                returned = time.perf_counter()
                future.result(600)
                waited = time.perf_counter() - returned
            stats = future.stats
            shards = shard_sizes(f"step_{step:010d}")
            runs.append({
                "written_bytes": stats.written_bytes, "persist_ms": stats.persist_ms,
                "mb_per_s": stats.mb_per_s, "wait_mb_per_s": stats.written_bytes / 1e6 / waited,
                "blocked_ms": stats.blocked_ms, "shards": len(shards), "max_shard_bytes": max(shards),
                **mem.as_dict(),
            })
            print(f"  {url} step {step}: {runs[-1]['mb_per_s']:.0f} MB/s, {len(shards)} shards, "
                  f"worker anon peak +{runs[-1]['peak_anon_growth_bytes'] / MIB:.0f} MiB", flush=True)
    return runs


def azure_floor(conn: str, data: bytes, repeats: int, max_concurrency: int) -> list[float]:
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(conn)
    container = service.get_container_client(f"raw-{uuid.uuid4().hex[:12]}")
    container.create_container()
    blob = container.get_blob_client("payload.bin")
    blob.upload_blob(b"warm", overwrite=True)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        blob.upload_blob(data, max_concurrency=max_concurrency, overwrite=True)
        out.append(len(data) / 1e6 / (time.perf_counter() - start))
        print(f"  azure upload_blob: {out[-1]:.0f} MB/s", flush=True)
    return out


def s3_floor(endpoint: str, data: bytes, repeats: int) -> list[float]:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options(endpoint), skip_instance_cache=True)
    bucket = f"raw-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/warm", b"warm")
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fs.pipe(f"{bucket}/payload.bin", data)
        out.append(len(data) / 1e6 / (time.perf_counter() - start))
        print(f"  s3fs pipe: {out[-1]:.0f} MB/s", flush=True)
    return out


def azure_shard_sizes(conn: str, container: str) -> Any:
    from azure.storage.blob import BlobServiceClient

    client = BlobServiceClient.from_connection_string(conn).get_container_client(container)
    return lambda name: [b.size for b in client.list_blobs(name_starts_with=f"run/{name}/")
                         if b.name.endswith(".safetensors")]


def s3_shard_sizes(endpoint: str, bucket: str) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options(endpoint), skip_instance_cache=True)
    return lambda name: [d["size"] for d in fs.ls(f"{bucket}/run/{name}", detail=True, refresh=True)
                         if d["name"].endswith(".safetensors")]


def summarise(store: str, runs: list[dict[str, Any]], floor: list[float], floor_name: str) -> dict[str, Any]:
    mp = median([r["mb_per_s"] for r in runs])
    fl = median(floor)
    return {
        "store": store, "floor": floor_name, "mpckpt_mb_s": mp,
        "mpckpt_wait_mb_s": median([r["wait_mb_per_s"] for r in runs]),
        "floor_mb_s": fl, "ratio": mp / fl if fl else None,
        "shards": runs[0]["shards"], "shard_mib": max(r["max_shard_bytes"] for r in runs) / MIB,
        "worker_rss_mib": max(r["peak_rss_bytes"] for r in runs) / MIB,
        "worker_anon_growth_mib": max(r["peak_anon_growth_bytes"] for r in runs) / MIB,
        "runs": runs, "floor_runs_mb_s": floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-concurrency", type=int, default=16,
                        help="upload_blob max_concurrency for the Azure floor (default 16 = 2 workers x 8)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "remote_throughput.json"))
    args = parser.parse_args()
    os.environ.setdefault("MPCKPT_PROGRESS", "0")

    state = make_state(args.mib * MIB)
    data = state_payload(state)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpckpt-remote-bench-") as work:
        os.makedirs(os.path.join(work, "az"))
        os.makedirs(os.path.join(work, "s3"))
        azurite, conn = start_azurite(os.path.join(work, "az"))
        moto, endpoint = start_moto(os.path.join(work, "s3"))
        try:
            container = f"bench-{uuid.uuid4().hex[:12]}"
            print(f"azure ({args.mib} MiB):", flush=True)
            runs = mpckpt_runs(f"az://{container}/run", {"connection_string": conn}, state, args.repeats,
                               azure_shard_sizes(conn, container))
            floor = azure_floor(conn, data, args.repeats, args.max_concurrency)
            rows.append(summarise("Azure (Azurite)", runs, floor,
                                  f"BlobClient.upload_blob(max_concurrency={args.max_concurrency})"))
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            print(f"s3 ({args.mib} MiB):", flush=True)
            runs = mpckpt_runs(f"s3://{bucket}/run", s3_options(endpoint), state, args.repeats,
                               s3_shard_sizes(endpoint, bucket))
            floor = s3_floor(endpoint, data, args.repeats)
            rows.append(summarise("S3 (moto)", runs, floor, "s3fs fs.pipe"))
        finally:
            stop_server(azurite)
            stop_server(moto)

    table = markdown_table(rows, [
        ("store", "store", 0), ("floor", "raw client call", 0), ("mpckpt_mb_s", "mpckpt MB/s (persist)", 0),
        ("mpckpt_wait_mb_s", "mpckpt MB/s (save→result)", 0), ("floor_mb_s", "raw MB/s", 0),
        ("ratio", "mpckpt / raw", 2), ("shards", "shards", 0), ("shard_mib", "largest shard MiB", 0),
        ("worker_rss_mib", "worker peak RSS MiB", 0), ("worker_anon_growth_mib", "worker peak private growth MiB", 0),
    ])
    print(f"\nState: {args.mib} MiB in {len(state)} float32 tensors, workers=2, median of {args.repeats} runs.\n")
    print(table)
    write_json(args.out, {"mib": args.mib, "repeats": args.repeats, "workers": 2, "rows": rows,
                          "machine": machine_info()})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
