"""Expected goodput of each checkpointing strategy at 1,000-100,000 accelerators: an analytic model.

The model takes the parts this repository measured (copy bandwidth into shared memory, restore
throughput per tier, peer copy bandwidth, commit cost per rank) and a published failure rate, and
prints, per strategy, model size and job size: the checkpoint interval the strategy can afford,
the time a save blocks training, the work a failure loses, the restart time and the goodput
(useful training time / wall time). ``--check`` applies the same formulas to the chaos runs of
``bench/goodput.py`` on the development VM (docs/reliability.md, section 13) and prints predicted
against measured goodput. Standard library only; runs in well under a second.

The formulas (every symbol is an input below, or derived in ``evaluate``):

- Failures arrive at ``rate_per_acc * N`` per second while the job runs (job MTBF ``M``). A
  failure is *process-only* (the node and its ``/dev/shm`` survive: software, a transient),
  a *node loss* (the node is replaced, its memory is gone) or a *pair loss* (a node and the node
  holding its peer copy, before the copy is remade).
- A save blocks training ``delta`` seconds: the state's bytes per accelerator over the copy
  bandwidth (device to host) for async saves, over the write bandwidth for ``torch.save``.
- Storage interval: Young/Daly ``tau = sqrt(2 * delta * M_s)``, ``M_s`` the MTBF of the failures
  that restore from storage; at least one step, at least the commit time, and for an async save
  at least ``write_time / storage_duty`` (one save in flight, the job using at most that share
  of the storage bandwidth). Memory tiers save to memory every step.
- Work lost per failure: the expected time since the newest surviving save when a failure
  arrives (``since(tau, M)``, about ``tau / 2``), plus the time an async save takes to become
  durable (storage) or to reach the peer (a copy round).
- Restart: detection + relaunch (+ a replacement node for a node loss) + restore from the tier:
  own memory at ``mem_restore_gbps``, the peer at ``peer_gbps``, storage at the job's read
  bandwidth shared by all ranks (and no faster than the rank's own decode rate).
- Goodput = ``(1 - o) * M / (M + R + L)``: ``o`` the fraction of step time blocked by saves,
  ``R`` and ``L`` the expected restart and lost work per failure.

    python3 bench/goodput_model.py                 # the table and the sensitivity
    python3 bench/goodput_model.py --check         # the model against this machine's chaos runs
    python3 bench/goodput_model.py --node-loss-fraction 0.5 --storage-write-tbps 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

GIB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Measured on this project's machines. docs/benchmarks.md and docs/reliability.md as committed;
# Quoted names are sections of docs/benchmarks.md; "reliability" names docs/reliability.md's numbered sections.
# Figures since replaced on the page are in its history (git show 6dafda9:docs/benchmarks.md).
# ---------------------------------------------------------------------------------------------
MEASURED: dict[str, float] = {
    # "On a GPU" (H100), bench/gpu_save.py run 3, 2,000 tensors, 1 GiB:
    # mpckpt eager steady 25.8 ms (the pinned device-to-host floor 22.6 ms).
    "copy_gbps_h100": GIB / 0.0258 / 1e9,                 # 41.6 GB/s, blocked time per save
    # same table: DCP async_save with a pinned, cached stager, 98.4 ms.
    "dcp_copy_gbps_h100": GIB / 0.0984 / 1e9,             # 10.9 GB/s
    # compare.py run C (2026-11-22, history: section 1): mpckpt_eager blocked median 228.3 ms for 0.98 GiB (2-core VM, host memory).
    "copy_gbps_vm": 0.98 * GIB / 0.2283 / 1e9,            # 4.6 GB/s
    # compare.py run B (2026-11-22, history: section 1): torch_save blocked median 3,287 ms for 0.98 GiB, local disk, no fsync.
    "torch_save_gbps_vm": 0.98 * GIB / 3.287 / 1e9,       # 0.32 GB/s
    # "Restore into a training process" (--moments fresh), 1 GiB: mpckpt writer open + restore from
    # storage 0.300 s, from memory 0.317 s, DCP load 1.937 s, torch.load 0.821 s.
    "restore_storage_gbps_vm": GIB / 0.300 / 1e9,         # 3.6 GB/s (warm page cache)
    "restore_memory_gbps_vm": GIB / 0.317 / 1e9,          # 3.4 GB/s
    "restore_dcp_gbps_vm": GIB / 1.937 / 1e9,             # 0.55 GB/s
    "restore_torch_load_gbps_vm": GIB / 0.821 / 1e9,      # 1.3 GB/s
    # "Persisting and uploading": mpckpt persist, 2 uploaders, 1 GiB, local virtio disk.
    "persist_gbps_vm": 1.946,
    # "Restore and read speed": mpckpt.load, cold page cache, 1,009 MiB.
    "cold_read_gbps_vm": 1.141,
    # "Node loss": a peer copy, save returned to copy in place (median 2.75 s per 1,008.5 MiB).
    "peer_copy_gbps_vm": 0.38,
    # "Node loss": rank 1's restore from node 0's memory, read_remote 0.72-0.78 GB/s.
    "peer_read_gbps_vm": 0.75,
    # "Commit coordination from 2 to 1,024 ranks" (bench/commit_scale.py), 1,024 ranks: last post -> last rank has the outcome 420.6 ms
    # (175.4 ms of it the coordinator); 2-16 ranks 3.6-7.4 ms. Extrapolated linearly per rank.
    "commit_ms_per_rank": 420.6 / 1024,                   # 0.41 ms
    "commit_ms_fixed": 4.0,
    # "Node loss": launch to first step 8.72 s less rank 1's restore 2.69 s (2 simulated nodes, quiet VM).
    "relaunch_s_vm": 8.72 - 2.69,                         # 6.0 s
}

# ---------------------------------------------------------------------------------------------
# Assumed for a datacenter where this VM's figure is not one (every one a flag).
# ---------------------------------------------------------------------------------------------
ASSUMED: dict[str, float] = {
    # Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 GPUs; about 78% of
    # them attributed to confirmed or suspected hardware. Every hardware fault counted as a node
    # lost (its node drained and replaced): pessimistic for the memory tier.
    "failures": 419, "days": 54, "gpus": 16384,
    "node_loss_fraction": 0.78,
    # Of node losses, those whose peer node is also lost before the copy is remade (a shared
    # rack or switch); independent failures alone make this ~1e-5.
    "pair_loss_fraction": 0.01,
    # bf16 weights + fp32 master + two fp32 Adam moments (2 + 4 + 4 + 4) + fp32 gradients kept
    # out of the checkpoint: 14; with the bf16 gradient buffer some frameworks save, 16.
    "bytes_per_param": 16,
    # Step time: weak scaling, 6 * params * tokens per accelerator / achieved FLOP/s.
    "tokens_per_acc": 4096, "tflops": 400,
    # The H100's measured copy rates (MEASURED) are used as is.
    # torch.save writes one stream per rank; the VM's 0.32 GB/s is a 2-core VM's disk.
    "torch_save_gbps": 2.0,
    # Restore from this node's memory per accelerator (the VM: 3.4 GB/s on 2 cores, verified;
    # a datacenter host has 10+ cores per accelerator).
    "mem_restore_gbps": 10.0,
    # Per-accelerator share of the frontend network (a 200-400 Gb/s NIC per 8 accelerators):
    # the peer copy and storage traffic both use it (the VM's loopback: 0.38-0.75 GB/s).
    "peer_gbps": 3.0, "storage_link_gbps": 3.0,
    # The storage the job writes to: Llama 3 (2024) reports 2 TB/s sustained (7 TB/s peak)
    # from its Tectonic cluster; the VM's disk gives 1.9 GB/s.
    "storage_write_tbps": 2.0, "storage_read_tbps": 2.0,
    # Share of storage bandwidth checkpoints may use (data loading and other jobs use the rest).
    "storage_duty": 0.25,
    # Failure to a relaunched job: detection (heartbeat, collective timeout), the scheduler's
    # relaunch (processes, imports, rendezvous, NCCL init at thousands of ranks), a spare node
    # swapped in for a lost one. The VM's relaunch is 6 s with 2 ranks.
    "detect_s": 60.0, "relaunch_s": 180.0, "replace_s": 60.0,
    # Training slowed by peer copies (sender and receiver threads, NIC): not measured apart on a
    # datacenter host (on the 2-core VM copies slowed steps 2x: the cores were shared).
    "peer_overhead": 0.01,
}
# The model's inputs: the assumptions and the measured figures one may vary (flags, sensitivity).
DEFAULTS: dict[str, float] = {
    **ASSUMED,
    "copy_gbps": MEASURED["copy_gbps_h100"],
    "dcp_copy_gbps": MEASURED["dcp_copy_gbps_h100"],
    "commit_ms_per_rank": MEASURED["commit_ms_per_rank"],
}

MODELS = {"7B": 7e9, "70B": 70e9, "405B": 405e9}
SIZES = (1_000, 10_000, 100_000)
STRATEGIES = ("torch_save", "dcp_async", "mpckpt_storage", "mpckpt_memory", "mpckpt_peer")
# Per-rank decode rate of a restore from storage (measured on the VM): it bounds a rank's read.
DECODE = {"torch_save": "restore_torch_load_gbps_vm", "dcp_async": "restore_dcp_gbps_vm",
          "mpckpt_storage": "restore_storage_gbps_vm", "mpckpt_memory": "restore_storage_gbps_vm",
          "mpckpt_peer": "restore_storage_gbps_vm"}


@dataclasses.dataclass
class Row:
    strategy: str
    model: str
    accelerators: int
    step_s: float
    interval_steps: int        # storage saves every this many steps
    interval_s: float
    blocked_ms: float          # per save (memory tiers: per memory save, every step)
    overhead: float            # fraction of wall time blocked by saves
    lost_s: float              # expected work lost per failure
    restart_s: float           # expected failure -> training again
    mtbf_s: float
    goodput: float


def rate_per_acc(p: dict[str, float]) -> float:
    """Failures per accelerator-second (Llama 3: 419 in 54 days on 16,384 GPUs)."""
    return p["failures"] / (p["days"] * 86400.0 * p["gpus"])


def young_daly(save_cost_s: float, mtbf_s: float) -> float:
    """The first-order optimum interval between saves: sqrt(2 * save cost * MTBF)."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def since(tau: float, mtbf: float) -> float:
    """Expected time since the newest save when a Poisson failure arrives, saves every tau.

    E[X mod tau] for X ~ Exp(mean mtbf): about tau / 2 when tau << mtbf, never above mtbf.
    """
    if tau <= 0:
        return 0.0
    x = tau / mtbf
    if x > 50:
        return mtbf
    return mtbf - tau * math.exp(-x) / -math.expm1(-x)


