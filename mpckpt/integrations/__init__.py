"""Drop-in integrations with the frameworks people train with.

``lightning`` (a ``CheckpointIO`` plugin), ``transformers`` (a ``TrainerCallback``) and ``ray``
(``report`` in place of ``ray.train.report``) each live in a module of their own that imports
its framework there and only there: the core never imports a framework, and importing
``mpckpt`` stays cheap. A missing framework is an ``ImportError`` that says what to install
(``require``).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """``module``, imported, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"mpckpt.integrations.{extra} needs {module.split('.')[0]}, which is not installed: "
                          f"pip install 'mpckpt[{extra}]'") from e
