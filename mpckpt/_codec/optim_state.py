"""An optimizer's state dict for a repeated save, as torch's ``Optimizer.state_dict`` makes it,
without its Python work per parameter.

``Optimizer.state_dict`` numbers the parameters of every group by their ``id`` (a dict of
``id(p) -> index``, filled parameter by parameter), packs each group with its ``params`` as those
numbers, and re-keys ``optimizer.state`` by them, entry by entry: at 5,000 parameters that is
several milliseconds of every save, for an answer that changes only when the parameters do.
``OptimizerStates`` keeps, per optimizer, the parameter ids it numbered and the numbering; a save
whose groups list the same parameters (checked as whole id lists, compared in C) reuses it, and
the state's keys likewise. What it returns is made as torch makes it: every group's entries
except ``params`` (read now: a scheduler changes ``lr``), then ``params`` as a new list, and the
state as a new dict of the same per-parameter dicts, in ``optimizer.state``'s order.

Only an optimizer whose ``state_dict`` is torch's own, with no state-dict hook, is read so; and
the first time an optimizer is numbered, torch's ``state_dict()`` is asked too and must give the
same structure, else that optimizer always goes to ``state_dict()`` (another torch, another
numbering). Anything else calls ``state_dict()``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

_TORCH_STATE_DICT = torch.optim.Optimizer.state_dict


@dataclass
class _Numbering:
    optimizer: weakref.ref[Any]
    ids: list[list[int]]               # per group, the ids of its params
    params: list[list[int]]            # per group, its params as numbers
    index: dict[int, int]              # id(param) -> number
    state_ids: list[int] = field(default_factory=list)  # ids of the state's keys, in order
    state_keys: list[Any] = field(default_factory=list)  # the packed keys (numbers, or the key itself)


class OptimizerStates:
    """The numbering of the optimizers of one checkpointer's states (see the module's docstring)."""

    def __init__(self) -> None:
        self._numbered: dict[int, _Numbering] = {}
        self._refused: weakref.WeakSet[Any] = weakref.WeakSet()

    def state_dict(self, optimizer: Any) -> Any:
        """``optimizer.state_dict()``'s value, numbered from the last save's numbering when it holds."""
        if not _plain(optimizer) or optimizer in self._refused:
            return optimizer.state_dict()
        groups = optimizer.param_groups
        ids = [list(map(id, g["params"])) for g in groups]
        numbering = self._numbered.get(id(optimizer))
        fresh = numbering is None or numbering.optimizer() is not optimizer or numbering.ids != ids
        if fresh:
            numbering = self._number(optimizer, ids)
        assert numbering is not None
        state = optimizer.state
        keys = list(state)
        key_ids = list(map(id, keys))
        if key_ids != numbering.state_ids:
            try:
                numbering.state_keys = [numbering.index[id(k)] if isinstance(k, torch.Tensor) else k for k in keys]
            except KeyError:  # state of a tensor no group lists: torch's own call says what it says
                return optimizer.state_dict()
            numbering.state_ids = key_ids
        packed = {"state": dict(zip(numbering.state_keys, state.values(), strict=True)),
                  "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": list(numbers)}
                                   for g, numbers in zip(groups, numbering.params, strict=True)]}
        if fresh and not _same(packed, optimizer.state_dict()):
            self._refused.add(optimizer)
            self._numbered.pop(id(optimizer), None)
            return optimizer.state_dict()
        return packed

    def _number(self, optimizer: Any, ids: list[list[int]]) -> _Numbering:
        """Number the parameters as ``Optimizer.state_dict`` does: a parameter seen in an earlier
        group keeps its first number, and each group's numbers start after the last group's count."""
        index: dict[int, int] = {}
        params: list[list[int]] = []
        start = 0
        for group_ids in ids:
            index.update({pid: i for i, pid in enumerate(group_ids, start) if pid not in index})
            params.append([index[pid] for pid in group_ids])
            start += len(group_ids)
        if len(self._numbered) > 64:  # (optimizers come and go in a long session: keep the live ones)
            self._numbered = {k: n for k, n in self._numbered.items() if n.optimizer() is not None}
        numbering = self._numbered[id(optimizer)] = _Numbering(weakref.ref(optimizer), ids, params, index)
        return numbering


def _plain(optimizer: Any) -> bool:
    """Whether ``optimizer.state_dict()`` is torch's own with nothing hooked into it."""
    if type(optimizer).state_dict is not _TORCH_STATE_DICT or "state_dict" in vars(optimizer):
        return False
    pre = getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_state_dict_post_hooks", None)
    return pre is not None and post is not None and not pre and not post


def _same(ours: dict[str, Any], theirs: Any) -> bool:
    """The structure torch's ``state_dict()`` gave equals ours: keys in order, the groups' entries,
    the state's keys in order and the very same per-parameter dicts."""
    try:
        if list(theirs) != list(ours) or list(theirs["state"]) != list(ours["state"]):
            return False
        if any(a is not b for a, b in zip(theirs["state"].values(), ours["state"].values(), strict=True)):
            return False
        groups = theirs["param_groups"]
        return len(groups) == len(ours["param_groups"]) and all(
            list(a) == list(b) and all(a[k] is b[k] or a[k] == b[k] for k in a)
            for a, b in zip(groups, ours["param_groups"], strict=True))
    except Exception:  # noqa: BLE001  (any other shape: not ours to read)
        return False
