"""The launcher of ``python -m mpckpt.run``: starts a node's ranks, replaces a dead one, keeps the others.

torchrun's agent answers any failure by stopping every rank and starting them all again. This
one keeps the processes that still run: when a rank's process ends with a failure, the
launcher moves the job to the next generation (``_generations``: the counter in its store, and
which ranks were lost) and starts a replacement with the dead rank's number and environment,
joining that generation. The surviving ranks leave their failed collective (gloo's error on the
dead peer's closed connection, or the group's timeout) and heal in place (``mpckpt.heal``):
they form the group again under the new generation's prefix, where the replacement joins them.

Rules it keeps:

- the store lives in the launcher of node 0 for the whole job (a rank may die, the store may not);
- every process it started is ended before it returns (SIGTERM, then SIGKILL after
  ``STOP_GRACE_S``), also when it is interrupted or fails;
- more failures than ``max_restarts`` (counted across nodes in the store) stop the job: the
  launchers end their ranks and exit 1 saying so;
- a launcher started for a node number the job already had (a fresh machine in place of a lost
  one) starts its ranks as replacements, in a new generation (counted as failures);
- a replacement started for a generation that is no longer the newest, and that has neither
  formed its group nor gathered for the newest (``_generations.gather`` moves a rank still
  gathering to it), would wait in a rendezvous nobody else joins: it is ended and started again
  for the newest generation (not counted as a failure);
- a replacement is a warm spare when one is ready (``_spare``: a process that loaded Python, torch
  and mpckpt while the job trained, ``--spares`` per node, started once the node's ranks formed
  the newest generation's group so as not to slow their start or heal); a fresh process otherwise;
- the exit code is 0 when every rank of every generation that finished ended with 0.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from mpckpt import _generations as gens

log = logging.getLogger("mpckpt")

STOP_GRACE_S = 5.0  # a rank asked to stop (SIGTERM) is killed after this
DONE_WAIT_S = 60.0  # node 0's launcher keeps the store up this long for the other nodes to finish
FAILURES = "mpckpt-run/failures"


@dataclass(frozen=True)
class Plan:
    """What ``python -m mpckpt.run`` was asked to run (torchrun's flags, ``run.parse``)."""

    argv: list[str]  # the command of every rank: [python, script, args...] or [python, -m, module, args...]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 29500
    max_restarts: int = 3
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    monitor_interval_s: float = 0.01
    store_timeout_s: float = 300.0
    spares: int = 1  # warm spares kept per node (``_spare``); 0: replacements start from nothing

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class Rank:
    """One process of this node: its rank and the generation it was started to join."""

    rank: int
    generation: int
    proc: subprocess.Popen[bytes]
    restarts: int = 0


class Supervisor:
    """Runs one node's ranks of ``plan`` to their end (see the module docstring)."""

    def __init__(self, plan: Plan, environ: Mapping[str, str] | None = None) -> None:
        self.plan = plan
        self.environ = dict(os.environ if environ is None else environ)
        self.ranks: dict[int, Rank] = {}
        self.exit_codes: dict[int, int] = {}
        self.store: Any = None
        self.failures = 0  # this node's, for the log
        self.spares: list[subprocess.Popen[bytes]] = []
        self._stopping: str | None = None

    # -- the ranks' environment, as torchrun gives it --------------------------------------------
    def env_of(self, rank: int, generation: int) -> dict[str, str]:
        p = self.plan
        local = rank - p.node_rank * p.nproc_per_node
        env = {**self.environ,
               "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(p.world_size),
               "LOCAL_WORLD_SIZE": str(p.nproc_per_node), "GROUP_RANK": str(p.node_rank),
               "GROUP_WORLD_SIZE": str(p.nnodes), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
               "ROLE_WORLD_SIZE": str(p.world_size), "MASTER_ADDR": p.host, "MASTER_PORT": str(p.port),
               "TORCHELASTIC_RESTART_COUNT": str(generation), "TORCHELASTIC_MAX_RESTARTS": str(p.max_restarts),
               "TORCHELASTIC_RUN_ID": p.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
               gens.RUN_VARIABLE: "1"}
        if p.nproc_per_node > 1 and "OMP_NUM_THREADS" not in self.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks of one node do not fight over its cores
        return env

    def start(self, rank: int, generation: int) -> Rank:
        env = self.env_of(rank, generation)
        proc = self._from_spare(env) or subprocess.Popen(self.plan.argv, env=env)
        started = Rank(rank, generation, proc)
        self.ranks[rank] = started
        return started

    # -- warm spares -----------------------------------------------------------------------------
    def _spare_command(self) -> list[str] | None:
        """How a spare starts; None when the ranks' command is not a Python script or module."""
        if self.plan.spares < 1 or self.plan.argv[:2] != [sys.executable, "-u"]:
            return None
        return [sys.executable, "-u", "-m", "mpckpt._spare"]

    def _keep_spares(self) -> None:
        """Keep ``plan.spares`` spares ready; a new one starts once this node's ranks formed the newest
        generation's group (not while they start or heal: its imports would take their cores)."""
        command = self._spare_command()
        if command is None:
            return
        self.spares = [s for s in self.spares if s.poll() is None]
        if len(self.spares) >= self.plan.spares or not self.ranks:
            return
        newest = gens.current(self.store)
        if not self.store.check([gens.formed_key(newest, rank) for rank in self.ranks]):
            return  # (this node's ranks starting or healing: a spare's imports would slow them)
        env = self.env_of(min(self.ranks), newest)  # (the order replaces it whole)
        self.spares.append(subprocess.Popen(command, env=env, stdin=subprocess.PIPE))

    def _from_spare(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """A ready spare, told to become the rank of ``env``; None when none is ready."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.poll() is not None or spare.stdin is None:
                continue
            order = json.dumps({"env": env, "argv": self.plan.argv[2:]}) + "\n"
            try:
                spare.stdin.write(order.encode())
                spare.stdin.close()
            except OSError as e:  # it died meanwhile: the next, or a fresh process
                log.debug("mpckpt.run: a spare could not take its order: %s", e)
                _end(spare)
                continue
            return spare
        return None

    # -- running ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Start the store (node 0) and the ranks, supervise them, end them all; the exit code."""
        import torch.distributed as dist

        p = self.plan
        previous = {s: signal.signal(s, self._interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.store = dist.TCPStore(p.host, p.port, is_master=p.node_rank == 0, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=p.store_timeout_s))
            first = p.node_rank * p.nproc_per_node
            ranks = list(range(first, first + p.nproc_per_node))
            if int(self.store.add(gens.node_key(p.node_rank), 1)) == 1:
                generation = gens.current(self.store)
            else:  # this node takes the place of one the job lost: its ranks are replacements
                if not self._count(ranks):
                    return 1
                generation = self._next_generation(ranks, why="joined in place of a lost node")
            for rank in ranks:
                self.start(rank, generation)
            code = self._supervise()
            self._finish()
            return code
        finally:
            self._end_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _interrupted(self, signum: int, _frame: FrameType | None) -> None:
        self._stopping = f"the launcher of node {self.plan.node_rank} got signal {signal.Signals(signum).name}"

    def _supervise(self) -> int:
        while True:
            if self._stopping is not None:
                self._say_stop(self._stopping)
                return 1
            why = gens.stopped(self.store)
            if why is not None:
                print(f"mpckpt.run: stopping the job: {why}", file=sys.stderr, flush=True)
                return 1
            lost = self._reap()
            if lost:
                if not self._replace(lost):
                    return 1
            self._restart_stale()
            self._keep_spares()
            if not self.ranks:
                return 0 if all(c == 0 for c in self.exit_codes.values()) else 1
            time.sleep(self.plan.monitor_interval_s)

    def _reap(self) -> list[int]:
        """The ranks whose process ended with a failure since the last look (the ones that ended
        with 0 are done: they leave the watch)."""
        lost = []
        for rank, r in list(self.ranks.items()):
            code = r.proc.poll()
            if code is None:
                continue
            del self.ranks[rank]
            self.exit_codes[rank] = code
            if code != 0:
                lost.append(rank)
        return lost

    def _replace(self, lost: list[int]) -> bool:
        """Count the failures, start the next generation and its replacements; False: too many."""
        if not self._count(lost):
            return False
        codes = ", ".join(f"rank {r} exited with {self.exit_codes[r]}" for r in lost)
        generation = self._next_generation(lost, why=codes)
        for rank in lost:
            self.start(rank, generation)
        return True

    def _count(self, lost: list[int]) -> bool:
        """Count ``lost``'s failures in the job; False (and the job told to stop) past ``max_restarts``."""
        self.failures += len(lost)
        total = int(self.store.add(FAILURES, len(lost)))
        if total > self.plan.max_restarts:
            self._say_stop(f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost: "
                           f"{total} failures in the job, more than --max-restarts={self.plan.max_restarts}")
            return False
        return True

    def _next_generation(self, lost: list[int], *, why: str) -> int:
        generation = int(self.store.add(gens.GENERATION, 1))
        # INVARIANT: the lost ranks are written before the replacements start (a survivor that sees
        # the new generation can read who was lost)
        self.store.set(gens.lost_key(generation), ",".join(map(str, lost)))
        self.store.set(gens.began_key(generation), repr(time.time()))
        print(f"mpckpt.run: {why}; generation {generation}: starting replacement{'s' if len(lost) > 1 else ''} of "
              f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}", file=sys.stderr, flush=True)
        return generation

    def _restart_stale(self) -> None:
        """Replacements waiting to form an older generation's group start again in the newest."""
        newest: int | None = None
        for rank, r in list(self.ranks.items()):
            if r.generation == 0 or r.proc.poll() is not None:
                continue
            if newest is None:
                newest = gens.current(self.store)
            r.generation = max(r.generation, gens.gathering(self.store, r.proc.pid))  # it may have moved itself
            if r.generation < newest and not self.store.check([gens.formed_key(r.generation, rank)]):
                _end(r.proc)
                print(f"mpckpt.run: the replacement of rank {rank} for generation {r.generation} had not joined "
                      f"when generation {newest} began: starting it in {newest}", file=sys.stderr, flush=True)
                self.start(rank, newest)

    def _say_stop(self, why: str) -> None:
        print(f"mpckpt.run: stopping the job: {why}", file=sys.stderr, flush=True)
        if self.store is not None:
            try:
                self.store.set(gens.STOP, why)
            except Exception:  # the store's host may be gone already: the ranks end by signal anyway
                pass

    def _finish(self) -> None:
        """Node 0 keeps the store up until every node's ranks ended (bounded)."""
        try:
            done = int(self.store.add(gens.DONE, 1))
            if self.plan.node_rank != 0:
                return
            deadline = time.monotonic() + DONE_WAIT_S
            while done < self.plan.nnodes and time.monotonic() < deadline and gens.stopped(self.store) is None:
                time.sleep(0.05)
                done = int(self.store.add(gens.DONE, 0))
        except Exception as e:  # the store's host may be gone: nothing left to wait for
            log.debug("mpckpt.run: the store at the end: %s", e)

    def _end_all(self) -> None:
        procs = [r.proc for r in self.ranks.values()] + self.spares
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE_S)
        self.ranks.clear()
        self.spares.clear()


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_GRACE_S)
