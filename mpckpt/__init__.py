"""mpckpt: checkpoint PyTorch training without stopping it.

Public names only; everything else lives in modules with a leading underscore. Importing
the package is cheap: the names are loaded on first use, so uploader processes that import
``mpckpt._upload.worker`` never load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name loads on first use (``_WHERE``)
    from mpckpt import errors as errors
    from mpckpt._futures import CheckpointerStats as CheckpointerStats
    from mpckpt._futures import SaveFuture as SaveFuture
    from mpckpt._futures import SaveResult as SaveResult
    from mpckpt._futures import SaveStats as SaveStats
    from mpckpt._view import load as load
    from mpckpt.checkpoint import Checkpoint as Checkpoint
    from mpckpt.checkpointer import Checkpointer as Checkpointer
    from mpckpt.config import BudgetPolicy as BudgetPolicy
    from mpckpt.config import UploaderPriority as UploaderPriority
    from mpckpt.config import UploadMode as UploadMode
    from mpckpt.data import ResumableLoader as ResumableLoader
    from mpckpt.data import ResumableSampler as ResumableSampler
    from mpckpt.data import SeededDataset as SeededDataset
    from mpckpt.healing import heal as heal
    from mpckpt.loop import LoopState as LoopState
    from mpckpt.options import Job as Job
    from mpckpt.options import Memory as Memory
    from mpckpt.options import Retention as Retention
    from mpckpt.options import Uploads as Uploads
    from mpckpt.per_rank import PerRank as PerRank
    from mpckpt.policies import EveryNSeconds as EveryNSeconds
    from mpckpt.policies import EveryNSteps as EveryNSteps
    from mpckpt.policies import KeepBest as KeepBest
    from mpckpt.policies import KeepEvery as KeepEvery
    from mpckpt.policies import KeepInterval as KeepInterval
    from mpckpt.policies import KeepLast as KeepLast
    from mpckpt.policies import RetentionPolicy as RetentionPolicy
    from mpckpt.policies import Trigger as Trigger
    from mpckpt.process_group import init_process_group as init_process_group
    from mpckpt.rng import RNGState as RNGState

__all__ = [
    "BudgetPolicy",
    "Checkpoint",
    "Checkpointer",
    "CheckpointerStats",
    "EveryNSeconds",
    "EveryNSteps",
    "Job",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "LoopState",
    "Memory",
    "PerRank",
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "Retention",
    "RetentionPolicy",
    "SaveFuture",
    "SaveResult",
    "SaveStats",
    "SeededDataset",
    "Trigger",
    "UploadMode",
    "UploaderPriority",
    "Uploads",
    "errors",
    "export_hf",
    "heal",
    "init_process_group",
    "load",
    "__version__",
]
__version__ = "0.1.0"

_WHERE = {
    "BudgetPolicy": "mpckpt.config",
    "UploadMode": "mpckpt.config",
    "UploaderPriority": "mpckpt.config",
    "Memory": "mpckpt.options",
    "Uploads": "mpckpt.options",
    "Retention": "mpckpt.options",
    "Job": "mpckpt.options",
    "Checkpoint": "mpckpt.checkpoint",
    "Checkpointer": "mpckpt.checkpointer",
    "load": "mpckpt._view",
    "init_process_group": "mpckpt.process_group",
    "heal": "mpckpt.healing",
    "export_hf": "mpckpt.cli.export",
    "KeepBest": "mpckpt.policies",
    "KeepEvery": "mpckpt.policies",
    "KeepInterval": "mpckpt.policies",
    "KeepLast": "mpckpt.policies",
    "RetentionPolicy": "mpckpt.policies",
    "EveryNSeconds": "mpckpt.policies",
    "EveryNSteps": "mpckpt.policies",
    "Trigger": "mpckpt.policies",
    "LoopState": "mpckpt.loop",
    "PerRank": "mpckpt.per_rank",
    "RNGState": "mpckpt.rng",
    "ResumableLoader": "mpckpt.data",
    "ResumableSampler": "mpckpt.data",
    "SeededDataset": "mpckpt.data",
    "CheckpointerStats": "mpckpt._futures",
    "SaveFuture": "mpckpt._futures",
    "SaveResult": "mpckpt._futures",
    "SaveStats": "mpckpt._futures",
}


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("mpckpt.errors")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mpckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
