"""The failures of ``bench/goodput.py``: a seeded schedule, and how each kind is injected and ended.

A schedule is a list of :class:`Failure` drawn from a ``random.Random(seed)``: kinds in blocks, each
block a shuffled permutation of every kind the run's storage allows (so each kind comes up as often
as the others), with the wait before each (``gap_s``, counted from the moment the job trains again),
the target (rank or node) and, for the failures that last, the window. The same seed gives the same
schedule to every strategy.

Some failures come in pairs, as they do in clusters: a rank or node killed again while the relaunched
job starts and restores (``in_restart``), a rank killed during a storage outage, so that the relaunched
job restores while storage is out (``kill_during``).

Kinds that end the job (the bench relaunches it on the same nodes, a fresh one in place of a lost
node, as a scheduler would): ``rank_kill`` (SIGKILL of one training process; the job is then killed,
as torchrun without restarts does), ``node_loss`` (every process of a node and its ``/dev/shm``),
``preempt`` (SIGTERM to every rank: each saves and exits). Kinds that do not (training goes on;
saves may fail and are retried by later saves): ``uploader_kill`` (SIGKILL of one uploader),
``storage_outage`` (every request to S3 reset or answered 503 for the window), ``storage_latency``
(every request delayed), ``disk_full`` (the root's filesystem filled but for a few KiB),
``disk_slow`` (every file written takes longer, through the ``ctl://`` backend's ``slow_file``).
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HARD = ("rank_kill", "node_loss", "preempt")
SOFT_ANY = ("uploader_kill",)
SOFT_S3 = ("storage_outage", "storage_latency")
SOFT_DISK = ("disk_full", "disk_slow")
ALL = HARD + SOFT_ANY + SOFT_S3 + SOFT_DISK


@dataclass
class Failure:
    index: int
    kind: str
    gap_s: float            # after the job trains again (after the previous failure)
    target: int             # rank (rank_kill, uploader_kill) or node (node_loss)
    window_s: float = 0.0   # how long a storage or disk failure lasts
    param: float = 0.0      # latency per request s (storage_latency), per file s (disk_slow)
    variant: str = ""       # storage_outage: reset | http_503
    compound: str = ""      # in_restart: killed again ``param`` s after the relaunch; kill_during: a rank killed
                            # a third into a storage outage, so the relaunched job restores during it
    # what happened (filled in by the run)
    at: float | None = None
    skipped: str | None = None
    last_step: int | None = None
    restored_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    sources: list[str | None] = field(default_factory=list)
    breakdown: dict[str, float] = field(default_factory=dict)  # the failure to the next step, by phase (rank 0)
    save_errors: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kinds_for(storage: str, allowed: list[str] | None) -> list[str]:
    mine = [*HARD, *SOFT_ANY, *(SOFT_S3 if storage == "s3" else SOFT_DISK)]
    return [k for k in mine if allowed is None or k in allowed]


def draw(seed: int, kinds: list[str], count: int, *, world: int, nodes: int, gap_s: tuple[float, float],
         window_s: tuple[float, float]) -> list[Failure]:
    rng = random.Random(seed)
    out: list[Failure] = []
    while len(out) < count:
        block = list(kinds)
        rng.shuffle(block)
        for kind in block:
            f = Failure(index=len(out), kind=kind, gap_s=round(rng.uniform(*gap_s), 2),
                        target=rng.randrange(nodes if kind == "node_loss" else world),
                        window_s=round(rng.uniform(*window_s), 2))
            if kind == "storage_latency":
                f.param = round(rng.uniform(0.2, 1.0), 2)
            elif kind == "disk_slow":
                f.param = round(rng.uniform(0.2, 1.0), 2)
            elif kind == "storage_outage":
                f.variant = rng.choice(["reset", "http_503"])
                f.compound = "kill_during" if rng.random() < 0.4 else ""
            if kind in ("rank_kill", "node_loss") and rng.random() < 0.4:
                f.compound, f.param = "in_restart", round(rng.uniform(0.5, 6.0), 2)
            if kind not in ("storage_outage", "storage_latency", "disk_full", "disk_slow"):
                f.window_s = 0.0
            out.append(f)
    return out[:count]


class Disk:
    """The root's own filesystem (``disk`` storage), mounted before the nodes start (they see it): a small
    tmpfs, or (``fs="ext4"``) an ext4 image of ``size_mb`` on the machine's disk, loop-mounted, for
    checkpoints too large to hold in memory."""

    def __init__(self, where: Path, size_mb: int, fs: str = "tmpfs") -> None:
        self.where, self.size_mb, self.fs = where, size_mb, fs
        self.filler, self.slow_file = where / ".filler", where.parent / "slow-disk"
        self.image = where.parent / "disk.img"
        self.mounted = False

    def mount(self) -> str | None:
        """None once mounted, else why not (the disk kinds are then skipped)."""
        import subprocess

        self.where.mkdir(parents=True, exist_ok=True)
        if self.fs == "ext4":
            with open(self.image, "wb") as f:
                f.truncate(self.size_mb << 20)
            made = subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], capture_output=True, text=True,
                                  timeout=120)
            if made.returncode != 0:
                return f"cannot make an ext4 image of {self.size_mb} MiB: {made.stderr.strip()}"
            command = ["mount", "-o", "loop", str(self.image), str(self.where)]
        else:
            command = ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.where)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return f"cannot mount a {self.size_mb} MiB {self.fs}: {done.stderr.strip()}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Fill all but 16 KiB; the bytes taken."""
        free = os.statvfs(self.where)
        room = free.f_bavail * free.f_frsize - (16 << 10)
        if room <= 0:
            return 0
        fd = os.open(self.filler, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, room)
        except OSError:
            pass  # what fitted stays
        finally:
            os.close(fd)
        return room

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def slow(self, seconds: float) -> None:
        tmp = self.slow_file.with_suffix(".tmp")
        tmp.write_text(f"{seconds}")
        os.replace(tmp, self.slow_file)

    def fast(self) -> None:
        self.slow_file.unlink(missing_ok=True)

    def unmount(self) -> None:
        import subprocess

        self.unfill()
        self.fast()
        if self.mounted:
            if subprocess.run(["umount", str(self.where)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(self.where)], capture_output=True, timeout=30)
            self.mounted = False
        self.image.unlink(missing_ok=True)


def start_soft(f: Failure, *, proxy: Any, disk: Disk | None) -> None:
    """Begin a storage or disk failure (ended by :func:`end_soft`)."""
    if f.kind == "storage_outage":
        proxy.inject(f.variant, times=None)
    elif f.kind == "storage_latency":
        proxy.delay_s = f.param
        proxy.inject("delay", times=None)
    elif f.kind == "disk_full":
        assert disk is not None
        f.notes.append(f"filled {disk.fill() >> 10} KiB")
    elif f.kind == "disk_slow":
        assert disk is not None
        disk.slow(f.param)


def end_soft(f: Failure, *, proxy: Any, disk: Disk | None) -> None:
    if f.kind in SOFT_S3:
        proxy.clear()
        proxy.release_stalls()
    elif f.kind == "disk_full" and disk is not None:
        disk.unfill()
    elif f.kind == "disk_slow" and disk is not None:
        disk.fast()