def goodput(overhead: float, mtbf: float, restart_s: float, lost_s: float) -> float:
    """Useful time over wall time: blocked fraction off, each failure costs restart + lost work."""
    return (1.0 - overhead) * mtbf / (mtbf + restart_s + lost_s)


def step_time(params: float, p: dict[str, float]) -> float:
    return 6.0 * params * p["tokens_per_acc"] / (p["tflops"] * 1e12)


def commit_s(n: int, per_rank_ms: float = MEASURED["commit_ms_per_rank"]) -> float:
    """A storage commit's latency at n ranks, extrapolated linearly from bench/commit_scale.py."""
    return (MEASURED["commit_ms_fixed"] + per_rank_ms * n) / 1e3


def evaluate(strategy: str, model: str, n: int, p: dict[str, float]) -> Row:
    """One strategy, one model on n accelerators, with the inputs p (ASSUMED, possibly changed)."""
    params = MODELS[model]
    step = step_time(params, p)
    acc_bytes = params * p["bytes_per_param"] / n
    mtbf = 1.0 / (rate_per_acc(p) * n)
    nf = min(p["node_loss_fraction"], 1.0)
    pair = min(p["pair_loss_fraction"], 1.0)
    # The job's storage bandwidth: the store's aggregate or every accelerator's link, the lower.
    write_bps = min(p["storage_write_tbps"] * 1e12, n * p["storage_link_gbps"] * 1e9)
    read_bps = min(p["storage_read_tbps"] * 1e12, n * p["storage_link_gbps"] * 1e9)
    write_s = acc_bytes * n / write_bps
    decode_bps = MEASURED[DECODE[strategy]] * 1e9
    restore_storage = acc_bytes / min(read_bps / n, decode_bps)
    restart_base = p["detect_s"] + p["relaunch_s"]

    commit = commit_s(n, p["commit_ms_per_rank"])
    if strategy == "torch_save":
        # Blocking: training waits for the write (one stream per rank, its share of storage); the
        # ranks' files need no manifest, a barrier (milliseconds) ends the save.
        delta = acc_bytes / min(p["torch_save_gbps"] * 1e9, write_bps / n)
        tau = max(young_daly(delta, mtbf), step)
        lag = 0.0
    else:
        copy_gbps = p["dcp_copy_gbps" if strategy == "dcp_async" else "copy_gbps"]
        delta = acc_bytes / (copy_gbps * 1e9)
        floor = max(step, commit, write_s / p["storage_duty"])
        if strategy in ("dcp_async", "mpckpt_storage"):
            tau = max(young_daly(delta, mtbf), floor)
        else:
            # A memory tier: every step is already copied, a storage save adds no blocked time,
            # so storage is written as often as it sustains (Young/Daly with cost 0 -> the floor).
            tau = floor
        lag = write_s + commit                # an async save is durable this long after it
    k = max(1, math.ceil(tau / step - 1e-9))
    tau = k * step

    storage_lost = since(tau, mtbf) + lag
    storage_restart = restart_base + restore_storage
    if strategy in ("torch_save", "dcp_async", "mpckpt_storage"):
        overhead = delta / tau
        lost = storage_lost
        restart = storage_restart + nf * p["replace_s"]
        blocked = delta
    else:
        overhead = delta / step
        mem_lost = since(step, mtbf)
        mem_restart = restart_base + acc_bytes / (p["mem_restore_gbps"] * 1e9)
        if strategy == "mpckpt_memory":
            kinds = [(1 - nf, mem_lost, mem_restart),
                     (nf, storage_lost, storage_restart + p["replace_s"])]
        else:
            copy_s = acc_bytes / (p["peer_gbps"] * 1e9)
            overhead += p["peer_overhead"]
            # A copy round starts once the last ended: the newest copy trails by 1-2 copy times.
            peer_lost = mem_lost + 1.5 * copy_s
            peer_restart = restart_base + p["replace_s"] + copy_s
            kinds = [(1 - nf, mem_lost, mem_restart),
                     (nf * (1 - pair), peer_lost, peer_restart),
                     (nf * pair, storage_lost, storage_restart + p["replace_s"])]
        lost = sum(w * x for w, x, _ in kinds)
        restart = sum(w * r for w, _, r in kinds)
        blocked = delta
    overhead = min(overhead, 0.99)
    return Row(strategy, model, n, step, k, tau, blocked * 1e3, overhead, lost, restart, mtbf,
               goodput(overhead, mtbf, restart, lost))


