"""The generations of a job under ``python -m mpckpt.run``: what the launcher and the ranks tell
each other, through the launcher's store.

A *generation* is one set of processes that make up the job's ranks. The first is 0; each time
a rank's process dies, the launcher starts the next one: the surviving processes stay, a
replacement takes the dead rank's place, and every rank forms the process group again under the
store prefix of the new generation (``process_group.PREFIX``, the one a torchrun attempt uses).
So the ranks of two generations never meet in the store, and a key left by a failed generation is
never read by the next.

The launcher (``_supervisor``) hosts the store at ``MASTER_ADDR:MASTER_PORT`` for the job's whole
life (no rank hosts it: any rank may die). Under it:

    mpckpt-run/generation     a counter: the newest generation (``Store.add``, so that the
                              launchers of several nodes move it without a lock)
    mpckpt-run/lost/<g>       the ranks whose loss started generation g (``"3"``, ``"1,2"``)
    mpckpt-run/began/<g>      when the launcher saw that loss (``time.time()``, for timelines)
    mpckpt-run/ready/<g>      a counter: the ranks gathered to form generation g's group
    mpckpt-run/gathering/<pid> the generation process pid last gathered for (a replacement that
                              moved itself to a newer one is not started again by its launcher)
    mpckpt-run/formed/<g>/<r> rank r formed the group of generation g
    mpckpt-run/node/<n>       a counter: the launchers started for node n (a second one replaces a
                              lost node: its ranks join a new generation)
    mpckpt-run/stop           set when the job stops (too many failures, a launcher interrupted):
                              the text says why; a rank that reads it stops healing
    mpckpt-run/done           a counter: the launchers whose ranks all ended

Every rank is started with the environment torchrun gives (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ... ``TORCHELASTIC_RESTART_COUNT``: the generation it joins, and
``TORCHELASTIC_USE_AGENT_STORE=True``) and ``MPCKPT_RUN=1``, which tells ``mpckpt.heal`` that a
launcher is there to start replacements. Every wait here is bounded.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping
from typing import Any

RUN_VARIABLE = "MPCKPT_RUN"  # set to "1" for every rank that mpckpt.run starts
GENERATION = "mpckpt-run/generation"
STOP = "mpckpt-run/stop"
DONE = "mpckpt-run/done"
POLL_S = 0.01


def lost_key(generation: int) -> str:
    return f"mpckpt-run/lost/{generation}"


def began_key(generation: int) -> str:
    return f"mpckpt-run/began/{generation}"


def node_key(node_rank: int) -> str:
    return f"mpckpt-run/node/{node_rank}"


def formed_key(generation: int, rank: int) -> str:
    return f"mpckpt-run/formed/{generation}/{rank}"


def ready_key(generation: int) -> str:
    return f"mpckpt-run/ready/{generation}"


def gathering_key(pid: int) -> str:
    return f"mpckpt-run/gathering/{pid}"


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``python -m mpckpt.run`` started this process (a launcher that replaces lost ranks)."""
    return env.get(RUN_VARIABLE) == "1"


def generation_of_this_process(env: Mapping[str, str] = os.environ) -> int:
    """The generation this process's group was formed in (0 outside a launcher)."""
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def connect(env: Mapping[str, str] = os.environ, *, timeout_s: float = 30.0) -> Any:
    """A client of the launcher's store (no prefix)."""
    import torch.distributed as dist

    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def current(store: Any) -> int:
    """The newest generation the launchers started."""
    return int(store.add(GENERATION, 0))


def stopped(store: Any) -> str | None:
    """Why the job stops, once a launcher said so; else None."""
    if store.check([STOP]):
        return bytes(store.get(STOP)).decode(errors="replace")
    return None


def _written(store: Any, key: str, wait_s: float) -> bytes | None:
    """``key``'s value, waiting up to ``wait_s`` for a launcher to write it; None if it did not."""
    deadline = time.monotonic() + wait_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)
    return bytes(store.get(key))


def lost_in(store: Any, generation: int, *, wait_s: float = 0.0) -> list[int]:
    """The ranks whose loss started ``generation`` (empty when the key is not there within ``wait_s``:
    a launcher writes it just after it counts the generation, so a survivor can see the count first)."""
    text = _written(store, lost_key(generation), wait_s)
    return [] if text is None else [int(r) for r in text.decode().split(",") if r]


def began(store: Any, generation: int, *, wait_s: float = 0.0) -> float | None:
    """When the launcher saw the loss that started ``generation`` (wall clock), if it said within ``wait_s``."""
    text = _written(store, began_key(generation), wait_s)
    return None if text is None else float(text.decode())


def wait_for_newer(store: Any, than: int, timeout_s: float) -> int | None:
    """The newest generation once it is newer than ``than``, or None after ``timeout_s`` (or a stop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        newest = current(store)
        if newest > than:
            return newest
        if stopped(store) is not None or time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def gathering(store: Any, pid: int) -> int:
    """The generation process ``pid`` last gathered for (-1: none yet)."""
    key = gathering_key(pid)
    return int(bytes(store.get(key)).decode()) if store.check([key]) else -1


def gather(store: Any, generation: int, world_size: int, *, timeout_s: float) -> int:
    """Wait until all ``world_size`` ranks gathered to form ``generation``'s group; the generation
    to form: ``generation``, or the newest when one began meanwhile (a rank was lost while the
    others gathered: nobody would come to form the older one, and waiting in its rendezvous would
    last the group's whole timeout). Raises once the job stops, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        store.set(gathering_key(os.getpid()), str(generation))
        ready = int(store.add(ready_key(generation), 1))
        newest = generation
        while ready < world_size and newest == generation:
            why = stopped(store)
            if why is not None:
                raise RuntimeError(f"mpckpt.run stops the job: {why}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{ready} of {world_size} ranks came to form generation {generation}'s process "
                                   f"group within {timeout_s:.0f} s (the group's timeout)")
            time.sleep(POLL_S)
            ready, newest = int(store.add(ready_key(generation), 0)), current(store)
        if newest == generation:
            return generation
        generation = newest
