"""How long a trainer takes to train again after a SIGKILL, and how many steps a crash loses.

Every trainer is a fresh process of this script (``--trainer``): it imports torch, builds the
house workload (``_harness``: ``nn.Linear`` layers with Adam, the moments included in the
size), restores the newest checkpoint if there is one, then trains, saving as its strategy
says, and prints one line per step once that step's save has returned (``STEP n time.time()``).
The bench reads those lines and SIGKILLs the trainer (its uploaders are left to notice alone,
as after a real crash), then starts the restarted trainer at once.

(a) ``restart``: time from the SIGKILL to the first completed training step of the restarted
    process (its ``time.time()`` minus the bench's, taken as the kill returned): the trainer
    (``--gib`` GiB) saves every step and is killed right after it reports the save of step
    ``--kill-after``. Subjects, interleaved, ``--reps`` each, each repetition in a fresh root:

    - ``mpckpt``: ``save(mode="async")`` every step, ``keep_in_memory`` on (the default): the
      restart restores from this node's memory;
    - ``mpckpt_storage``: the same with ``keep_in_memory=False``: the restart restores the
      newest step committed to storage;
    - ``dcp``: ``dcp.save`` of ``get_state_dict`` every step (synchronous), the restart
      ``dcp.load`` + ``set_state_dict`` of the newest complete step.

    Reported: the median seconds, each run's, where they went (start + import + build, open +
    restore, the first step), and the step each restart resumed from against the step its
    trainer was killed after.

(b) ``lost``: steps a crash loses with an upload every ``--every`` steps, on a busy CPU (a small
    model, ``--lost-hidden`` wide, with torch on 2 threads: every core trains, steps of tens
    of ms). One trainer per strategy is killed ``--kills`` times, each time after a random
    number of steps (1 to 3 x ``--every``, the same seeded draws for every strategy) past the
    step it resumed from, and restarted; a kill loses ``killed after - resumed from`` steps.

    - ``storage_every_n``: ``save(mode="async")`` every ``--every`` steps, ``keep_in_memory=False``;
    - ``memory_every_step``: ``save(mode="memory")`` every step, ``mode="async"`` every ``--every``.

Figures are medians. Other processes' CPU use while a part ran is reported (``foreign CPU %``).
Snapshots kept in memory for the bench's roots are removed at the end. ``mpckpt gc`` run by this
user on this node between a kill and its restart removes the killed trainer's kept snapshot
(no process keeps it then): the restart then restores from storage, as the table shows.

    .venv/bin/python bench/crash_restart.py --gib 1                      # both parts
    .venv/bin/python bench/crash_restart.py --parts lost --every 10 --kills 5
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import _harness as h
import psutil

RESTART_SUBJECTS = ("mpckpt", "mpckpt_storage", "dcp")
LOST_STRATEGIES = ("storage_every_n", "memory_every_step")
LABELS = {"mpckpt": "mpckpt (async every step, kept in memory)",
          "mpckpt_storage": "mpckpt, keep_in_memory=False (async every step)",
          "dcp": "DCP (dcp.save every step, synchronous)",
          "storage_every_n": "storage only: async every N, keep_in_memory=False",
          "memory_every_step": "memory every step + async every N"}
RESTART_COLUMNS = [("what", "trainer", 0), ("median_s", "kill to first step s", 2), ("runs_s", "runs s", 0),
                   ("start_s", "start + import + build s", 2), ("restore_s", "open + restore s", 2),
                   ("first_step_s", "first step s", 2), ("step_s", "step + save s (before)", 2),
                   ("resumed", "resumed from / killed after", 0), ("source", "restored from", 0),
                   ("foreign_cpu_pct", "other procs CPU %", 0)]
LOST_COLUMNS = [("what", "strategy", 0), ("kills", "kills", 0), ("lost_median", "steps lost (median)", 1),
                ("lost_max", "(max)", 0), ("lost", "lost per kill", 0), ("source", "restored from", 0),
                ("step_ms", "step ms (median)", 1), ("restart_s", "kill to first step s (median)", 2),
                ("foreign_cpu_pct", "other procs CPU %", 0)]
TIMEOUT_S = 600.0


# -- the trainer (a child process) -------------------------------------------------------------
def say(*fields: Any) -> None:
    sys.stdout.write(" ".join(str(f) for f in fields) + "\n")
    sys.stdout.flush()


def mode_for(subject: str, step: int, every: int) -> str | None:
    """The save a strategy makes after ``step``: an UploadMode value, or None for no save."""
    if subject in ("mpckpt", "mpckpt_storage", "dcp"):
        return "async"  # (DCP's save is synchronous whatever this says)
    if subject == "storage_every_n":
        return "async" if step % every == 0 else None
    if subject == "memory_every_step":
        return "async" if step % every == 0 else "memory"
    raise ValueError(subject)


class MpckptTrainerCkpt:
    """A trainer's mpckpt Checkpointer (``keep_in_memory`` off for the storage-only subjects)."""

    def __init__(self, root: str, subject: str, uploader_priority: str | None) -> None:
        import mpckpt

        keep = subject not in ("mpckpt_storage", "storage_every_n")
        self.ckpt = mpckpt.Checkpointer(root, keep_in_memory=keep, keep_last=2, uploader_priority=uploader_priority)

    def restore(self, state: dict[str, Any]) -> tuple[int, str]:
        step = self.ckpt.restore(state)
        last = self.ckpt.last_restore
        return (0, "none") if step is None or last is None else (step, last.source)

    def save(self, step: int, state: dict[str, Any], mode: str) -> None:
        self.ckpt.save(step, state, mode=mode)

    def close(self) -> None:
        self.ckpt.close()  # a plain close: nothing is left in memory for a next process


