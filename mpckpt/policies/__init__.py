"""Public, pure decisions over committed checkpoints: retention (which to keep).

Policies are objects combined with ``|``; they never touch storage, and read the clock only
through a function they are given.
"""

from mpckpt.policies.retention import KeepAny, KeepBest, KeepEvery, KeepLast, KeepNewerThan, RetentionPolicy

__all__ = ["KeepAny", "KeepBest", "KeepEvery", "KeepLast", "KeepNewerThan", "RetentionPolicy"]
