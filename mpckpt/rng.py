"""``RNGState``: every random number generator a training loop draws from, as one state.

Put it in the state you save (``{"model": model, "optim": opt, "rng": mpckpt.RNGState()}``)
and ``restore`` puts the generators back where they were at the save, so dropout masks, data
shuffling and augmentation after a resume are the ones an uninterrupted run would have drawn.

What it covers: torch's CPU generator, every CUDA device's generator (when CUDA is
available), Python's ``random``, and NumPy's global generator (``numpy.random``) when NumPy
is installed. Every part is stored as tensors and plain numbers, so the checkpoint needs no
pickle. Generators a user created themselves (a ``torch.Generator``, a NumPy ``Generator``)
are theirs to save (``gen.get_state()`` is a tensor; a NumPy ``bit_generator.state`` is a dict
of numbers).

Loading is strict about what it can honour: a checkpoint with NumPy's state on a machine
without NumPy, or with CUDA states for more devices than this machine has, is a
``StateError`` naming the part, rather than a resume that silently draws different numbers.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

import torch

from mpckpt.errors import StateError


class RNGState:
    """torch (CPU and CUDA), Python ``random`` and NumPy's global generator, as one state."""

    def state_dict(self) -> dict[str, Any]:
        """The state of every generator, as tensors and plain values."""
        version, internal, gauss_next = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next},
        }
        if torch.cuda.is_available():
            state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
        numpy = _numpy(needed=False)
        if numpy is not None:
            name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
            state["numpy"] = {"name": str(name), "keys": torch.tensor(keys.tolist(), dtype=torch.int64),
                              "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put every generator back to ``state`` (what ``state_dict`` returned)."""
        if not isinstance(state, dict) or "torch" not in state or "python" not in state:
            raise StateError("RNGState: the checkpoint does not hold an RNGState here (no 'torch' and 'python' "
                             "parts); save mpckpt.RNGState() under this key, or drop it from the state you restore")
        torch.set_rng_state(_tensor(state["torch"], torch.uint8, "torch"))
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in _tensor(py["internal"], torch.int64, "python")),
                         py["gauss_next"]))
        if "cuda" in state:
            cuda = list(state["cuda"])
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if len(cuda) > available:
                raise StateError(f"RNGState: the checkpoint holds the generators of {len(cuda)} CUDA devices and this "
                                 f"machine has {available}; restore on a machine with as many devices, or drop 'cuda' "
                                 "from the saved RNGState", key="cuda")
            torch.cuda.set_rng_state_all([_tensor(s, torch.uint8, "cuda") for s in cuda])
        if "numpy" in state:
            numpy = _numpy(needed=True)
            np_state = state["numpy"]
            keys = numpy.asarray(_tensor(np_state["keys"], torch.int64, "numpy").tolist(), dtype=numpy.uint32)
            numpy.random.set_state((np_state["name"], keys, int(np_state["pos"]), int(np_state["has_gauss"]),
                                    float(np_state["cached_gaussian"])))


def _numpy(*, needed: bool) -> Any:
    """NumPy if it is installed; otherwise None, or with ``needed`` a ``StateError`` saying so."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        if not needed:
            return None
        raise StateError("RNGState: the checkpoint holds NumPy's generator state and NumPy is not installed here; "
                         "install numpy to resume exactly", key="numpy") from None


def _tensor(value: Any, dtype: torch.dtype, part: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise StateError(f"RNGState: part {part!r} of the checkpoint is a {type(value).__name__}, not a tensor",
                         key=part)
    return value.to(dtype)
