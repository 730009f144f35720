"""One rank of ``test_heal_in_job``'s jobs: ``python -m mpckpt.run ... heal_worker.py ROOT OUT [options]``.

A torchrun script using mpckpt, healed in place (``mpckpt.heal``) when a rank is lost: every rank
makes its group with ``mpckpt.init_process_group``, builds a small model under DDP (or FSDP2
``fully_shard`` on a CPU mesh) with AdamW and a ``PerRank`` blob of ``--blob-mb`` MiB, opens ``ROOT``,
restores, and trains ``--steps`` deterministic steps (each step's data depends only on the step and
the rank), each ending in ``save(step, state, mode="memory")``, every ``--storage-every``-th an
ASYNC save to storage, waited for (``--storage-no-wait``: from ``--kill-step`` on not waited for, so
that a kill lands while its upload and commit are in flight; the earlier ones are committed). A failure goes to ``mpckpt.heal``, whose ``rebuild`` wraps the
model again (DDP) or builds and shards it again with a new optimizer (FSDP2).

What it writes under ``OUT/rank<r>/``:

``trace``              (the process of generation 0; ``trace.g<n>`` for a replacement started in
                       generation n) ``started <step>``, ``saved <step>`` once ``save`` returned,
                       ``healed <step>`` after a heal;
``state-<step>.pt``    this rank's local state as saved at ``step`` by the process of generation 0;
``proc-<pid>.json``    each process: its pid, the generation it started in, the step its first
                       restore returned and its source, then (rewritten after each heal) its heals;
``final.pt``/``final.json``  the local state after the last step; the pid and generation that finished.
``kill.json``          (the killed rank) where it killed itself; ``kill-second.json``: ``--second``'s.

Kills (``--kill-rank R --kill-step S --moment M``), in the process of generation 0 only, at step S:
``forward``, ``before_optim``, ``in_save``, ``after_save`` as ``job_kill_worker`` does them.
``--peer-copies``, ``--loss-wait-s``, ``--step-sleep-s``: for the simulated nodes (a node lost by the test).
``--second``: the replacement started in generation 1 SIGKILLs itself once it formed the group,
just before its restore (the survivors are healing: a second failure during the heal).
``--wait-for-spare``: the rank to be killed waits (bounded) before its kill step until its launcher
has a warm spare process (``mpckpt._spare``), and names it in ``spare.json``.
``--die-healing R``: rank R (a survivor of the first kill) SIGKILLs itself instead of healing, once
every other survivor came to form generation 1's group (``die-healing.json``): a rank lost while
the group forms again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mpckpt
from harness.job import module_of, parallel, write_json
from mpckpt import _generations as gens
from mpckpt import healing
from tests.integration.job_kill_worker import IN, MOMENTS, OUT_DIM, WIDTH, Files, Kill, batch, local_state

GENERATION = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # the one this process started in


class Trainer:
    """The model and the optimizer, made again on a new group by ``rebuild``."""

    def __init__(self, args: argparse.Namespace, world: int) -> None:
        self.args, self.world = args, world
        self.model, self.opt = self.build()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(IN, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                  torch.nn.ReLU(), torch.nn.Linear(WIDTH, OUT_DIM))
        model, opt = parallel(net, self.args.model, self.world)
        warm_up(model)
        return model, opt

    def rebuild(self, state: dict[str, Any]) -> None:
        if self.args.model == "ddp":  # the module and its optimizer stay: only the wrapper holds the group
            self.model = torch.nn.parallel.DistributedDataParallel(module_of(self.model))
            warm_up(self.model)
        else:  # FSDP2's parameters are DTensors of the old mesh: built and sharded again
            self.model, self.opt = self.build()
        state["model"], state["optim"] = module_of(self.model), self.opt


def warm_up(model: torch.nn.Module) -> None:
    """As ``job_kill_worker.warm_up``: every step reduces DDP's gradients in the rebuilt buckets."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model(torch.zeros(1, IN)).sum().backward()
        model.zero_grad(set_to_none=True)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out", type=Path)
    p.add_argument("--model", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--storage-every", type=int, default=5)
    p.add_argument("--storage-no-wait", action="store_true")
    p.add_argument("--blob-mb", type=float, default=8)
    p.add_argument("--budget", default="160MiB")
    p.add_argument("--moment", choices=MOMENTS, default="none")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--in-save-timeout-s", type=float, default=5.0)
    p.add_argument("--second", action="store_true")
    p.add_argument("--die-healing", type=int, default=-1)
    p.add_argument("--wait-for-spare", action="store_true")
    p.add_argument("--peer-copies", type=int, default=0)
    p.add_argument("--loss-wait-s", type=float, default=10.0)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    return p.parse_args()


def wait_for_spare(files: Files) -> None:
    """Wait until this process's launcher has a warm spare; name it in ``spare.json``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    spare = b"mpckpt._spare" in f.read()
            except (OSError, ValueError, IndexError):
                continue
            if spare and parent == os.getppid():
                write_json(files.dir / "spare.json", {"pid": int(pid)})
                return
        time.sleep(0.05)
    raise TimeoutError("the launcher started no warm spare within 60 s")


def die_healing(files: Files, world: int) -> None:
    """SIGKILL this survivor once the others (all but it and the rank lost first) gathered to form
    generation 1's group: they are waiting there for the first replacement (bounded wait)."""
    store = gens.connect()
    deadline = time.monotonic() + 60
    while int(store.add(gens.ready_key(1), 0)) < world - 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    write_json(files.dir / "die-healing.json", {"pid": os.getpid(), "gathered": int(store.add(gens.ready_key(1), 0))})
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = arguments()
    mpckpt.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    files = Files(args.out, rank, world)
    files.trace = files.dir / ("trace" if GENERATION == 0 else f"trace.g{GENERATION}")
    kill = Kill(args, files, rank)
    if GENERATION != 0:
        kill.step = -1
    trainer = Trainer(args, world)
    kill.in_forward(trainer.model)
    blob = torch.randn(int(args.blob_mb * (1 << 20)) // 4, generator=torch.Generator().manual_seed(rank))
    state = {"model": module_of(trainer.model), "optim": trainer.opt, "blob": mpckpt.PerRank(blob)}
    me: dict[str, Any] = {"pid": os.getpid(), "generation": GENERATION, "heals": []}
    record = files.dir / f"proc-{os.getpid()}.json"
    write_json(record, me)  # (before the restore: a replacement killed before it is counted too)
    ckpt = mpckpt.Checkpointer(args.root, memory_budget=args.budget, workers=1, timeout_s=60,
                               peer_copies=args.peer_copies)
    if args.second and GENERATION == 1:  # the survivors are healing: in the open's collectives, or the restore's
        write_json(files.dir / "kill-second.json", {"generation": GENERATION, "pid": os.getpid()})
        os.kill(os.getpid(), signal.SIGKILL)
    last = ckpt.restore(state)
    me.update(restored=last, source=None if ckpt.last_restore is None else ckpt.last_restore.source)
    write_json(record, me)
    torch.save(local_state(trainer.model, trainer.opt, blob), files.dir / f"restored-{os.getpid()}.pt")
    step = 0 if last is None else last + 1
    while step < args.steps:
        try:
            kill.current = step
            if args.wait_for_spare and step == kill.step:
                wait_for_spare(files)
            files.note(f"started {step}")
            x, y = batch(step, rank)
            loss = torch.nn.functional.mse_loss(trainer.model(x), y)
            trainer.opt.zero_grad()
            loss.backward()
            kill.after_backward(step)
            trainer.opt.step()
            blob[step % 1024::1024] += 1.0
            if GENERATION == 0 and not me["heals"]:
                torch.save(local_state(trainer.model, trainer.opt, blob), files.dir / f"state-{step}.pt")
            storage = bool(args.storage_every) and step % args.storage_every == 0
            kill.before_save(step)
            future = ckpt.save(step, state, mode="async" if storage else "memory")
            if storage and not (args.storage_no_wait and step >= args.kill_step):
                future.result(timeout=120)
            files.note(f"saved {step}")
            kill.after_save(step)
            step += 1
            time.sleep(args.step_sleep_s)  # (the node tests: a save's copies to the other node land meanwhile)
        except Exception as error:
            if rank == args.die_healing and not me["heals"]:
                die_healing(files, world)
            last = mpckpt.heal(ckpt, state, error, rebuild=lambda: trainer.rebuild(state),
                               loss_wait_s=args.loss_wait_s)
            me["heals"] = [asdict(h) for h in healing.history]
            write_json(record, me)
            torch.save(local_state(trainer.model, trainer.opt, blob), files.dir / f"healed-{os.getpid()}.pt")
            files.note(f"healed {last}")
            step = 0 if last is None else last + 1
    torch.save(local_state(trainer.model, trainer.opt, blob), files.dir / "final.pt")
    write_json(files.dir / "final.json", {"pid": os.getpid(), "generation": GENERATION, "heals": me["heals"]})
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
