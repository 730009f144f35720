"""``mpckpt.heal``: a job under ``python -m mpckpt.run`` recovers from a lost rank without a relaunch.

The training loop catches the failure and calls ``heal``; everything else is the torchrun script
it was::

    mpckpt.init_process_group("gloo")              # the group, as heal will make it again
    model = DDP(net)
    with mpckpt.Checkpointer(root) as ckpt:
        state = {"model": net, "optim": opt}
        last = ckpt.restore(state)
        step = 0 if last is None else last + 1
        while step < steps:
            try:
                train(model, step)
                ckpt.save(step, state, mode="memory")
                step += 1
            except Exception as error:
                last = mpckpt.heal(ckpt, state, error, rebuild=rewrap)   # re-raises what is not a lost rank
                step = 0 if last is None else last + 1

What ``heal`` does, in this order (the replacement's own start does the same: group, model,
Checkpointer, restore; so the collectives of both sides meet):

1. decides: ``error`` is a lost rank only when the launcher started a newer generation within
   ``LOSS_WAIT_S`` (``_generations``); anything else is raised again, unchanged;
2. lets go of the Checkpointer's open without a collective and without removing what it keeps in
   memory, as a crash would leave it (saves in flight are dropped: the failed group cannot commit
   them);
3. leaves the failed process group and forms the new generation's (``process_group``: the same
   backend and arguments as the script's ``mpckpt.init_process_group``);
4. calls ``rebuild()``: whatever holds the old group must be made again on the new one (DDP's
   wrapper: ``DDP(net)``; an FSDP2 model and its optimizer: built and sharded again, put into
   ``state``); a part of ``state`` still bound to the old group is refused, by name (``HealError``);
5. opens the same root again and restores: every rank agrees on the newest step every rank holds
   (the survivors find their own kept snapshots, the replacement its dead predecessor's in this
   node's memory, or a copy on another node, else storage), every byte verified.

A failure while healing (another rank lost) heals again in the next generation. ``history``
holds each heal's phases and seconds (``Healed``). It needs no other change to a script: the
surviving processes keep their Python, torch, data and compiled code; only the group, the
wrappers bound to it and the checkpointer's open are made again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mpckpt import _generations as gens
from mpckpt import _links, process_group
from mpckpt.checkpointer import Checkpointer
from mpckpt.errors import HealError, MpckptError, add_note
from mpckpt.extension import abandon, reopen

log = logging.getLogger("mpckpt")

LOSS_WAIT_S = 10.0  # how long a failure waits for the launcher to say a rank was lost
ABANDON_S = 2.0  # the most each background part of the abandoned open may take to stop
SAID_S = 5.0  # how long a heal waits for the launcher to write who was lost, once it counted the generation
_HEALABLE = (RuntimeError, MpckptError, ConnectionError, TimeoutError, OSError)  # gloo's: RuntimeError


@dataclass
class Healed:
    """One heal: the generation it joined, the ranks lost, the step restored, and its phases' seconds."""

    generation: int
    lost: list[int]
    step: int | None = None
    source: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # wait, leave, form, rebuild, open, restore
    started: float = field(default_factory=time.time)  # wall clock at the heal call, for a timeline across processes
    noticed: float | None = None  # wall clock when the launcher saw the loss


history: list[Healed] = []  # this process's heals, oldest first


def heal(ckpt: Checkpointer, state: Any, error: BaseException, *, rebuild: Callable[[], Any] | None = None,
         loss_wait_s: float = LOSS_WAIT_S) -> int | None:
    """Heal the job in place after ``error``, if a rank was lost: the step restored into ``state``
    (None: nothing to restore, start again from the beginning). Raises ``error`` again when no rank
    was lost; ``HealError`` when the job cannot heal (see the module docstring)."""
    if not isinstance(error, _HEALABLE):
        raise error
    if not gens.under_launcher():
        add_note(error, "mpckpt: this job was not started by `python -m mpckpt.run`: a lost rank needs the whole "
                        "job started again (torchrun --max-restarts), or start it with mpckpt.run to heal in place")
        raise error
    if process_group.made_with is None:
        raise HealError("mpckpt.heal forms the process group again as it was made: make it with "
                        "mpckpt.init_process_group(...) (it takes what torch.distributed.init_process_group "
                        "takes)") from error
    if ckpt.config.process_group is not None:
        raise HealError("this Checkpointer was opened with process_group=, a group of the job that failed; heal "
                        "forms the default group again: open the Checkpointer without process_group=") from error
    called, waiting = time.time(), time.perf_counter()
    try:
        store = gens.connect(timeout_s=loss_wait_s)
    except Exception as e:
        raise _store_lost(e) from error
    generation = _newer(store, gens.generation_of_this_process(), error, loss_wait_s)
    while True:
        report = Healed(generation, [], started=called, phases={"wait": time.perf_counter() - waiting})
        try:
            return _heal_once(ckpt, state, rebuild, store, report)
        except _HEALABLE as e:
            if isinstance(e, HealError):
                raise
            called, waiting = time.time(), time.perf_counter()
            generation = _newer(store, generation, e, loss_wait_s)  # another rank lost while healing
            log.warning("mpckpt: healing failed (%s: %s); a rank was lost again: healing in generation %d",
                        type(e).__name__, e, generation)