def table(p: dict[str, float]) -> list[Row]:
    return [evaluate(s, m, n, p) for m in MODELS for n in SIZES for s in STRATEGIES]


def fmt_s(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def print_table(rows: list[Row], p: dict[str, float]) -> None:
    print(f"Failure rate: {rate_per_acc(p) * 86400 * 1e6:.1f} per million accelerator-days "
          f"(Llama 3: {p['failures']:.0f} in {p['days']:.0f} days on {p['gpus']:.0f} GPUs); "
          f"node losses {p['node_loss_fraction']:.0%} of failures, pair losses "
          f"{p['pair_loss_fraction']:.0%} of node losses; {p['bytes_per_param']:.0f} bytes/param.\n")
    print("| model | accelerators | job MTBF | step s | GB / accelerator | strategy | storage every (steps) | storage every | "
          "blocked ms / save | blocked % | lost / failure | restart | goodput |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gb = MODELS[r.model] * p["bytes_per_param"] / r.accelerators / 1e9
        print(f"| {r.model} | {r.accelerators:,} | {fmt_s(r.mtbf_s)} | {r.step_s:.2f} | {gb:.2f} | {r.strategy} | "
              f"{r.interval_steps:,} | {fmt_s(r.interval_s)} | {r.blocked_ms:,.1f} | {r.overhead * 100:.2f} | "
              f"{fmt_s(r.lost_s)} | {fmt_s(r.restart_s)} | {r.goodput:.3f} |")


SENSITIVE = ("failures", "node_loss_fraction", "pair_loss_fraction", "bytes_per_param", "tokens_per_acc",
             "tflops", "copy_gbps", "dcp_copy_gbps", "commit_ms_per_rank", "torch_save_gbps", "mem_restore_gbps", "peer_gbps", "storage_link_gbps",
             "storage_write_tbps", "storage_read_tbps", "storage_duty", "detect_s", "relaunch_s",
             "replace_s", "peer_overhead")


def sensitivity(p: dict[str, float], model: str = "70B", n: int = 10_000) -> list[tuple[str, dict[str, tuple[float, float]]]]:
    """Each input halved and doubled: the change in goodput (points) per strategy, largest first."""
    base = {s: evaluate(s, model, n, p).goodput for s in STRATEGIES}
    out = []
    for key in SENSITIVE:
        changes = {}
        for s in STRATEGIES:
            lo, hi = dict(p), dict(p)
            lo[key] = p[key] / 2
            hi[key] = min(p[key] * 2, 1.0) if key.endswith("fraction") else p[key] * 2
            changes[s] = (evaluate(s, model, n, lo).goodput - base[s], evaluate(s, model, n, hi).goodput - base[s])
        out.append((key, changes))
    out.sort(key=lambda kc: -max(max(abs(a), abs(b)) for a, b in kc[1].values()))
    return out


def print_sensitivity(p: dict[str, float], model: str = "70B", n: int = 10_000) -> None:
    print(f"\nSensitivity, {model} on {n:,} accelerators: goodput change in points, input x0.5 / x2 "
          "(fractions capped at 1), largest first.\n")
    print("| input | value | " + " | ".join(STRATEGIES) + " |")
    print("|---|---:|" + "---:|" * len(STRATEGIES))
    for key, changes in sensitivity(p, model, n):
        cells = " | ".join(f"{a * 100:+.1f} / {b * 100:+.1f}" for a, b in (changes[s] for s in STRATEGIES))
        print(f"| {key} | {p[key]:.3g} | {cells} |")


def print_anchors(p: dict[str, float]) -> None:
    """The published figures beside what the model says at their scale (not a fit: a sanity check)."""
    print("\nPublished anchors beside the model (inputs as above; the model sizes are guesses where "
          "the publication gives none):\n")
    print("| anchor | published | the model |")
    print("|---|---|---|")
    r = {s: evaluate(s, "405B", 16_384, p) for s in STRATEGIES}
    print(f"| Llama 3 (2024), 16,384 GPUs | 419 interruptions in 54 days (job MTBF 3.1 h) | job MTBF "
          f"{fmt_s(r['torch_save'].mtbf_s)}; 405B goodput torch.save {r['torch_save'].goodput:.2f}, "
          f"mpckpt peer {r['mpckpt_peer'].goodput:.2f} |")
    # DLRover: checkpoints every 10 steps instead of 250 (a memory save against a blocking one).
    n = 1_536
    base = evaluate("torch_save", "70B", n, p)
    lost250 = since(250 * base.step_s, base.mtbf_s)
    over250 = base.blocked_ms / 1e3 / (250 * base.step_s)
    g250 = goodput(over250, base.mtbf_s, base.restart_s, lost250)
    mem = evaluate("mpckpt_memory", "70B", n, p)
    print(f"| DLRover, 1,536 GPUs | goodput 90% -> 95% (checkpoint every 250 -> 10 steps) | 70B: torch.save "
          f"every 250 steps {g250:.2f}, mpckpt memory every step {mem.goodput:.2f} |")
    a = {s: evaluate(s, "405B", 100_000, p) for s in STRATEGIES}
    print(f"| FT-HSDP, ~100k GPUs | effective training time 44% -> 80% | 405B: torch.save {a['torch_save'].goodput:.2f}, "
          f"DCP async {a['dcp_async'].goodput:.2f}, mpckpt peer {a['mpckpt_peer'].goodput:.2f} |")
    b = {s: evaluate(s, "70B", 9_600, p) for s in STRATEGIES}
    print(f"| ByteRobust, 9,600 GPUs, 3 months | 97% effective training time | 70B: mpckpt peer "
          f"{b['mpckpt_peer'].goodput:.2f}, DCP async {b['dcp_async'].goodput:.2f} |")
    n = 2_048
    for name, pub, model in (("Orbax multi-tier, 2,048 VMs", "restore 6.8x faster", "70B"),
                             ("Gemini", "recovery 13x faster than remote storage", "405B")):
        acc = MODELS[model] * p["bytes_per_param"] / n
        read_bps = min(p["storage_read_tbps"] * 1e12, n * p["storage_link_gbps"] * 1e9)
        storage = acc / min(read_bps / n, MEASURED["restore_storage_gbps_vm"] * 1e9)
        mem = acc / (p["mem_restore_gbps"] * 1e9)
        peer = acc / (p["peer_gbps"] * 1e9)
        print(f"| {name} | {pub} | {model} on {n:,}: restore (reads alone) from storage {storage:.1f} s, "
              f"own memory {mem:.1f} s ({storage / mem:.1f}x), peer {peer:.1f} s ({storage / peer:.1f}x); "
              f"with detection and relaunch the whole restart differs by "
              f"{(p['detect_s'] + p['relaunch_s'] + storage) / (p['detect_s'] + p['relaunch_s'] + mem):.2f}x |")


# ---------------------------------------------------------------------------------------------
# --check: the model against bench/goodput.py's chaos runs on the 2-core VM (docs/reliability.md
# section 13 "Goodput under failures", and section 12). 2 ranks of FSDP2, ~0.9 MB of state,
# steps paced to 100 ms, storage saves every 10 steps. Per run: relaunches per kind (a kind
# killed again while the job restarted relaunches twice), the median recovery per kind
# (failure to the next training step), the final step, the uninterrupted run's steps/s, the
# wall time and the goodput measured.
# ---------------------------------------------------------------------------------------------
CHECK_RUNS: list[dict] = [
    # "The long run", S3: rank_kill 18 (10 again while restarting), node_loss 19 (7 again),
    # preempt 18; recovery medians 10.1, 10.0, 12.2 s; 10,909 steps; 9.90 steps/s; 0.61.
    dict(name="long run, S3, peer", strategy="peer", s3=True, wall_s=1800, final_step=10909, rate=9.90,
         events={"rank_kill": (18, 10, 10.1), "node_loss": (19, 7, 10.0), "preempt": (18, 0, 12.2)},
         measured=0.61),
    # "The long run", local disk: 20 (3 again), 19 (6 again), 20; 7.6, 8.4, 10.0 s; 12,655; 9.92; 0.71.
    dict(name="long run, disk, peer", strategy="peer", s3=False, wall_s=1807, final_step=12655, rate=9.92,
         events={"rank_kill": (20, 3, 7.6), "node_loss": (19, 6, 8.4), "preempt": (20, 0, 10.0)},
         measured=0.71),
    # Medium form, seed 12, S3 every kind (rank_kill x2: killed again while restarting).
    dict(name="seed 12, S3, storage", strategy="storage", s3=True, wall_s=76, final_step=280, rate=7.55,
         events={"node_loss": (1, 0, 10.8), "rank_kill": (1, 1, 16.3), "preempt": (1, 0, 13.1)}, measured=0.48),
    dict(name="seed 12, S3, memory", strategy="memory", s3=True, wall_s=86, final_step=285, rate=7.55,
         events={"node_loss": (1, 0, 15.3), "rank_kill": (1, 1, 14.6), "preempt": (1, 0, 14.6)}, measured=0.44),
    dict(name="seed 12, S3, peer", strategy="peer", s3=True, wall_s=82, final_step=289, rate=7.55,
         events={"node_loss": (1, 0, 11.6), "rank_kill": (1, 1, 15.0), "preempt": (1, 0, 16.0)}, measured=0.46),
    # Medium form, seed 23, local disk every kind.
    dict(name="seed 23, disk, storage", strategy="storage", s3=False, wall_s=56, final_step=280, rate=7.55,
         events={"node_loss": (1, 0, 5.8), "rank_kill": (1, 0, 6.0), "preempt": (1, 0, 9.5)}, measured=0.66),
    dict(name="seed 23, disk, memory", strategy="memory", s3=False, wall_s=61, final_step=279, rate=7.55,
         events={"node_loss": (1, 0, 6.6), "rank_kill": (1, 0, 9.1), "preempt": (1, 0, 11.4)}, measured=0.61),
    dict(name="seed 23, disk, peer", strategy="peer", s3=False, wall_s=72, final_step=284, rate=7.55,
         events={"node_loss": (1, 0, 9.8), "rank_kill": (1, 0, 10.9), "preempt": (1, 0, 13.6)}, measured=0.52),
    dict(name="seed 23, disk, dcp", strategy="dcp", s3=False, wall_s=70, final_step=280, rate=7.55,
         events={"node_loss": (1, 0, 9.7), "rank_kill": (1, 0, 8.7), "preempt": (1, 0, 12.7)}, measured=0.53),
]
# The realistic size (reliability section 13, "At a realistic size", S3, seed 1): 2 ranks of DDP, 1.21 GB
# of state per rank, 2.2 s steps (0.46 steps/s uninterrupted), storage every 25 steps, a failure every
# 30-60 s after the job trains again; one rank killed, one preemption (the outage ended no job).
# torch.save blocked the loop ~25 s per save: its overhead, as measured (the model's own is for DCP/mpckpt).
REALISTIC = {"state_bytes_per_rank": 1.21e9, "every": 25, "mean_gap_s": 60.0}
CHECK_RUNS += [
    dict(name="realistic, S3, torch.save", strategy="torchsave", s3=True, wall_s=289, final_step=54, rate=0.46,
         events={"rank_kill": (1, 0, 34.7), "preempt": (1, 0, 81.8)}, measured=0.41, inputs=REALISTIC,
         overhead=25.0 / (25 * 2.2)),
    dict(name="realistic, S3, dcp", strategy="dcp", s3=True, wall_s=315, final_step=54, rate=0.46,
         events={"rank_kill": (1, 0, 52.9), "preempt": (1, 0, 89.8)}, measured=0.38, inputs=REALISTIC),
    dict(name="realistic, S3, storage", strategy="storage", s3=True, wall_s=250, final_step=28, rate=0.46,
         events={"rank_kill": (1, 0, 29.6), "preempt": (1, 0, 44.8)}, measured=0.26, inputs=REALISTIC),
    dict(name="realistic, S3, memory", strategy="memory", s3=True, wall_s=242, final_step=65, rate=0.46,
         events={"rank_kill": (1, 0, 9.5), "preempt": (1, 0, 49.4)}, measured=0.58, inputs=REALISTIC),
    dict(name="realistic, S3, peer", strategy="peer", s3=True, wall_s=256, final_step=46, rate=0.46,
         events={"rank_kill": (1, 0, 10.7), "preempt": (1, 0, 51.2)}, measured=0.40, inputs=REALISTIC),
]
CHECK_INPUTS = {
    "state_bytes_per_rank": 0.45e6,   # reliability section 13: ~0.9 MB of state on 2 ranks
    "every": 10,                      # storage saves every 10 steps
    "mean_gap_s": 8.0,                # --gap-s 4,12 (the long runs); a failure's MTBF for since()
    "s3_open_extra_s": 1.4,           # reliability section 13: importing s3fs and aiobotocore at the open
    "s3_gbps": 0.057,                 # "Persisting and uploading" (remote storage): S3 (moto) 57 MB/s
}


def check_run(run: dict) -> tuple[float, float]:
    """Predicted goodput of one chaos run: from the model's restart, and from the run's own recovery.

    The useful time U is the final step at the uninterrupted run's speed; every relaunch costs
    its restart R plus the work L it loses: predicted goodput U / (U + sum(R + L)) / (1 + o).
    """
    ci, m = {**CHECK_INPUTS, **run.get("inputs", {})}, MEASURED
    step = 1.0 / run["rate"]
    acc = ci["state_bytes_per_rank"]
    storage_bps = (ci["s3_gbps"] if run["s3"] else m["persist_gbps_vm"]) * 1e9
    relaunch = m["relaunch_s_vm"] + (ci["s3_open_extra_s"] if run["s3"] and run["strategy"] != "dcp" else 0.0)
    restore_storage = acc / min(storage_bps, m["restore_storage_gbps_vm"] * 1e9)
    restore_memory = acc / (m["restore_memory_gbps_vm"] * 1e9)
    tau = ci["every"] * step
    storage_lost = since(tau, ci["mean_gap_s"]) + acc / storage_bps + commit_s(2)
    mem_lost = since(step, ci["mean_gap_s"])
    peer_lost = mem_lost + 1.5 * acc / (m["peer_copy_gbps_vm"] * 1e9)
    strategy = run["strategy"]
    lost = {"preempt": 0.0,
            "rank_kill": mem_lost if strategy in ("memory", "peer") else storage_lost,
            "node_loss": peer_lost if strategy == "peer" else storage_lost}
    restore = {"preempt": restore_storage,
               "rank_kill": restore_memory if strategy in ("memory", "peer") else restore_storage,
               "node_loss": acc / (m["peer_read_gbps_vm"] * 1e9) if strategy == "peer" else restore_storage}
    overhead = run.get("overhead", acc / (m["copy_gbps_vm"] * 1e9) / step if strategy in ("memory", "peer") else 0.0)
    useful = run["final_step"] / run["rate"]
    cost_model = cost_own = 0.0
    for kind, (n, again, recovery) in run["events"].items():
        cost_model += n * (relaunch + restore[kind] + lost[kind]) + again * relaunch
        cost_own += n * (recovery + lost[kind])
    return (useful / (useful + cost_model) / (1 + overhead),
            useful / (useful + cost_own) / (1 + overhead))


def print_check() -> None:
    print("The model against bench/goodput.py's chaos runs on the 2-core VM (docs/reliability.md, "
          "section 13).\nModel restart: the quiet VM's relaunch "
          f"({MEASURED['relaunch_s_vm']:.1f} s, benchmarks section 14; +{CHECK_INPUTS['s3_open_extra_s']} s "
          "for an S3 open) + the restore from the tier; own recovery: the run's median recovery per kind.\n")
    print("| run | strategy | relaunches | goodput measured | predicted (model restart) | error | "
          "predicted (run's own recovery) | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for run in CHECK_RUNS:
        model, own = check_run(run)
        n = sum(a + b for a, b, _ in run["events"].values())
        print(f"| {run['name']} | {run['strategy']} | {n} | {run['measured']:.2f} | {model:.2f} | "
              f"{model - run['measured']:+.2f} | {own:.2f} | {own - run['measured']:+.2f} |")


def params_from(args: argparse.Namespace) -> dict[str, float]:
    p = dict(DEFAULTS)
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            p[key] = value
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="predicted against measured goodput on this VM")
    parser.add_argument("--no-sensitivity", action="store_true")
    parser.add_argument("--sensitivity-model", default="70B", choices=list(MODELS))
    parser.add_argument("--sensitivity-accelerators", type=int, default=10_000)
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=float, default=None,
                            help=f"default {value:g}")
    args = parser.parse_args(argv)
    if args.check:
        print_check()
        return 0
    p = params_from(args)
    print_table(table(p), p)
    if not args.no_sensitivity:
        print_sensitivity(p, args.sensitivity_model, args.sensitivity_accelerators)
    print_anchors(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
