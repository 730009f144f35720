"""``LoopState``: the variables a training loop carries from one step to the next, saved with it.

Besides the model, the optimizer, the generators and the data position, a loop often carries
values of its own between steps: an RNN's hidden state, a learning rate it anneals by hand,
the best validation loss, a running total, where in the data the next batch starts. Each one
decides what the steps after a resume compute. Kept in local variables, each has to be copied
into the saved state and back by hand, and one that is forgotten makes a resumed run differ
from an uninterrupted one with no error. A ``LoopState`` is the one place they live: the loop
reads and writes ``loop.lr`` itself, so a save stores the current value and there is no copy
to forget::

    loop = mpckpt.LoopState(epoch=0, lr=20.0, best_val=math.inf, total_loss=0.0,
                            hidden=model.init_hidden(batch_size))
    state = {"model": model, "optim": opt, "rng": mpckpt.RNGState(), "loop": loop}
    ckpt.restore(state)        # loop.lr, loop.hidden ... hold the saved values again

It is an object with ``state_dict()`` / ``load_state_dict()`` (the ``Stateful`` protocol of
torch.distributed.checkpoint and torchdata), so ``save`` and ``restore`` call it as they call a
module; ``mpckpt.load`` gives its variables as a plain dict.

Invariants:

* The variables are the ones declared at construction, plus those added on purpose with
  ``declare``. Assigning a name that is not declared is an ``AttributeError`` naming the
  closest declared one: a typo (``loop.best_vall = ...``) would otherwise be a variable that is
  never saved.
* ``load_state_dict`` is strict: a checkpoint that lacks a declared variable, or holds one this
  holder does not declare, is a ``StateError`` naming them, and nothing changes;
  ``strict=False`` (``restore(state, strict=False)``) takes the variables that match.
* ``state_dict()`` gives the values as they are at that moment, tensors detached (no autograd
  graph is stored or kept alive), and ``save`` copies them before it returns: they are not
  parameters, so an overlapped save copies them at once too. The loop may then reassign them
  or change them in place.
* After a load each variable holds the checkpoint's value, as a new object: a tensor is the
  checkpoint's tensor, moved to the device of the tensor it replaces (tensors in tuples, lists
  and dicts too). A ``torch.Generator`` is the exception: it is stored as its state (a uint8
  tensor) and restored in place with ``set_state``, since samplers and the loop hold on to it.
* Values are what a state may hold (tensors, numbers, strings, tuples, lists and dicts of
  them, ...); anything else is refused by ``save`` with an error naming ``<key>.<variable>``.

In a multi-rank job a ``LoopState`` is replicated, as every plain value is: one rank's values
are stored and every rank gets them back. Values that differ per rank (the hidden state of a
rank's own batches, a running loss over them) go in a holder of their own under
``mpckpt.PerRank(mpckpt.LoopState(...))``.
"""

from __future__ import annotations

import difflib
import keyword
from collections.abc import Mapping
from typing import Any

import torch

from mpckpt.errors import ConfigError, StateError

_SHOWN = 5  # variables named in one error


