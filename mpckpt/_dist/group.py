"""The ranks a Checkpointer writes with: a torch.distributed job, or a single process as a group of one.

A single process is a group of one (as torch.distributed.checkpoint's ``_DistWrapper`` makes
every collective a no-op without a process group): rank 0 of 1, its ``broadcast`` returns its
input, its ``all_gather`` returns ``[mine]``, and its store lives in the process. So the open,
the read side and the commit run one path for one process or many; where the two really
differ (a job's run token and store protocol, its ranked format, its refusals) the code asks
``alone`` once, in the one place that decides it.

In a job, torch.distributed is the engine: rank, world size and the key-value store come from the
process group the job initialized (``init_process_group``, by torchrun, Ray Train, SLURM ...)
or the one passed as ``process_group=``. mpckpt adds no cluster layer of its own.

Two kinds of communication, kept apart:

* collectives (``broadcast``, ``all_gather``) run on the training thread only, at open and
  when a new state shape is planned (at most one per save, none once the plan is cached);
* the commit protocol talks through the store (``store``, a ``PrefixStore`` private to this
  open of this root), from the committer thread: store requests are not collectives, so a
  background thread never enters a collective that the training thread could interleave.

A group initialized over ``PrefixStore(f"attempt_{TORCHELASTIC_RESTART_COUNT}", TCPStore(...))``
(what a torchrun restart needs with gloo in torch 2.13) works the same: the store used is the
group's own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from mpckpt.errors import ConfigError


@dataclass
class RankGroup:
    """This process's place in the job, and the means to talk to the other ranks."""

    rank: int
    world_size: int
    process_group: Any  # None: a single process, a group of one (``alone``)
    store: Any  # the torch.distributed Store of the group (no prefix yet; see ``scoped``); None: not made yet

    @classmethod
    def of_one(cls) -> RankGroup:
        """This process by itself: rank 0 of 1, no process group, a store made in the process when asked."""
        return cls(0, 1, None, None)

    @classmethod
    def detect(cls, process_group: Any = None) -> RankGroup:
        """The group to checkpoint with: ``process_group``, else the default one if initialized,
        else a group of one (a single process). ``process_group=False``: this process alone, even
        in a job (a root that only one rank writes)."""
        if process_group is False:
            return cls.of_one()
        try:
            import torch.distributed as dist
        except ImportError:  # a torch built without distributed support
            if process_group is not None:
                raise ConfigError("process_group= needs torch.distributed, which this torch lacks") from None
            return cls.of_one()
        if process_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return cls.of_one()
            process_group = dist.group.WORLD
        elif not dist.is_initialized():
            raise ConfigError("process_group= was given but torch.distributed is not initialized; call "
                              "dist.init_process_group(...) first")
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        if rank < 0:
            raise ConfigError("this process is not a member of the process_group= it passed")
        store = _store_of(process_group)
        return cls(rank, world, process_group, store)

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    @property
    def alone(self) -> bool:
        """A single process, not a rank of a torch.distributed job (``of_one``). A job of one rank
        is not alone: it writes as a job does (its ranked format, its store protocol)."""
        return self.process_group is None

    def broadcast(self, obj: Any) -> Any:
        """``obj`` of rank 0, on every rank (a collective: training thread only)."""
        if self.alone:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective: training thread only)."""
        if self.alone:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def scoped(self, prefix: str) -> Any:
        """The group's store under ``prefix`` (keys of one open of one root); a group of one's is
        a ``HashStore`` in this process, made on first use (a single process commits without one)."""
        try:
            import torch.distributed as dist
        except ImportError:
            raise ConfigError("a store needs torch.distributed, which this torch lacks") from None
        if self.store is None:
            self.store = dist.HashStore()
        return dist.PrefixStore(prefix, self.store)


def _store_of(process_group: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError) as e:
        raise ConfigError(f"cannot reach the store of the torch.distributed job ({e}); initialize the process group "
                          "with a store (torchrun, or init_method / store= of init_process_group)") from e
    if process_group is not dist.group.WORLD:
        store = dist.PrefixStore(f"mpckpt-group-{'-'.join(map(str, dist.get_process_group_ranks(process_group)))}/",
                                 store)
    return store


def store_timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


def launched_by_agent() -> bool:
    """Whether a torchrun (torchelastic) agent started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ
