"""Put a loaded state back into the live objects of a training state (the last step of a restore).

In place where it matters: a tensor is overwritten (its shape must match), so everything that
refers to it (an optimizer, a tied weight) sees the restored values; a numpy array too, when
its shape and dtype match (otherwise its slot gets the loaded array); an object with
``load_state_dict`` (module, optimizer, scheduler, ``RNGState``) gets its part of the
checkpoint; a ``PerRank`` gets this rank's value; dicts, lists, tuples, namedtuples and dataclass instances are walked. Any other
value's slot (int, str, set, Enum member, path, datetime ...) gets the loaded value.

Strict by default, as ``torch.nn.Module.load_state_dict``: a key of the live state that the
checkpoint lacks, or a key of the checkpoint that the live state lacks, is an error. Keys are
dict keys, the keys of each module's state_dict (torch's own check, run with ``strict=False``
so that one ``StateError`` names every key with its full path), and the items of a list or
tuple that holds tensors or objects with ``load_state_dict``; a list or tuple without any whose
length changed is a value and takes the checkpoint's (a list in place). With ``strict=False`` what matches is
restored and the rest left as it is: keys only the live state has keep their values, keys only
the checkpoint has are ignored. Either way everything that matches is applied before the error
is raised, as torch does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from typing import Any

import torch

from mpckpt._codec.values import path_of
from mpckpt.errors import StateError
from mpckpt.per_rank import NOT_RESTORED, PerRank

log = logging.getLogger("mpckpt")
_SHOWN = 5  # keys named in a mismatch error, of each kind


@dataclasses.dataclass
class _Keys:
    missing: list[str] = dataclasses.field(default_factory=list)     # in the live state only
    unexpected: list[str] = dataclasses.field(default_factory=list)  # in the checkpoint only


def apply_state(target: Any, loaded: Any, *, strict: bool = True, source: str = "the checkpoint") -> Any:
    """Load ``loaded`` into ``target`` in place where possible; return what ``target`` becomes.

    ``source`` names the checkpoint in errors. Raises ``StateError`` for a value that cannot go
    where it should, and (``strict``) for keys that do not match.
    """
    keys = _Keys()
    try:
        out = _apply(target, loaded, "", strict, keys)
    except StateError as e:  # name the checkpoint: "state key 'model.fc.weight'" alone does not say which
        raise StateError(f"restoring {source}: {e}", key=e.key) from e
    if strict and (keys.missing or keys.unexpected):
        parts = []
        if keys.missing:
            parts.append(f"the state has {_some(keys.missing)} that the checkpoint lacks")
        if keys.unexpected:
            parts.append(f"the checkpoint has {_some(keys.unexpected)} that the state lacks")
        raise StateError(f"{source} does not match the state: {'; '.join(parts)}. Make the state hold the same keys, "
                         "or pass strict=False to restore the keys that match and leave the rest",
                         key=(keys.missing or keys.unexpected)[0])
    return out


def _some(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{len(keys)} key{'s' if len(keys) > 1 else ''} ({shown}{more})"  # 2 keys ('a', 'b')


def _loader(value: Any) -> Any:
    load = getattr(value, "load_state_dict", None)
    return load if callable(load) and not isinstance(value, type) else None


def _live(value: Any) -> bool:
    """Whether ``value`` holds something restored in place (a tensor, an object with ``load_state_dict``)."""
    if isinstance(value, torch.Tensor) or _loader(value) is not None:
        return True
    if isinstance(value, dict):
        return any(_live(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_live(v) for v in value)
    return False


def _apply(target: Any, loaded: Any, path: str, strict: bool, keys: _Keys) -> Any:
    where = path or "<root>"
    if loaded is NOT_RESTORED:  # a PerRank value of another world size, strict=False
        return target
    if isinstance(target, PerRank):
        if isinstance(loaded, PerRank):  # this rank's value (``_read.ranked``)
            value = loaded.value
        elif isinstance(loaded, list) and len(loaded) == 1:  # a single-process checkpoint's one value
            value = loaded[0]
        else:
            if not strict:
                return target
            count = len(loaded) if isinstance(loaded, list) else "another number of"
            raise StateError(f"state key {where!r} is a PerRank value and the checkpoint holds the values of {count} "
                             "ranks; a PerRank value goes back only to the same rank of a job of the same world size "
                             "(restore with strict=False to leave it as it is)", key=path)
        target.value = _apply(target.value, value, path, strict, keys)
        return target
    if isinstance(loaded, PerRank):
        return _apply(target, loaded.value, path, strict, keys)
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise StateError(f"state key {where!r}: checkpoint holds a {type(loaded).__name__}, not a tensor", key=path)
        if target.shape != loaded.shape:
            raise StateError(f"state key {where!r}: shape {tuple(loaded.shape)} in the checkpoint, "
                             f"{tuple(target.shape)} in memory", key=path)
        with torch.no_grad():
            # a leaf read in place (``_read.live``) is target's memory: torch returns at once; one read
            # into page-locked memory for a GPU tensor goes up asynchronously, ordered on the stream
            target.copy_(loaded, non_blocking=target.is_cuda and loaded.is_pinned())
        return target
    np = sys.modules.get("numpy")  # a live value cannot be a numpy array unless numpy is imported
    if np is not None and type(target) is np.ndarray:
        if (type(loaded) is np.ndarray and loaded.shape == target.shape and loaded.dtype == target.dtype
                and target.flags.writeable):
            np.copyto(target, loaded)
            return target
        return loaded
    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise StateError(f"state key {where!r}: checkpoint holds a {type(loaded).__name__}, not a dict", key=path)
        for k, v in loaded.items():
            if k in target:
                target[k] = _apply(target[k], v, path_of(path, k), strict, keys)
            else:
                keys.unexpected.append(path_of(path, k))
        keys.missing.extend(path_of(path, k) for k in target if k not in loaded)
        return target
    if isinstance(target, (list, tuple)) and isinstance(loaded, (list, tuple)):
        return _sequence(target, loaded, path, strict, keys)
    if (dataclasses.is_dataclass(target) and not isinstance(target, type) and type(loaded) is type(target)
            and _loader(target) is None):
        return _dataclass(target, loaded, path, strict, keys)
    load = _loader(target)
    if load is None:
        return loaded
    if isinstance(target, torch.nn.Module):
        _check_shapes(target, loaded, path)
    try:
        if isinstance(target, torch.nn.Module):
            result = load(loaded, strict=False)  # torch lists the keys; the error is raised once, for all of them
            keys.missing.extend(path_of(path, k) for k in getattr(result, "missing_keys", ()))
            keys.unexpected.extend(path_of(path, k) for k in getattr(result, "unexpected_keys", ()))
        elif _takes_strict(load):
            load(loaded, strict=strict)
        else:
            load(loaded)
    except StateError as e:  # an object of ours (RNGState, LoopState ...) names its own key: give it the path
        key = path_of(path, e.key) if e.key else path
        raise StateError(f"state key {where!r}: {e}", key=key) from e
    except Exception as e:  # torch's own refusal (an optimizer's groups, a scheduler's keys) names no key path
        raise StateError(f"state key {where!r}: {type(target).__name__}.load_state_dict refused the checkpoint's "
                         f"values ({type(e).__name__}: {e}); was it saved from another model or optimizer?",
                         key=path) from e
    return target


def _check_shapes(module: torch.nn.Module, loaded: Any, path: str) -> None:
    """A ``StateError`` naming every tensor whose shape differs (torch's own error names no checkpoint)."""
    if not isinstance(loaded, dict):
        return
    live = module.state_dict()
    wrong = [(k, tuple(v.shape), tuple(live[k].shape)) for k, v in loaded.items()
             if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor) and v.shape != live[k].shape]
    if not wrong:
        return
    shown = "; ".join(f"{path_of(path, k)!r}: {a} in the checkpoint, {b} in memory" for k, a, b in wrong[:_SHOWN])
    more = f"; and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else ""
    raise StateError(f"{len(wrong)} tensor{'s' if len(wrong) > 1 else ''} of {type(module).__name__} "
                     f"{path or '<root>'!r} differ in shape: {shown}{more}. The checkpoint was saved from a model of "
                     "another shape (width, layer type): build the same model, or restore into another root",
                     key=path_of(path, wrong[0][0]))


def _sequence(target: list | tuple, loaded: list | tuple, path: str, strict: bool, keys: _Keys) -> Any:
    if len(target) != len(loaded) and not _live(target):
        # values (no tensor, no object with load_state_dict): the checkpoint's, a list in place
        if isinstance(target, list) and isinstance(loaded, list):
            target[:] = loaded
            return target
        return loaded
    n = min(len(target), len(loaded))
    items = [_apply(target[i], loaded[i], path_of(path, i), strict, keys) for i in range(n)]
    keys.missing.extend(path_of(path, i) for i in range(n, len(target)))
    keys.unexpected.extend(path_of(path, i) for i in range(n, len(loaded)))
    if isinstance(target, list):
        target[:n] = items
        return target
    kind = type(loaded) if len(target) == len(loaded) else type(target)
    items += target[n:]
    return kind._make(items) if hasattr(kind, "_make") else kind(items)  # a namedtuple: the checkpoint's class


def _dataclass(target: Any, loaded: Any, path: str, strict: bool, keys: _Keys) -> Any:
    frozen = type(target).__dataclass_params__.frozen
    for f in dataclasses.fields(target):
        if not hasattr(loaded, f.name):
            continue
        new = getattr(loaded, f.name)
        if hasattr(target, f.name):
            new = _apply(getattr(target, f.name), new, path_of(path, f.name), strict, keys)
        if frozen:  # a frozen instance is not changed: the loaded one (holding the live tensors) takes its slot
            object.__setattr__(loaded, f.name, new)
        else:
            setattr(target, f.name, new)
    return loaded if frozen else target


def init_optimizer_state(state: Any) -> None:
    """Give every optimizer in ``state`` over sharded parameters (DTensors) that has no state yet the
    state its first step makes.

    A freshly created optimizer has no moments, so a restore would have nothing that says how
    its moments are sharded. As torch.distributed.checkpoint's ``set_state_dict`` does, it takes
    one step with zero gradients at learning rate 0 (nothing moves), and the restore then
    overwrites what that step made. Gradients the parameters already had are put back
    afterwards. An optimizer over plain tensors (one process, DDP) is left alone: its moments
    are read into fresh tensors that its ``load_state_dict`` takes as they are, which spares the
    restart a whole optimizer step (1.5 s for AdamW over 100 M parameters on one CPU core).
    """
    for optimizer in _optimizers(state, set()):
        if optimizer.state or not _over_dtensors(optimizer):
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        lrs = [group.get("lr") for group in optimizer.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            for group in optimizer.param_groups:
                if "lr" in group:
                    group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
            optimizer.step()
        except Exception as e:  # an optimizer whose step needs more (LBFGS: a closure): restored as it is
            log.warning("mpckpt: could not make the state of a fresh %s before restoring it (%s: %s); its state is "
                        "restored as saved", type(optimizer).__name__, type(e).__name__, e)
        finally:
            for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                if lr is not None:
                    group["lr"] = lr
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad


def _over_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor exists
    if dtensor is None:
        return False
    return any(isinstance(p, dtensor.DTensor) for group in optimizer.param_groups for p in group["params"])


def _optimizers(value: Any, seen: set[int]) -> list[torch.optim.Optimizer]:
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, PerRank):
        return _optimizers(value.value, seen)
    if isinstance(value, dict):
        return [o for v in value.values() for o in _optimizers(v, seen)]
    if isinstance(value, (list, tuple)):
        return [o for v in value for o in _optimizers(v, seen)]
    return []


def _takes_strict(load: Any) -> bool:
    try:
        return "strict" in inspect.signature(load).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