class DcpTrainerCkpt:
    """A trainer's torch.distributed.checkpoint saves: one folder per step, the newest two kept."""

    def __init__(self, root: str, subject: str, uploader_priority: str | None) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _complete(self) -> list[int]:
        """Steps whose folder has DCP's ``.metadata`` (written once every shard is)."""
        return sorted(int(n[5:]) for n in os.listdir(self.root)
                      if n.startswith("step_") and os.path.exists(os.path.join(self.root, n, ".metadata")))

    def restore(self, state: dict[str, Any]) -> tuple[int, str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        steps = self._complete()
        if not steps:
            return 0, "none"
        model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=self._folder(steps[-1]))  # in place
        set_state_dict(state["model"], state["optim"], model_state_dict=model_sd, optim_state_dict=optim_sd)
        return steps[-1], "storage"

    def save(self, step: int, state: dict[str, Any], mode: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(state["model"], state["optim"])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=self._folder(step))
        for old in self._complete()[:-2]:
            shutil.rmtree(self._folder(old), ignore_errors=True)

    def _folder(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def close(self) -> None:
        pass


def trainer(args: argparse.Namespace) -> None:
    """Build, restore, then train and save until killed, told ``stop`` on stdin, or ``--max-steps``."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process
    torch.set_num_threads(args.threads)
    work = h.fresh_workload(args.gib, hidden=args.hidden, batch=args.batch)
    say("READY", time.time())
    store = (DcpTrainerCkpt if args.trainer == "dcp" else MpckptTrainerCkpt)(args.dir, args.trainer,
                                                                             args.uploader_priority)
    step, source = store.restore(work.state)
    say("RESUMED", step, source, time.time())
    stop = threading.Event()

    def wait_for_stop() -> None:  # "stop" from the bench, or its end (stdin closes)
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    while not stop.is_set() and step < args.max_steps:
        h.train_step(work)
        step += 1
        if args.first_step_only:
            say("STEP", step, time.time())
            break
        mode = mode_for(args.trainer, step, args.every)
        if mode is not None:
            store.save(step, work.state, mode)
        say("STEP", step, time.time())
    store.close()
    say("DONE", step)


# -- the bench's side of a trainer ---------------------------------------------------------------
class Trainer:
    """A trainer process the bench started; its lines are read on a thread, in order."""

    pids: list[int] = []  # of every trainer started: what they leave in /dev/shm is named after them

    def __init__(self, args: argparse.Namespace, subject: str, root: str, *, first_step_only: bool = False,
                 cpu: h.TreeCpu | None = None) -> None:
        small = subject in LOST_STRATEGIES
        argv = [sys.executable, os.path.abspath(__file__), "--trainer", subject, "--dir", root,
                "--gib", str(args.lost_mib / 1024 if small else args.gib),
                "--hidden", str(args.lost_hidden if small else 2048), "--batch", str(args.lost_batch if small else 16),
                "--threads", str(2 if small else args.threads), "--every", str(args.every),
                "--max-steps", str(args.max_steps)]
        if args.uploader_priority:
            argv += ["--uploader-priority", args.uploader_priority]
        if first_step_only:
            argv.append("--first-step-only")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=h.REPO_DIR)
        Trainer.pids.append(self.proc.pid)
        self.lines: queue.Queue[list[str]] = queue.Queue()
        self.steps: list[tuple[int, float]] = []  # (step, time) of every STEP line read so far
        if cpu is not None:
            cpu.watch(self.proc.pid)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            fields = line.split()
            if fields and fields[0] in ("READY", "RESUMED", "STEP", "DONE"):
                self.lines.put(fields)
            else:
                sys.stderr.write(line)

    def next(self, kind: str, timeout_s: float = TIMEOUT_S) -> list[str]:
        """The next line of ``kind`` (earlier lines of other kinds are passed over, STEP lines kept)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fields = self.lines.get(timeout=0.5)
            except queue.Empty:
                ended = self.proc.poll() is not None and self.lines.empty()
                if ended or time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer (pid {self.proc.pid}) printed no {kind} line "
                                       f"{'before it ended with status ' if ended else 'in '}"
                                       f"{self.proc.returncode if ended else f'{timeout_s:.0f} s'}") from None
                continue
            if fields[0] == "STEP":
                self.steps.append((int(fields[1]), float(fields[2])))
            if fields[0] == "DONE" and kind != "DONE":
                raise RuntimeError(f"the trainer (pid {self.proc.pid}) ended at step {fields[1]} before a {kind} line")
            if fields[0] == kind:
                return fields

    def until_step(self, step: int) -> None:
        while not self.steps or self.steps[-1][0] < step:
            self.next("STEP")

    def kill(self) -> tuple[float, list[psutil.Process]]:
        """SIGKILL the trainer alone; return when the kill returned and the processes it had."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        self.proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        self.proc.wait()
        return killed_at, tree

    def killed_after(self) -> int:
        """The last step it reported (lines still queued from before the kill included)."""
        while not self.lines.empty():
            fields = self.lines.get()
            if fields[0] == "STEP":
                self.steps.append((int(fields[1]), float(fields[2])))
        return self.steps[-1][0] if self.steps else 0

    def stop(self) -> None:
        """Ask it to close and end (a clean close: nothing left kept in memory)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        self.next("DONE")
        self.proc.wait(timeout=TIMEOUT_S)

    def step_seconds(self) -> list[float]:
        return [b - a for (_, a), (_, b) in zip(self.steps, self.steps[1:], strict=False)]


