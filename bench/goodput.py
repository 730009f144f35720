"""Goodput under failures: a chaos run of a multi-rank training job, what each failure costs, nothing lost.

A 2-node x 1-rank FSDP2 job (gloo, CPU, ``bench/goodput_worker.py``) trains on simulated nodes
(``harness/nodes.py``: each node its own hostname and ``/dev/shm``) for ``--duration`` seconds under a
seeded failure schedule (``bench/goodput_faults.py``), relaunched after every failure that ends it
(torchrun on every node, the same rendezvous endpoint, a fresh node in place of a lost one). Storage
is S3 (moto) behind the fault proxy (``harness/fault_proxy.py``: outages and latency), or, with
``--storage disk``, a small tmpfs root through the ``ctl://`` backend (a full disk, a slow disk).

``--realistic`` makes it a job of a realistic size for this machine (``REALISTIC``: ~1.2 GB of
state per rank under DDP, ~1.5 s steps of real compute, memory every step, storage every 25
steps, failures every 30-90 s, the disk root on an ext4 image) and compares ``torchsave`` and
``dcp`` on the same storage with mpckpt's three strategies.

Per failure: what failed, steps lost (the last step trained before it against the step restored
after it), the time from the failure to the first training step after it and its phases (the
relaunch, the imports, the process group, the model's build, the checkpointer's open, the restore,
the first step; then the loop's time in the first save), where each rank's restore came from
(``ckpt.last_restore.source``). Per run: goodput (the uninterrupted run's wall time to the
same step over this run's: 1.0 is a run that lost nothing, checkpoints cost nothing), checkpoints
committed, lost (committed, then unreadable or passed over by a restore: must be 0), wrong (a
restored state or a stored checkpoint that differs from what the uninterrupted run had at that step:
must be 0), hangs (no step and no exit within ``--hang-s``: must be 0), and whether the final state
(weights and AdamW's state, every rank) equals the uninterrupted run's bit for bit. Training is
deterministic (data seeded per step and rank), so the uninterrupted run (``none``: no checkpoints, run
after the others to the furthest step any reached) gives every step's expected hash.

    .venv/bin/python bench/goodput.py --duration 180 --seed 1                        # as root
    .venv/bin/python bench/goodput.py --duration 180 --seed 1 --storage disk
    .venv/bin/python bench/goodput.py --duration 60 --strategies peer --kinds rank_kill,preempt
    .venv/bin/python bench/goodput.py --realistic --seed 1 --json bench/results/goodput-realistic-s3.json

Writes ``--json`` (default ``bench/results/goodput-<storage>.json``) and, with ``--plots PREFIX``,
``PREFIX-timeline.png`` and ``PREFIX-recovery.png`` (``bench/goodput_plot.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_DIR)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import goodput_faults as gf  # noqa: E402

WORKER = Path(__file__).with_name("goodput_worker.py")
STRATEGIES = ("storage", "memory", "peer", "dcp")
NODES = 2
FOLDERS = ("dcp", "torchsave")  # the strategies that write ``ROOT/step_<n>`` folders (``goodput_savers.py``)
# ``--realistic``: a state of ~1.2 GB per rank (a DDP MLP of 8 layers 4096 wide with AdamW: 101 M
# parameters, 12 bytes each with the optimizer's moments), steps of ~1.5 s of real compute on one
# core each, memory every step, storage every 25, failures every 30-90 s, the root on an ext4 image.
# DDP, not FSDP2: gloo on this CPU moves FSDP2's gathers so slowly that a step of the same state
# takes 5 s, most of it in the transport.
REALISTIC = dict(width=4096, depth=8, batch=16, parallel="ddp", step_ms=1000.0, every=25, budget="3GiB",
                 shm="8g", gap_s="30,90", window_s="10,30", disk_fs="ext4", disk_mb=16384, duration=300.0,
                 hang_s=300.0, strategies="torchsave,dcp,storage,memory,peer")
PHASES = ("detection", "relaunch", "imports", "group", "build", "open", "restore", "first_step")


class Tail:
    """New complete lines of the ranks' event files, as they come."""

    def __init__(self, out: Path) -> None:
        self.out, self.offsets, self.events, self.current = out, {}, [], {}

    def read(self) -> list[dict[str, Any]]:
        new = []
        for rank in range(NODES):
            path = self.out / f"events-r{rank}.jsonl"
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets.get(rank, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[rank] = self.offsets.get(rank, 0) + end
            for line in data[:end].splitlines():
                event = {**json.loads(line), "rank": rank}
                if event["event"] == "start":  # a rank's lines come in order, each launch opening with its start
                    self.current[rank] = event["launch"]
                event["launch"] = self.current.get(rank, 0)
                new.append(event)
        self.events += new
        return new


class Hang(Exception):
    pass


class Chaos:
    """One strategy's run: launches, the failures, the events."""

    def __init__(self, args: argparse.Namespace, strategy: str, work: Path, root: str, env: dict[str, str],
                 proxy: Any, disk: gf.Disk | None) -> None:
        from harness.servers import free_port

        self.args, self.strategy, self.root, self.env, self.proxy, self.disk = args, strategy, root, env, proxy, disk
        self.out, self.logs = work / "out", work / "logs"
        self.out.mkdir(parents=True)
        self.tail, self.port, self.launch_no, self.job = Tail(self.out), free_port(), 0, None
        self.hangs, self.unplanned, self.launches = 0, [], []

    # -- the job --------------------------------------------------------------------------------------------------
    def launch(self, cluster: Any, max_steps: int | None = None, full_hash: bool = False,
               step_ms: float | None = None) -> None:
        self.launch_no += 1
        a = self.args
        argv = ["--strategy", self.strategy, "--root", self.root, "--out", str(self.out), "--every", str(a.every),
                "--step-ms", str(a.step_ms if step_ms is None else step_ms), "--width", str(a.width),
                "--depth", str(a.depth), "--batch", str(a.batch), "--parallel", a.parallel, "--budget", a.budget,
                "--launch", str(self.launch_no)]
        if max_steps is not None:
            argv += ["--max-steps", str(max_steps)]
        if full_hash:
            argv.append("--full-hash")
        self.launches.append(time.time())
        self.job = cluster.launch(WORKER, argv, env=self.env, log_dir=self.logs, master_port=self.port)

    def ended(self) -> bool:
        return self.job is not None and all(a.poll() is not None for a in self.job.agents)

    def last(self, event: str, rank: int = 0, launch: int | None = None) -> dict[str, Any] | None:
        launch = self.launch_no if launch is None else launch
        for e in reversed(self.tail.events):
            if e["event"] == event and e["rank"] == rank and self.launch_of(e) == launch:
                return e
        return None

    @staticmethod
    def launch_of(event: dict[str, Any]) -> int:
        return event["launch"]

    def last_step(self) -> int | None:
        steps = [e["step"] for e in self.tail.events if e["event"] == "step" and e["rank"] == 0]
        return steps[-1] if steps else None

    def watch(self, until: float, cluster: Any, *, resume_after: float | None = None) -> float | None:
        """Follow the job until ``until`` (or, with ``resume_after``, until rank 0 steps after that time: its
        time). A job that ends unasked is relaunched (noted); no step for ``--hang-s`` is a hang."""
        progress = time.time()
        while True:
            new = self.tail.read()
            now = time.time()
            if any(e["event"] == "step" for e in new):
                progress = now
            if resume_after is not None:
                for e in new:  # a step of this launch (a preempted job steps once more before it exits)
                    if e["event"] == "step" and e["rank"] == 0 and e["t"] > resume_after \
                            and self.launch_of(e) == self.launch_no:
                        return e["t"]
            elif now >= until:
                return None
            if self.ended():
                codes = [a.returncode for a in self.job.agents]
                self.unplanned.append({"t": now, "codes": codes, "logs": self.job.logs(tail=2500)})
                if len(self.unplanned) >= 3 and all(now - u["t"] < 60 for u in self.unplanned[-3:]):
                    raise RuntimeError(f"{self.strategy}: the job ended unasked 3 times within a minute; logs end:\n"
                                       f"{self.unplanned[-1]['logs']}")
                print(f"  [{self.strategy}] the job ended unasked ({codes}); relaunching", file=sys.stderr, flush=True)
                self.job.kill()
                self.launch(cluster)
                progress = time.time()
            elif now - progress > self.args.hang_s:
                self.hangs += 1
                self.unplanned.append({"t": now, "hang": True, "logs": self.job.logs(tail=4000)})
                print(f"  [{self.strategy}] HANG: no step for {self.args.hang_s:.0f} s; relaunching", file=sys.stderr,
                      flush=True)
                for a in self.job.agents:  # the stacks of every thread into the logs (faulthandler on SIGUSR1)
                    os.killpg(a.pid, signal.SIGUSR1) if a.poll() is None else None
                time.sleep(1)
                self.job.kill()
                self.launch(cluster)
                progress = time.time()
            time.sleep(0.05)

    # -- one failure ----------------------------------------------------------------------------------------------
    def inject(self, f: gf.Failure, cluster: Any, rng: Any) -> None:
        f.last_step, f.at, before = self.last_step(), time.time(), self.launch_no
        print(f"  [{self.strategy}] t={f.at - self.launches[0]:6.1f}s #{f.index} {f.kind} {f.compound} target={f.target} "
              f"window={f.window_s}s at step {f.last_step}", file=sys.stderr, flush=True)
        if f.kind in gf.HARD:
            self.hard(f, f.kind, cluster)
            if f.compound == "in_restart":
                self.watch(time.time() + f.param, cluster)
                f.notes.append(f"{f.kind} again {f.param} s after the relaunch")
                self.hard(f, f.kind, cluster)
            return self.resumed(f, cluster, before)
        f.steps_lost, f.recovery_s = 0, None
        if f.kind == "uploader_kill":
            path = self.out / f"uploaders-r{f.target}.json"
            pids = json.loads(path.read_text()) if path.exists() else []
            if not pids:
                f.skipped = "no uploader process (this strategy has none)"
                return None
            try:
                os.kill(rng.choice(pids), signal.SIGKILL)
            except ProcessLookupError:
                f.notes.append("the uploader had ended already")
            return None
        if f.kind in gf.SOFT_S3 and self.proxy is None or f.kind in gf.SOFT_DISK and self.disk is None:
            f.skipped = "not available for this storage"
            return None
        gf.start_soft(f, proxy=self.proxy, disk=self.disk)
        try:
            if f.compound == "kill_during":
                self.watch(f.at + f.window_s / 3, cluster)
                f.notes.append(f"rank {f.target} killed {f.window_s / 3:.1f} s into the outage")
                self.hard(f, "rank_kill", cluster)
            self.watch(f.at + f.window_s, cluster)
        finally:
            gf.end_soft(f, proxy=self.proxy, disk=self.disk)
        if f.compound == "kill_during":
            self.resumed(f, cluster, before)
        return None

    def resumed(self, f: gf.Failure, cluster: Any, before: int) -> None:
        """After a failure that ended the job: when it trained again, from which step and source, what it lost."""
        resumed = self.watch(0, cluster, resume_after=f.at)
        assert resumed is not None
        restored = [self.last("restored", r) for r in range(NODES)]
        deadline = time.monotonic() + 5  # the other rank's line may come a moment later
        while None in restored and time.monotonic() < deadline:
            time.sleep(0.05)
            self.tail.read()
            restored = [self.last("restored", r) for r in range(NODES)]
        trained = [e["step"] for e in self.tail.events if e["event"] == "step" and e["rank"] == 0
                   and before <= self.launch_of(e) < self.launch_no]  # a preempted job's last step included
        f.last_step = max(trained, default=f.last_step)
        f.restored_step = restored[0]["step"] if restored[0] else None
        f.sources = [r["source"] if r else None for r in restored]
        f.steps_lost = (f.last_step if f.last_step is not None else -1) - (
            f.restored_step if f.restored_step is not None else -1)
        f.recovery_s = resumed - f.at
        f.breakdown = self.breakdown(f.at, resumed)

    def breakdown(self, failed_at: float, resumed: float) -> dict[str, float]:
        """The failure to rank 0's first step after it, by phase: ``detection`` (to the relaunch: this tool
        relaunches as soon as the job is gone; for a preemption, the final save and exit), ``relaunch``
        (torchrun, the rendezvous, the interpreter's start), ``imports``, ``group`` (the process group),
        ``build`` (model and optimizer), ``open`` (the checkpointer), ``restore``, ``first_step``."""
        start, built, opened, restored = (self.last(e) for e in ("start", "built", "opened", "restored"))
        if None in (start, built, opened, restored):
            return {}
        marks = [failed_at, self.launches[-1], start["python"], start["imported"], start["t"], built["t"],
                 opened["t"], restored["t"], resumed]
        out = {phase: marks[i + 1] - marks[i] for i, phase in enumerate(PHASES)}
        first = restored["step"] + 1 if restored["step"] is not None else 0
        deadline = time.monotonic() + 30  # the first save comes after the step that resumed
        while time.monotonic() < deadline and not self.ended():
            saved = [e for e in self.tail.events if e["event"] == "saved" and e["rank"] == 0 and e["step"] == first
                     and self.launch_of(e) == self.launch_no]
            if saved:
                out["first_save"] = saved[0]["s"]
                break
            time.sleep(0.05)
            self.tail.read()
        return out

    def hard(self, f: gf.Failure, kind: str, cluster: Any) -> None:
        assert self.job is not None
        if kind == "rank_kill":
            start = self.last("start", f.target)
            if start is not None:
                try:
                    os.kill(start["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    f.notes.append("the rank had ended already")
            self.job.kill()  # torchrun without restarts stops the job; the scheduler relaunches it
        elif kind == "node_loss":
            cluster.nodes[f.target].lose()
            self.job.kill()
            cluster.replace(f.target)
        elif kind == "preempt":
            for r in range(NODES):
                start = self.last("start", r)
                if start is not None:
                    try:
                        os.kill(start["pid"], signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            try:
                codes = self.job.wait(self.args.hang_s)
                if codes != [0] * NODES:
                    f.notes.append(f"agents exited {codes} after SIGTERM")
            except TimeoutError:
                self.hangs += 1
                f.notes.append(f"HANG: the preempted job did not exit within {self.args.hang_s:.0f} s")
        self.launch(cluster)

    def stop(self) -> None:
        """The stop file: every rank stops at the same step and closes; bounded by ``--hang-s``."""
        (self.out / "stop").write_text("")
        try:
            codes = self.job.wait(self.args.hang_s)
            if codes != [0] * NODES:
                self.unplanned.append({"t": time.time(), "codes": codes, "logs": self.job.logs(tail=2500)})
        except TimeoutError as e:
            self.hangs += 1
            self.unplanned.append({"t": time.time(), "hang": True, "logs": str(e)[-4000:]})
        self.tail.read()


def chaos_run(args: argparse.Namespace, strategy: str, schedule: list[gf.Failure], work: Path, storage: Any) -> dict:
    import random

    from harness.nodes import Cluster

    root, env = storage.root_for(strategy, work)
    run = Chaos(args, strategy, work, root, env, storage.proxy, storage.disk)
    failures = [gf.Failure(**{k: v for k, v in f.as_dict().items()}) for f in schedule]
    rng = random.Random(args.seed)
    print(f"[goodput] {strategy}: {args.duration:.0f} s, storage {args.storage}", file=sys.stderr, flush=True)
    done: list[gf.Failure] = []
    with Cluster(NODES, shm_size=args.shm, name_prefix=f"gp{strategy[:3]}") as cluster:
        run.launch(cluster)
        t0 = run.launches[0]
        resumed = run.watch(0, cluster, resume_after=0)
        end = t0 + args.duration
        for f in failures:
            if time.time() + f.gap_s > end:
                break
            if args.failures and len(done) >= args.failures:
                end = time.time() + f.gap_s  # a last stretch of training, then stop
                break
            run.watch(max(resumed or 0, time.time()) + f.gap_s, cluster)
            run.inject(f, cluster, rng)
            done.append(f)
            resumed = run.watch(0, cluster, resume_after=time.time())
        run.watch(end, cluster)
        run.stop()
    storage.after(strategy)
    return {"strategy": strategy, "root": root, "events": run.tail.events, "failures": [f.as_dict() for f in done],
            "launches": run.launches, "hangs": run.hangs, "unplanned": run.unplanned}


class Storage:
    """S3 (moto behind the fault proxy) or a small tmpfs root (``ctl://``)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.kind, self.work, self.proxy, self.disk, self.moto, self.endpoint = args.storage, work, None, None, None, None
        self.skipped: dict[str, str] = {}
        if self.kind == "s3":
            from peer_recovery import start_moto

            from harness.fault_proxy import FaultProxy

            self.moto, self.endpoint = start_moto(str(work))
            self.proxy = FaultProxy(int(self.endpoint.rsplit(":", 1)[1]), seed=args.seed, stall_s=30).start()
        else:
            self.disk = gf.Disk(work / "disk", args.disk_mb, args.disk_fs)
            why = self.disk.mount()
            if why:
                self.disk = None
                self.skipped = {k: why for k in gf.SOFT_DISK}

    def root_for(self, strategy: str, work: Path) -> tuple[str, dict[str, str]]:
        from harness.servers import s3_options

        if strategy == "none":
            return str(work / f"none-{uuid.uuid4().hex[:6]}"), {}
        if strategy in FOLDERS and self.kind == "disk":  # a plain path (``ctl://`` is mpckpt's test backend)
            return str((self.disk.where if self.disk is not None else work) / f"{strategy}-{uuid.uuid4().hex[:6]}"), {}
        if self.kind == "s3":
            import s3fs

            bucket = f"goodput-{strategy}-{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(**s3_options(self.endpoint), skip_instance_cache=True).mkdir(bucket)
            options = s3_options(f"http://127.0.0.1:{self.proxy.port}")
            return f"s3://{bucket}/run", {"GOODPUT_STORAGE_OPTIONS": json.dumps(options)}
        where = (self.disk.where if self.disk is not None else work) / strategy
        options = {"slow_file": str(self.disk.slow_file)} if self.disk is not None else {}
        return f"ctl://{where}", {"GOODPUT_STORAGE_OPTIONS": json.dumps(options)}

    def read_options(self) -> dict[str, Any] | None:
        from harness.servers import s3_options

        return s3_options(self.endpoint) if self.kind == "s3" else None

    def after(self, strategy: str) -> None:
        if self.proxy is not None:
            self.proxy.clear()
        if self.disk is not None:
            self.disk.unfill()
            self.disk.fast()

    def close(self) -> None:
        from harness.servers import stop_server

        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            stop_server(self.moto)
        if self.disk is not None:
            self.disk.unmount()


def reference_run(args: argparse.Namespace, steps: int, work: Path) -> dict:
    from harness.nodes import Cluster

    run = Chaos(args, "none", work, str(work / "none"), {}, None, None)
    print(f"[goodput] the uninterrupted run: {steps} steps", file=sys.stderr, flush=True)
    with Cluster(NODES, shm_size="256m", name_prefix="gpref") as cluster:
        run.launch(cluster, max_steps=steps, full_hash=True, step_ms=args.reference_step_ms)
        codes = run.job.wait(args.hang_s + steps * (args.step_ms / 1e3 + 1.0))
        run.tail.read()
    if codes != [0] * NODES:
        raise RuntimeError(f"the uninterrupted run failed ({codes}): {run.job.logs(tail=4000)}")
    return {"events": run.tail.events, "launch": run.launches[0]}


def main() -> None:
    import goodput_report as report

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--realistic", action="store_true",
                        help="a state of ~1.2 GB per rank, ~1.5 s steps: defaults " + json.dumps(REALISTIC))
    parser.add_argument("--duration", type=float, default=180, help="seconds of failures per strategy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--failures", type=int, default=0,
                        help="stop after this many failures (and a last gap of training), before --duration if sooner")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--storage", choices=["s3", "disk"], default="s3")
    parser.add_argument("--kinds", help="only these failure kinds (default: every kind the storage allows)")
    parser.add_argument("--gap-s", default="4,12", help="wait before each failure, after training resumed: MIN,MAX")
    parser.add_argument("--window-s", default="3,10", help="how long a storage or disk failure lasts: MIN,MAX")
    parser.add_argument("--every", type=int, default=10, help="storage saves every N steps")
    parser.add_argument("--step-ms", type=float, default=100)
    parser.add_argument("--reference-step-ms", type=float,
                        help="the uninterrupted run's pacing (default --step-ms; 0 is faster, its goodput meaningless)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3, help="Linear layers")
    parser.add_argument("--batch", type=int, default=8, help="rows per step and rank")
    parser.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--budget", default="256MiB", help="mpckpt's memory_budget")
    parser.add_argument("--shm", default="512m", help="each simulated node's /dev/shm")
    parser.add_argument("--disk-mb", type=int, default=32)
    parser.add_argument("--disk-fs", choices=["tmpfs", "ext4"], default="tmpfs",
                        help="the disk storage's filesystem (ext4: an image on the machine's disk)")
    parser.add_argument("--hang-s", type=float, default=120)
    parser.add_argument("--work", help="a folder for roots, events and logs (default: a fresh one, removed)")
    parser.add_argument("--json")
    parser.add_argument("--plots", help="write PREFIX-timeline.png and PREFIX-recovery.png")
    if parser.parse_known_args()[0].realistic:
        parser.set_defaults(**REALISTIC)
    args = parser.parse_args()
    if "torchsave" in args.strategies.split(",") and args.parallel != "ddp":
        raise SystemExit("goodput: the torchsave strategy saves a DDP model: add --parallel ddp")

    from harness.nodes import namespaces_unavailable

    if (why := namespaces_unavailable()) is not None:
        raise SystemExit(f"goodput: {why}")
    args.json = args.json or os.path.join(REPO_DIR, "bench", "results", f"goodput-{args.storage}.json")
    work = Path(args.work) if args.work else Path(REPO_DIR) / "bench" / "results" / f"goodput-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True, exist_ok=True)
    kinds = gf.kinds_for(args.storage, args.kinds.split(",") if args.kinds else None)
    gap, window = (tuple(float(x) for x in s.split(",")) for s in (args.gap_s, args.window_s))
    count = max(int(args.duration / gap[0]), args.failures) + len(kinds)
    schedule = gf.draw(args.seed, kinds, count, world=NODES, nodes=NODES, gap_s=gap, window_s=window)  # type: ignore[arg-type]
    strategies = [s for s in args.strategies.split(",") if s]
    result: dict[str, Any] = {"command": " ".join(sys.argv), "seed": args.seed, "storage": args.storage,
                              "duration_s": args.duration, "kinds": kinds, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "runs": []}
    storage = Storage(args, work)
    result["skipped_kinds"] = storage.skipped
    try:
        for strategy in strategies:
            run = chaos_run(args, strategy, schedule, work / strategy, storage)
            result["runs"].append(run)
        furthest = max(report.final_step(r) or 0 for r in result["runs"])
        result["reference"] = reference_run(args, furthest + 1, work / "reference")
        for run in result["runs"]:
            run["summary"] = report.summarize(run, result["reference"], storage.read_options())
    finally:
        storage.close()
        if not args.work and not os.environ.get("GOODPUT_KEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)
    report.write(result, args.json)
    print(report.tables(result))
    if args.plots:
        import goodput_plot

        goodput_plot.draw(result, args.plots)
    print(f"\nresults: {args.json}")


if __name__ == "__main__":
    main()
