"""``init_process_group``: torch.distributed's, made safe across torchrun's restarts.

torchrun's agent keeps one TCP store (``MASTER_ADDR:MASTER_PORT``) for the whole job and
restarts its workers against it (``--max-restarts``). ``dist.init_process_group`` with the
``env://`` method connects every attempt to that same store, unprefixed, so a restarted attempt
can meet the keys the failed one left (gloo's addresses: torch 2.13 then fails in
``connectFullMesh``, or waits in ``init_process_group`` until its timeout). This module owns
the one fix, so that no user has to find and copy it: under torchrun's agent store the group is
initialized over ``PrefixStore("mpckpt-attempt-<TORCHELASTIC_RESTART_COUNT>/", TCPStore(...))``,
a store private to the attempt; everywhere else the call is torch's own, unchanged.

It also remembers how the group was made (``made_with``): ``mpckpt.heal`` forms the group again
the same way, in the next generation of a job under ``python -m mpckpt.run`` (``_generations``:
the generation is the ``TORCHELASTIC_RESTART_COUNT`` a rank joins, so its store prefix is the one
above). Under that launcher a rank also says in the store that it formed the group of its
generation (the launcher starts a replacement that never did again in a newer one), and the
sockets the group opened are remembered (``links``: a heal shuts them down, ``_links``). There,
before the rendezvous, the ranks gather (``_generations.gather``): a rank lost while the others
form the group starts a newer generation, and they move to it instead of waiting in a rendezvous
nobody will complete until the group's timeout.

``mpckpt.init_process_group("gloo")`` takes what ``dist.init_process_group`` takes. It does the
plain call when the caller chose the rendezvous (``store=`` or ``init_method=`` given), outside
torchrun (no ``TORCHELASTIC_RESTART_COUNT``), or when torchrun's workers do not use the agent's
store (``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``: rank 0 then starts a fresh store each
attempt). mpckpt itself works with a group made either way.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

from mpckpt import _generations as gens
from mpckpt import _links
from mpckpt.errors import ConfigError

PREFIX = "mpckpt-attempt-{}/"  # the store prefix of one torchrun attempt
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # torch's default for gloo
made_with: tuple[str | None, dict[str, Any]] | None = None  # the last call's backend and arguments
links: dict[int, str] = {}  # the sockets the last group made under the agent's store opened (``_links``)


def attempt_store_wanted(kwargs: dict[str, Any], env: Mapping[str, str] = os.environ) -> bool:
    """Whether a call with ``kwargs`` under ``env`` needs a store private to the torchrun attempt."""
    if kwargs.get("store") is not None or kwargs.get("init_method") is not None:
        return False
    return "TORCHELASTIC_RESTART_COUNT" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _env_int(name: str, env: Mapping[str, str]) -> int:
    text = env.get(name)
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"environment variable {name}={text!r} is not an integer; torchrun sets it for every "
                          f"worker: start the script with torchrun, or pass {name.lower()}= yourself") from None


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, over a store private to this
    torchrun attempt when torchrun's agent store would otherwise be shared with earlier attempts
    (see the module docstring). ``rank``/``world_size`` default to ``RANK``/``WORLD_SIZE``; a
    ``timeout`` given applies to the store's connection too."""
    import torch.distributed as dist

    global made_with
    made_with = (backend, dict(kwargs))
    if not attempt_store_wanted(kwargs):
        dist.init_process_group(backend, **kwargs)
        return
    env = os.environ
    rank = kwargs.pop("rank", None)
    world_size = kwargs.pop("world_size", None)
    rank = _env_int("RANK", env) if rank is None or rank == -1 else rank
    world_size = _env_int("WORLD_SIZE", env) if world_size is None or world_size == -1 else world_size
    timeout = kwargs.get("timeout") or DEFAULT_TIMEOUT
    host = env.get("MASTER_ADDR")
    if not host:
        raise ConfigError("environment variable MASTER_ADDR is not set; torchrun sets it for every worker: start "
                          "the script with torchrun, or pass store= or init_method= yourself")
    agent = dist.TCPStore(host, _env_int("MASTER_PORT", env), world_size, is_master=False, timeout=timeout)
    generation = _env_int("TORCHELASTIC_RESTART_COUNT", env)
    if gens.under_launcher(env):  # every rank there, or a newer generation if one was lost meanwhile
        generation = gens.gather(agent, generation, world_size, timeout_s=timeout.total_seconds())
        env["TORCHELASTIC_RESTART_COUNT"] = str(generation)
    store = dist.PrefixStore(PREFIX.format(generation), agent)
    global links
    _, links = _links.opened_by(lambda: dist.init_process_group(backend, store=store, rank=rank,
                                                                 world_size=world_size, **kwargs))
    if gens.under_launcher(env):
        agent.set(gens.formed_key(generation, rank), "1")


def live_groups() -> set[Any]:
    """The process groups torch.distributed holds now (a group made before the last
    ``destroy_process_group`` is not among them)."""
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)
