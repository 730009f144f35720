"""mpckpt's own threads, and the one rule they share: none of them starts an OpenMP team.

PyTorch's CPU kernels split their work over OpenMP threads, and libgomp gives every thread that
enters a parallel region a team of its own, alive as long as that thread. Once the teams alive add
up to more threads than the process has CPUs, libgomp stops spin-waiting in all of them, the
training thread's included, and every parallel region of every training step pays for putting
its threads to sleep and waking them. One background thread of mpckpt's that had zeroed a slab
with ``torch`` once kept a nanoGPT-sized CPU step at 56 ms instead of 31 ms (2-core VM) for as
long as the Checkpointer stayed open (docs/benchmarks.md, "an open Checkpointer").

So every thread mpckpt starts (``Thread``, ``executor``) first caps its own OpenMP team at one
thread (``serial``): a torch op there runs on that thread alone, and the only team in the process
is the one the training thread had before mpckpt was opened. The cap is a per-thread setting of
the OpenMP runtime (``omp_set_num_threads`` called on that thread); torch's process-wide
``set_num_threads`` would also shrink the training thread's BLAS and its other pools.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import torch

_RUNTIME_NAME = re.compile(r"lib(g|i|)omp[^/]*\.(so|dylib)")  # libgomp (GNU), libiomp5 (Intel), libomp (LLVM)
_found: list[Callable[[int], Any]] | None = None
_finding = threading.Lock()


def _loaded_runtimes() -> list[str]:
    """The paths of the OpenMP runtimes loaded in this process: from its maps where there are
    any (Linux), else the ones that ship beside torch's own libraries."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if _RUNTIME_NAME.search(line)}
    except (OSError, IndexError):
        paths = {p for p in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*"))
                 if _RUNTIME_NAME.search(p)}
    return sorted(paths)


def _setters() -> list[Callable[[int], Any]]:
    """Each loaded OpenMP runtime's ``omp_set_num_threads`` (found once)."""
    global _found
    with _finding:
        if _found is None:
            _found = []
            for path in _loaded_runtimes():
                try:
                    _found.append(ctypes.CDLL(path).omp_set_num_threads)
                except (OSError, AttributeError):
                    continue  # not a runtime after all, or gone: nothing of it to cap
        return _found


def serial() -> None:
    """Cap the calling thread's OpenMP team at one thread: torch ops it runs later use no other
    thread. Called first by every thread mpckpt starts; never on the training thread."""
    torch.get_num_threads()  # torch sets this thread's OpenMP count on its first use: let it, then cap
    for set_threads in _setters():
        set_threads(1)


class Thread(threading.Thread):
    """A ``threading.Thread`` that runs ``serial`` before its target."""

    def run(self) -> None:
        serial()
        super().run()


def executor(count: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``count`` threads named ``name``_i, each ``serial``."""
    return concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix=name, initializer=serial)