def wait_gone(procs: list[psutil.Process], timeout_s: float = 60) -> list[str]:
    """Wait for a killed trainer's processes to end by themselves; SIGKILL (and name) those that do not."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    left = []
    for p in alive:
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            p.kill()
        except psutil.Error:
            pass
    return left


# -- (a) restart after a SIGKILL -----------------------------------------------------------------
def restart_case(args: argparse.Namespace, subject: str, folder: str, cpu: h.TreeCpu) -> dict[str, Any]:
    """One repetition: train in a fresh root, kill after the save of ``--kill-after``, restart, time it."""
    root = tempfile.mkdtemp(prefix=f"{subject}-", dir=folder)
    try:
        first = Trainer(args, subject, root, cpu=cpu)
        first.until_step(args.kill_after)
        killed_at, tree = first.kill()
        again = Trainer(args, subject, root, first_step_only=True, cpu=cpu)
        ready = float(again.next("READY")[1])
        resumed = again.next("RESUMED")
        stepped = float(again.next("STEP")[2])
        again.next("DONE")
        again.proc.wait(timeout=TIMEOUT_S)
        killed_after = first.killed_after()
        left = wait_gone(tree)
        steps = first.step_seconds()
        return {"subject": subject, "seconds": stepped - killed_at, "start_s": ready - killed_at,
                "restore_s": float(resumed[3]) - ready, "first_step_s": stepped - float(resumed[3]),
                "step_s": h.median(steps[1:]) if len(steps) > 1 else None,
                "killed_after": killed_after, "resumed": int(resumed[1]), "source": resumed[2],
                "left_running": left}
    finally:
        h.remove_kept_in_memory([root])
        shutil.rmtree(root, ignore_errors=True)


def restart_part(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    subjects = [s for s in args.restart_subjects.split(",") if s]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in subjects}
    for rep in range(args.reps):
        for subject in subjects:
            busy = h.wait_for_quiet(args.wait_quiet_s)
            print(f"[crash_restart] restart {subject} ({rep + 1}/{args.reps}) ...", file=sys.stderr, flush=True)
            with h.TreeCpu() as cpu:
                result = restart_case(args, subject, folder, cpu)
            runs[subject].append({**result, "busy_before_pct": busy, "foreign_cpu_pct": cpu.foreign_pct()})
    rows = []
    for subject, results in runs.items():
        def mid(key: str, results: list[dict[str, Any]] = results) -> float:
            return h.median([r[key] for r in results if r[key] is not None])

        rows.append({"what": LABELS[subject], "subject": subject, "median_s": mid("seconds"),
                     "runs_s": ", ".join(f"{r['seconds']:.2f}" for r in results), "start_s": mid("start_s"),
                     "restore_s": mid("restore_s"), "first_step_s": mid("first_step_s"), "step_s": mid("step_s"),
                     "resumed": ", ".join(f"{r['resumed']}/{r['killed_after']}" for r in results),
                     "source": ", ".join(sorted({r["source"] for r in results})),
                     "foreign_cpu_pct": max(r["foreign_cpu_pct"] for r in results),
                     "left_running": [x for r in results for x in r["left_running"]]})
    return {"rows": rows, "runs": runs}


# -- (b) work lost per crash ---------------------------------------------------------------------
def lost_strategy(args: argparse.Namespace, strategy: str, folder: str) -> dict[str, Any]:
    """One trainer killed ``--kills`` times at seeded random steps, restarted after each kill."""
    root = tempfile.mkdtemp(prefix=f"{strategy}-", dir=folder)
    draws = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    step_s: list[float] = []
    busy = h.wait_for_quiet(args.wait_quiet_s)
    try:
        with h.TreeCpu() as cpu:
            current, resumed = Trainer(args, strategy, root, cpu=cpu), 0
            for _ in range(args.kills):
                target = resumed + draws.randint(1, 3 * args.every)
                current.until_step(target)
                killed_at, tree = current.kill()
                previous, current = current, Trainer(args, strategy, root, cpu=cpu)
                fields = current.next("RESUMED")
                restarted = float(current.next("STEP")[2]) - killed_at
                killed_after, resumed = previous.killed_after(), int(fields[1])
                step_s += previous.step_seconds()
                kills.append({"killed_after": killed_after, "resumed": resumed, "lost": killed_after - resumed,
                              "source": fields[2], "restart_s": restarted, "left_running": wait_gone(tree)})
            current.stop()
            step_s += current.step_seconds()
        foreign = cpu.foreign_pct()
    finally:
        h.remove_kept_in_memory([root])
        shutil.rmtree(root, ignore_errors=True)
    lost = [k["lost"] for k in kills]
    return {"what": LABELS[strategy], "strategy": strategy, "kills": len(kills), "lost_median": h.median(lost),
            "lost_max": max(lost), "lost": ", ".join(str(n) for n in lost),
            "source": ", ".join(sorted({k["source"] for k in kills})), "step_ms": 1e3 * h.median(step_s),
            "restart_s": h.median([k["restart_s"] for k in kills]), "foreign_cpu_pct": foreign,
            "busy_before_pct": busy, "runs": kills}


def lost_part(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    rows = []
    for strategy in [s for s in args.strategies.split(",") if s]:
        print(f"[crash_restart] lost work: {strategy} ...", file=sys.stderr, flush=True)
        rows.append(lost_strategy(args, strategy, folder))
    return {"rows": rows}


# -- the bench -----------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder, remove = h.target_dir(args.dir, "crash-restart-")
    shm_before = set(os.listdir("/dev/shm"))
    result: dict[str, Any] = {"benchmark": "crash_restart", "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                              "machine": h.machine_info()}
    try:
        if "restart" in args.parts:
            result["restart"] = restart_part(args, folder)
        if "lost" in args.parts:
            result["lost"] = lost_part(args, folder)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    result["shm_left"] = left_in_shm(shm_before, folder)
    return result


def left_in_shm(before: set[str], folder: str) -> list[str]:
    """What the bench's trainers left in /dev/shm: segments named after their pids, snapshots kept
    for roots under ``folder`` (others' files that came meanwhile are not the bench's)."""
    from mpckpt._keep.store import list_kept

    ours = tuple(f"mpckpt-{pid}-" for pid in Trainer.pids)
    kept = {k.base for k in list_kept() if k.root is not None and k.root.startswith(folder + os.sep)}
    return sorted(n for n in set(os.listdir("/dev/shm")) - before if n.startswith(ours) or n.startswith(tuple(kept)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="restart,lost", help="comma list of: restart, lost")
    p.add_argument("--gib", type=float, default=1.0, help="(a) state size: params + 2 Adam moments")
    p.add_argument("--reps", type=int, default=3, help="(a) repetitions per subject")
    p.add_argument("--kill-after", type=int, default=5, help="(a) kill right after the save of this step")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="(a) torch threads of the trainer")
    p.add_argument("--restart-subjects", default=",".join(RESTART_SUBJECTS), help="(a) comma list")
    p.add_argument("--every", type=int, default=10, help="(b) upload every this many steps")
    p.add_argument("--kills", type=int, default=5, help="(b) kills per strategy")
    p.add_argument("--seed", type=int, default=0, help="(b) of the random kill steps")
    p.add_argument("--strategies", default=",".join(LOST_STRATEGIES), help="(b) comma list")
    p.add_argument("--lost-mib", type=float, default=9.4, help="(b) state size in MiB (3 layers of 512)")
    p.add_argument("--lost-hidden", type=int, default=512, help="(b) width of the layers")
    p.add_argument("--lost-batch", type=int, default=1024, help="(b) rows per step (sets the step's compute)")
    p.add_argument("--uploader-priority", default=None, help="mpckpt's uploader_priority (default: mpckpt's, idle)")
    p.add_argument("--max-steps", type=int, default=100_000, help="a trainer ends by itself after this step")
    p.add_argument("--dir", default=None, help="where the roots go (default: a temporary folder under bench/results/)")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "crash_restart.json"))
    p.add_argument("--wait-quiet-s", type=float, default=20, help="wait up to this long for idle CPUs before each run")
    p.add_argument("--trainer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.every < 1 or args.kills < 1 or args.kill_after < 1:
        p.error("--every, --kills and --kill-after must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.trainer:
        return trainer(args)
    result = measure(args)
    h.write_json(args.out, result)
    if "restart" in result:
        print(f"(a) SIGKILL after the save of step {args.kill_after}, restart at once; {args.gib:g} GiB state, "
              f"medians of {args.reps}\n")
        print(h.markdown_table(result["restart"]["rows"], RESTART_COLUMNS))
    if "lost" in result:
        print(f"\n(b) {args.kills} kills per strategy at random steps, an upload every {args.every} steps, "
              f"{args.lost_mib:g} MiB state, torch on 2 threads\n")
        print(h.markdown_table(result["lost"]["rows"], LOST_COLUMNS))
    for row in [*result.get("restart", {}).get("rows", []), *result.get("lost", {}).get("rows", [])]:
        for left in row.get("left_running", []) + [x for k in row.get("runs", []) for x in k["left_running"]]:
            print(f"note: a killed trainer's process was still running a minute later and was killed: {left}")
    if result["shm_left"]:
        print(f"note: left in /dev/shm: {', '.join(result['shm_left'])}")
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