class LoopState:
    """The variables a loop carries between steps, as attributes that are saved and restored.

    ``LoopState(**initial)`` declares each variable with its initial value; ``loop.name``
    reads it and ``loop.name = value`` sets it. Put the holder in the state you save.
    """

    __slots__ = ("_values",)

    def __init__(self, **initial: Any) -> None:
        object.__setattr__(self, "_values", {})
        self.declare(**initial)

    def declare(self, **variables: Any) -> None:
        """Add variables with their initial values (each name once; set a declared one by assigning it)."""
        values: dict[str, Any] = self._values
        for name in variables:
            if name in values:
                raise ConfigError(f"LoopState: variable {name!r} is declared already; set it with loop.{name} = ...")
            _check_name(name)
        values.update(variables)

    def __getattr__(self, name: str) -> Any:  # only for names that are not methods or slots
        if name.startswith("_"):  # copy and pickle look for hooks before _values is set
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"LoopState has no variable {name!r}{self._closest(name)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        values = self._values
        if name not in values:
            raise AttributeError(f"LoopState has no variable {name!r}{self._closest(name)}; only declared variables "
                                 f"are saved: declare it with LoopState({name}=...) or loop.declare({name}=...)")
        values[name] = value

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"LoopState: variable {name!r} cannot be deleted; every declared variable is saved "
                             "and restored (set it to None instead)")

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *self._values})

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle: the variables, declared again
        return _rebuild, (self._values,)

    def __repr__(self) -> str:
        return f"LoopState({', '.join(f'{k}={_short(v)}' for k, v in self._values.items())})"

    def _closest(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._values), n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def state_dict(self) -> dict[str, Any]:
        """Every variable's value now: tensors detached, generators as their state (uint8 tensors)."""
        return {name: _saved(value) for name, value in self._values.items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Give every variable its value in ``state`` (what ``state_dict`` returned, as loaded).

        Strict: a declared variable that ``state`` lacks, or a variable of ``state`` that is
        not declared, is a ``StateError`` naming them, and nothing changes. ``strict=False``
        loads the variables that match and leaves the others as they are.
        """
        if not isinstance(state, Mapping):
            raise StateError(f"LoopState: the checkpoint holds a {type(state).__name__} here, not a LoopState's "
                             "variables; save the LoopState under this key, or drop it from the state you restore")
        values: dict[str, Any] = self._values
        missing = [name for name in values if name not in state]
        extra = [str(name) for name in state if name not in values]
        if strict and (missing or extra):
            raise StateError(_mismatch(missing, extra), key=(missing or extra)[0])
        generators: list[tuple[torch.Generator, torch.Tensor]] = []
        restored = {name: _restored(values[name], state[name], name, generators) for name in values if name in state}
        # INVARIANT: nothing changes before every variable was converted and checked: an error changes nothing
        for generator, generator_state in generators:
            generator.set_state(generator_state)
        values.update(restored)


def _rebuild(values: dict[str, Any]) -> LoopState:
    return LoopState(**values)


def _check_name(name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(f"LoopState: variable name {name!r} is not a Python identifier; name it as a variable")
    if name.startswith("_"):
        raise ConfigError(f"LoopState: variable name {name!r} starts with '_' (names of the holder's own); "
                          "name it without the underscore")
    if hasattr(LoopState, name):
        raise ConfigError(f"LoopState: variable name {name!r} is the name of a LoopState method; choose another")


def _mismatch(missing: list[str], extra: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"the checkpoint lacks {_names(missing)} that this LoopState declares (a checkpoint saved "
                     "before the variable was added, or without it): the run would go on from its initial value")
    if extra:
        parts.append(f"the checkpoint holds {_names(extra)} that this LoopState does not declare: declare "
                     "it (LoopState(name=...)) so that the run goes on with its saved value")
    return ("LoopState: " + "; ".join(parts) + ". Restore with strict=False to load the variables that match "
            "and leave the others")


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"variable{'s' if len(names) > 1 else ''} {shown}{more}"


def _saved(value: Any) -> Any:
    """What ``state_dict`` gives for ``value``: tensors detached, generators as their state."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, torch.Generator):
        return value.get_state()
    if type(value) in (tuple, list):
        return type(value)(_saved(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its class
        namedtuple: Any = type(value)
        return namedtuple._make(_saved(v) for v in value)
    if type(value) is dict:
        return {k: _saved(v) for k, v in value.items()}
    return value


def _restored(current: Any, loaded: Any, path: str, generators: list[tuple[torch.Generator, torch.Tensor]]) -> Any:
    """What a variable holds after a load: ``loaded``, tensors on ``current``'s devices; a generator
    stays ``current``, and its checked state is added to ``generators`` to be set in place."""
    if isinstance(current, torch.Generator):
        if not isinstance(loaded, torch.Tensor):
            raise StateError(f"LoopState: variable {path!r} is a torch.Generator and the checkpoint holds a "
                             f"{type(loaded).__name__} there, not a generator's state", key=path)
        generator_state = loaded.to(torch.uint8)
        try:
            torch.Generator(device=current.device).set_state(generator_state)  # a check on a scratch generator
        except RuntimeError as e:
            raise StateError(f"LoopState: variable {path!r}: the checkpoint's generator state does not fit this "
                             f"torch.Generator on {current.device} ({e})", key=path) from e
        generators.append((current, generator_state))
        return current
    if isinstance(current, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return loaded if loaded.device == current.device else loaded.to(current.device)
    if isinstance(current, (tuple, list)) and isinstance(loaded, (tuple, list)) and len(current) == len(loaded):
        items = [_restored(c, v, f"{path}.{i}", generators)
                 for i, (c, v) in enumerate(zip(current, loaded, strict=True))]
        if isinstance(loaded, tuple) and hasattr(loaded, "_fields"):
            namedtuple: Any = type(loaded)
            return namedtuple._make(items)
        return tuple(items) if isinstance(loaded, tuple) else items
    if isinstance(current, dict) and isinstance(loaded, dict):
        return {k: _restored(current[k], v, f"{path}.{k}", generators) if k in current else v
                for k, v in loaded.items()}
    return loaded


def _short(value: Any) -> str:
    """A variable's value for ``repr``: tensors by dtype and shape, long values cut."""
    if isinstance(value, torch.Tensor):
        where = "" if value.device.type == "cpu" else f", {value.device}"
        return f"tensor({str(value.dtype).removeprefix('torch.')}, {list(value.shape)}{where})"
    if isinstance(value, torch.Generator):
        return f"Generator({value.device})"
    if type(value) in (tuple, list):
        inner = ", ".join(_short(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})" if type(value) is tuple else f"[{inner}]"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