def _store_lost(e: BaseException) -> HealError:
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return HealError(f"the launcher's store at {where} does not answer ({type(e).__name__}: {e}): node 0's launcher "
                     "is gone with it, and nothing can start replacements; start the job again (it restores from "
                     "memory, a copy on another node, or storage)")


def _newer(store: Any, than: int, error: BaseException, wait_s: float) -> int:
    try:
        newer = gens.wait_for_newer(store, than, wait_s)
        why = gens.stopped(store) if newer is None else None
    except Exception as e:  # (the store's errors are RuntimeErrors, DistStoreError among them)
        raise _store_lost(e) from error
    if newer is not None:
        return newer
    if why is not None:
        raise HealError(f"the job is stopping and cannot heal: {why}") from error
    add_note(error, f"mpckpt.heal: no launcher started a replacement within {wait_s:.0f} s: no rank of this job "
                    "was lost (this failure is the script's own), or a whole node was and no launcher took its "
                    "place in time (heal(..., loss_wait_s=) waits longer)")
    raise error


def _heal_once(ckpt: Checkpointer, state: Any, rebuild: Callable[[], Any] | None, store: Any,
               report: Healed) -> int | None:
    generation = report.generation
    report.lost = lost = gens.lost_in(store, generation, wait_s=SAID_S)
    report.noticed = gens.began(store, generation, wait_s=SAID_S)
    history.append(report)
    log.warning("mpckpt: rank%s %s lost; healing in place in generation %d", "s" if len(lost) > 1 else "",
                ", ".join(map(str, lost)) or "?", generation)
    started = time.perf_counter()
    with _phase(report, "leave"):
        abandon(ckpt, timeout_s=ABANDON_S)
        _leave_group()
    with _phase(report, "form"):
        backend, kwargs = process_group.made_with or (None, {})
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(generation)  # the store prefix of the generation
        process_group.init_process_group(backend, **kwargs)
        formed = gens.generation_of_this_process()  # a newer one, when a rank was lost as the group formed
        if formed != generation:
            report.generation, report.lost = formed, sorted(set(lost) | set(gens.lost_in(store, formed)))
    with _phase(report, "rebuild"):
        if rebuild is not None:
            rebuild()
        stale = bound_to_old_group(state)
        if stale:
            raise HealError(f"the state's {', '.join(stale[:4])}{' and more' if len(stale) > 4 else ''} still hold the "
                            "process group that failed, and cannot be rolled back in place: make them again on the "
                            "new group in rebuild= (DDP(module); an FSDP2 model and its optimizer built and sharded "
                            "again, put into the state)")
    with _phase(report, "open"):
        reopen(ckpt)
    with _phase(report, "restore"):
        step = ckpt.restore(state)
    seen = ckpt.last_restore
    report.step, report.source = step, None if seen is None else seen.source
    log.warning("mpckpt: healed in generation %d: step %s restored from %s in %.2f s", generation, step,
                report.source, time.perf_counter() - started)
    return step


class _phase:
    def __init__(self, report: Healed, name: str) -> None:
        self.report, self.name = report, name

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *_: Any) -> None:
        self.report.phases[self.name] = time.perf_counter() - self.started


def _leave_group() -> None:
    """Close the failed group's connections (the ranks still waiting on this one fail at once instead
    of at the group's timeout: ``_links``), then destroy it."""
    import torch.distributed as dist

    shut = _links.shut(process_group.links)
    process_group.links = {}
    log.debug("mpckpt: %d connections of the failed group shut down", shut)
    if dist.is_initialized():
        dist.destroy_process_group()


def bound_to_old_group(state: Any) -> list[str]:
    """The parts of ``state`` (its keys' paths) that hold a process group no longer live: a DDP
    wrapper, DTensor parameters or optimizer state on a mesh of the failed group."""
    live = process_group.live_groups()
    found: list[str] = []
    for path, value in _walk(state, ""):
        group = getattr(value, "process_group", None)
        if group is not None and type(value).__name__ == "DistributedDataParallel" and group not in live:
            found.append(path)
        mesh = getattr(value, "device_mesh", None)
        if mesh is not None and any(g not in live for g in _mesh_groups(mesh)):
            found.append(path)
    return found


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    import torch

    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}.{i}" if path else str(i))
    elif isinstance(value, torch.nn.Module):
        for name, p in value.named_parameters():
            yield f"{path}.{name}", p
    elif isinstance(value, torch.optim.Optimizer):
        for i, g in enumerate(value.param_groups):
            for j, p in enumerate(g["params"]):
                yield f"{path}.param_groups.{i}.{j}", p


def _mesh_groups(mesh: Any) -> list[Any]:
    try:
        return list(mesh.get_all_groups())
    except Exception:  # a mesh whose groups are gone says so by failing
        return [object()]
