"""mpckpt: checkpoint PyTorch training without stopping it.

Public names only; everything else lives in modules with a leading underscore. Importing
the package is cheap: the names are loaded on first use, so uploader processes that import
``mpckpt._upload.worker`` never load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BudgetPolicy",
    "Checkpoint",
    "Checkpointer",
    "CheckpointerStats",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "LoopState",
    "PerRank",
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "RetentionPolicy",
    "SaveFuture",
    "SaveResult",
    "SaveStats",
    "SeededDataset",
    "Trigger",
    "UploadMode",
    "errors",
    "export_hf",
    "load",
    "__version__",
]
__version__ = "0.1.0"

_WHERE = {
    "BudgetPolicy": "mpckpt.config",
    "UploadMode": "mpckpt.config",
    "Checkpoint": "mpckpt.checkpoint",
    "Checkpointer": "mpckpt.checkpointer",
    "load": "mpckpt._read.view",
    "init_process_group": "mpckpt.process_group",
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
