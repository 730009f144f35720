"""Launching multi-process jobs for the tests, one way: ``torchrun`` (a job under torchrun's agent,
its output in a log file, bounded), ``ranks_without_agent`` (every rank a plain process: a rank that
dies is neither restarted nor are its peers stopped), and the pieces (``worker_env``: this checkout
on the path, one OpenMP thread, no inherited rank variables; ``start``/``finish``: a process whose
output goes to a file and whose wait is bounded, stopped and failed past it; ``tail``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.servers import free_port

REPO = Path(__file__).resolve().parents[1]
DIST_WORKER = str(REPO / "tests" / "integration" / "dist_worker.py")
LAUNCH_TIMEOUT_S = 240


def worker_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_RUN_ID", "DIST_WORKER_STORAGE_OPTIONS"):
        if name not in extra:
            env.pop(name, None)
    return env


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as out:  # the job's output goes to a file: nothing blocks on a full pipe
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
    """The exit code, once the process ends; one that runs past ``timeout_s`` is stopped and fails the test."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to its workers
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)
        pytest.fail(f"{proc.args} did not end within {timeout_s:.0f} s; its log ends:\n{tail(log)}")


def ranks_without_agent(tmp_path: Path, argv: list[str], world: int = 2,
                        timeout_s: float = 120) -> tuple[list[int], list[Path]]:
    """Run ``argv`` as every rank of a job of ``world`` with no launcher agent (a rank that dies
    is not restarted nor its peers stopped): the exit codes and the logs, in rank order."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = worker_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port))
        log = tmp_path / f"log-{rank}.txt"
        procs.append((start(argv, log, env), log))
    return [finish(proc, log, timeout_s=timeout_s) for proc, log in procs], [log for _, log in procs]


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"


def torchrun_cmd(nproc: int, *args: Any, launcher: tuple[str, ...] = (), worker: str = DIST_WORKER) -> list[str]:
    """``torchrun --nproc-per-node NPROC [launcher options] WORKER ARGS`` (a free master port unless given)."""
    if not any(a.startswith(("--master-port", "--rdzv-endpoint")) for a in launcher):
        launcher = (*launcher, f"--master-port={free_port()}")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *launcher, worker,
            *map(str, args)]


def torchrun(nproc: int, *args: Any, log: Path, launcher: tuple[str, ...] = (), ok: bool = True,
             env: dict[str, str] | None = None, worker: str = DIST_WORKER, timeout_s: float = LAUNCH_TIMEOUT_S) -> int:
    """Run ``WORKER *args`` (default ``dist_worker.py``) on ``nproc`` ranks under torchrun, its output
    in ``log``, bounded by ``timeout_s``; with ``ok`` the job must succeed. Its exit code."""
    code = finish(start(torchrun_cmd(nproc, *args, launcher=launcher, worker=worker), log, env or worker_env()), log,
                  timeout_s=timeout_s)
    if ok:
        assert code == 0, f"torchrun {worker} exited with {code}; its log ends:\n{tail(log)}"
    return code
