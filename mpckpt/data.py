"""The data position of a plain ``torch.utils.data.DataLoader``, saved and restored exactly.

Three parts, used together::

    sampler = mpckpt.ResumableSampler(dataset, shuffle=True, seed=0)   # rank=, world_size= for several ranks
    loader = mpckpt.ResumableLoader(DataLoader(mpckpt.SeededDataset(dataset), batch_size=32, sampler=sampler,
                                               num_workers=2))
    state = {"model": model, "optim": opt, "rng": mpckpt.RNGState(), "data": loader}

* ``ResumableSampler`` owns the order: epoch ``e`` is a permutation drawn from ``(seed, e)``
  with a generator of its own (never the global one), sliced per rank as
  ``DistributedSampler`` does. Its position is ``(epoch, consumed)``: how many of this rank's
  indices of that epoch are used. After ``load_state_dict`` it hands out the rest of that
  epoch's order, then the next epochs as if never interrupted.
* ``ResumableLoader`` owns the count. A DataLoader with workers asks its sampler for
  ``num_workers * prefetch_factor`` batches before the loop has received any, so a sampler's
  own count runs ahead of the loop, and a checkpoint taken from it would skip the batches
  that were fetched but never trained on. The loader wrapper advances the position by each
  batch as the loop receives it, so a save after step ``s`` records exactly the samples steps
  up to ``s`` used. (Used alone, the sampler counts what it hands out, which is the same thing
  only with ``num_workers=0``.) It also owns the workers' seeds: a DataLoader draws each
  iterator's base seed from the global torch generator, so the iterator a resumed run creates
  would shift the training process's random numbers (dropout) by one draw and give the
  workers unrelated seeds. ``ResumableLoader`` gives the DataLoader a generator seeded from
  ``(seed, epoch, rank)`` before each epoch: nothing is drawn from the global generator, and
  every epoch's workers get the same seeds in a resumed run as in an uninterrupted one.
* ``SeededDataset`` makes randomness drawn *in worker processes* exact mid-epoch too. A
  worker's generators advance with every sample it loads, and a resumed run's workers start
  fresh; so inside a worker it reseeds torch, ``random`` and NumPy before each item from
  ``(the epoch's worker seed, index)``, which also makes an item's numbers the same whatever
  the number of workers. In the training process (``num_workers=0``) it changes nothing:
  those generators are ``RNGState``'s. Persistent workers keep the seeds of the first epoch
  their process ran, which a resumed run cannot match, so ``ResumableLoader`` refuses
  ``SeededDataset`` with ``persistent_workers=True``.

The saved state holds no rank and is the same on every rank (every rank's slice of an
epoch has the same length, and ranks step together), so one rank's state restores all.
A state from another dataset length, seed, world size, ``shuffle`` or ``drop_last`` is a
``StateError`` naming the setting, never a resume on a different order.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, get_worker_info

from mpckpt.errors import ConfigError, StateError

_MASK64 = (1 << 64) - 1
# Domains of the derived seeds, so the order, the workers and the samples never share one.
_ORDER, _WORKERS, _SAMPLES = 1, 2, 3
_STATE_KEYS = ("epoch", "consumed", "seed", "length", "world_size", "shuffle", "drop_last")


def _mix(*values: int) -> int:
    """A 63-bit seed from whole numbers: splitmix64 over each in turn (the same on every machine)."""
    h = 0
    for value in values:
        h = ((h ^ (value & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _whole(name: str, value: Any, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"ResumableSampler: {name}={value!r} must be a whole number of at least {least}")
    return value


class ResumableSampler(Sampler[int]):
    """A sampler whose order is a pure function of ``(seed, epoch)`` and whose position is saved.

    ``data`` is the dataset (anything with ``len``) or its length. With ``world_size`` > 1,
    rank ``rank`` gets every ``world_size``-th index of the epoch's order, which is first
    padded by repeating its start (or, with ``drop_last``, cut) to a multiple of
    ``world_size``, as ``DistributedSampler`` does. ``len()`` is this rank's share of a whole
    epoch, also mid-epoch. When an epoch is used up the next one begins; ``set_epoch(e)``
    jumps to the start of epoch ``e`` (to the epoch it is in already, it changes nothing, so
    a ``DistributedSampler``-style loop keeps a restored mid-epoch position).
    """

    def __init__(self, data: Sized | int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        length = data if isinstance(data, int) and not isinstance(data, bool) else None
        if length is None:
            if not isinstance(data, Sized):
                raise ConfigError(f"ResumableSampler: data must be a dataset with a length or a number of "
                                  f"samples, not a {type(data).__name__}")
            length = len(data)
        if length < 1:
            raise ConfigError(f"ResumableSampler: the dataset has {length} samples; a sampler needs at least 1")
        self._length = length
        self._seed = _whole("seed", seed, least=0)
        if self._seed > _MASK64:
            raise ConfigError(f"ResumableSampler: seed={seed!r} must be below 2**64")
        self._world_size = _whole("world_size", world_size, least=1)
        self._rank = _whole("rank", rank, least=0)
        if self._rank >= self._world_size:
            raise ConfigError(f"ResumableSampler: rank={rank} with world_size={world_size}; a rank counts from 0 "
                              "to world_size - 1")
        self._shuffle, self._drop_last = bool(shuffle), bool(drop_last)
        if self._drop_last and self._length % self._world_size:
            self._per_rank = self._length // self._world_size
        else:
            self._per_rank = math.ceil(self._length / self._world_size)
        if self._per_rank == 0:
            raise ConfigError(f"ResumableSampler: {self._length} samples over world_size={world_size} with "
                              "drop_last=True leave every rank nothing; use drop_last=False or fewer ranks")
        self._epoch = 0
        self._consumed = 0
        self._loop_counts = False  # True once a ResumableLoader advances the position instead

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """How many of this rank's indices of ``epoch`` are used."""
        return self._consumed

    def __len__(self) -> int:
        return self._per_rank

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning; the current epoch keeps its position."""
        if _whole("epoch", epoch, least=0) != self._epoch:
            self._epoch, self._consumed = epoch, 0

    def order(self, epoch: int) -> list[int]:
        """This rank's indices of epoch ``epoch``, in order."""
        if self._shuffle:
            generator = torch.Generator().manual_seed(_mix(_ORDER, self._seed, epoch))
            indices = torch.randperm(self._length, generator=generator).tolist()
        else:
            indices = list(range(self._length))
        total = self._per_rank * self._world_size
        if total > len(indices):  # pad with the start of the order, as DistributedSampler does
            indices += (indices * math.ceil((total - len(indices)) / len(indices)))[:total - len(indices)]
        return indices[self._rank:total:self._world_size]

    def __iter__(self) -> Iterator[int]:
        # The order and the start are read now, once: the loop may advance the position while
        # a DataLoader still draws from this iterator.
        rest = self.order(self._epoch)[self._consumed:]
        return iter(rest) if self._loop_counts else self._counting(rest)

    def _counting(self, rest: list[int]) -> Iterator[int]:
        for index in rest:
            self._consumed += 1
            yield index
        self._next_epoch()

    def _next_epoch(self) -> None:
        self._epoch, self._consumed = self._epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position and the settings it is valid for (no rank: every rank's is the same)."""
        return {"epoch": self._epoch, "consumed": self._consumed, "seed": self._seed, "length": self._length,
                "world_size": self._world_size, "shuffle": self._shuffle, "drop_last": self._drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (what ``state_dict`` returned), for the same data and settings."""
        if not isinstance(state, dict) or any(key not in state for key in _STATE_KEYS):
            raise StateError("ResumableSampler: the checkpoint does not hold a ResumableSampler's state here (it "
                             f"needs {', '.join(_STATE_KEYS)}); save the sampler or its ResumableLoader under this "
                             "key, or drop it from the state you restore")
        mine = self.state_dict()
        for key in ("length", "seed", "world_size", "shuffle", "drop_last"):
            if state[key] != mine[key]:
                if key == "length":
                    raise StateError(f"ResumableSampler: the checkpoint's data position is for a dataset of "
                                     f"{state[key]!r} samples and this sampler's has {mine[key]}; restore with the "
                                     "dataset the run used", key=key)
                fix = (f"restore with as many ranks as the run had ({key}={state[key]!r})" if key == "world_size"
                       else f"create the sampler with {key}={state[key]!r}")
                raise StateError(f"ResumableSampler: the checkpoint's data position is for {key}={state[key]!r} and "
                                 f"this sampler has {key}={mine[key]!r}; {fix}", key=key)
        epoch, consumed = state["epoch"], state["consumed"]
        for key, value in (("epoch", epoch), ("consumed", consumed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateError(f"ResumableSampler: the checkpoint's {key}={value!r} is not a whole number of at "
                                 "least 0; the checkpoint is damaged or not a sampler's", key=key)
        if consumed > self._per_rank:
            raise StateError(f"ResumableSampler: the checkpoint says {consumed} samples of the epoch were used and "
                             f"an epoch has {self._per_rank} per rank; the checkpoint is damaged or not this "
                             "sampler's", key="consumed")
        self._epoch, self._consumed = epoch, consumed


class ResumableLoader:
    """A DataLoader over a ``ResumableSampler`` whose position counts what the loop received.

    Iterating gives the rest of the current epoch, then the epoch is over (the next
    iteration starts the next one). ``state_dict`` / ``load_state_dict`` are the sampler's,
    with ``consumed`` counted in samples of the batches handed to the loop, so save after the
    step that used a batch. The DataLoader's ``generator`` is set before each epoch (the
    workers' seeds); create the DataLoader without one.
    """

    def __init__(self, loader: DataLoader) -> None:
        if not isinstance(loader, DataLoader):
            raise ConfigError(f"ResumableLoader wraps a torch.utils.data.DataLoader, not a {type(loader).__name__}")
        self.loader = loader
        self.sampler, self._per_batch = _resumable_sampler(loader)
        if loader.generator is not None:
            raise ConfigError("ResumableLoader: the DataLoader has a generator=; ResumableLoader seeds the workers "
                              "from the sampler's seed and epoch itself, so create the DataLoader without one")
        if not getattr(loader, "in_order", True):
            raise ConfigError("ResumableLoader: the DataLoader has in_order=False, so the batches the loop has "
                              "received are not the first ones of the epoch; create it with in_order=True")
        length = len(loader.dataset) if isinstance(loader.dataset, Sized) else None  # type: ignore[arg-type]
        if length is not None and length != self.sampler._length:
            raise ConfigError(f"ResumableLoader: the sampler was made for {self.sampler._length} samples and the "
                              f"DataLoader's dataset has {length}; make the sampler from that dataset")
        if loader.persistent_workers and isinstance(loader.dataset, SeededDataset):
            raise ConfigError("ResumableLoader: SeededDataset with persistent_workers=True: persistent workers keep "
                              "the seeds of the first epoch this process iterated, so a resumed run's workers draw "
                              "other numbers; create the DataLoader with persistent_workers=False")
        self.sampler._loop_counts = True

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.sampler.epoch

    @property
    def consumed(self) -> int:
        """How many samples of this rank's share of ``epoch`` the loop has received."""
        return self.sampler.consumed

    def set_epoch(self, epoch: int) -> None:
        """``ResumableSampler.set_epoch``."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if sampler._consumed < len(sampler):
            # INVARIANT: set before the iterator exists; it draws the workers' base seed from it.
            seed = _mix(_WORKERS, sampler._seed, sampler._epoch, sampler._rank)
            self.loader.generator = torch.Generator().manual_seed(seed)
            for batch in self.loader:
                sampler._consumed = min(sampler._consumed + self._per_batch, len(sampler))
                yield batch
        sampler._next_epoch()

    def state_dict(self) -> dict[str, Any]:
        """``ResumableSampler.state_dict``: the position of the loop."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``ResumableSampler.load_state_dict``."""
        self.sampler.load_state_dict(state)


def _resumable_sampler(loader: DataLoader) -> tuple[ResumableSampler, int]:
    """The loader's ResumableSampler and how many of its indices make one batch."""
    batches = loader.batch_sampler
    if batches is None and isinstance(loader.sampler, ResumableSampler):
        return loader.sampler, 1
    if type(batches) is BatchSampler and isinstance(batches.sampler, ResumableSampler):
        return batches.sampler, batches.batch_size
    source = loader.sampler if batches is None else batches.sampler if type(batches) is BatchSampler else batches
    raise ConfigError(f"ResumableLoader: the DataLoader draws its indices from a {type(source).__name__}, not from an "
                      "mpckpt.ResumableSampler; create it as DataLoader(dataset, batch_size=..., "
                      "sampler=mpckpt.ResumableSampler(dataset, shuffle=..., seed=...))")


class SeededDataset(Dataset):
    """``dataset``, with torch, ``random`` and NumPy reseeded in a worker before each item.

    The seed comes from the worker's epoch seed (which ``ResumableLoader`` derives from the
    sampler's seed and epoch) and the index, so the random numbers an item's augmentation draws
    do not depend on which worker loads it or on what that worker loaded before: a resumed
    run's workers draw the same ones. In the training process itself it only delegates.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        info = get_worker_info()
        if info is not None:
            seed = _mix(_SAMPLES, info.seed - info.id, int(index))  # info.seed is the base seed + the id
            torch.manual_seed(seed)
            random.seed(seed)
            numpy = sys.modules.get("numpy")  # a dataset that draws from NumPy has imported it
            if numpy is not None:
                numpy.random.seed([seed & 0xFFFFFFFF, seed >> 32])
        return self.dataset[index]
