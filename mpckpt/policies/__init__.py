"""Public, pure decisions: which committed checkpoints to keep (retention) and when to save (triggers).

Policies are objects combined with ``|``; they never touch storage, and read the clock only
through what they are given.
"""

from mpckpt.policies.retention import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    KeepNewerThan,
    RetentionPolicy,
)
from mpckpt.policies.triggers import AnyTrigger, EveryNSeconds, EveryNSteps, Trigger

__all__ = ["AnyTrigger", "EveryNSeconds", "EveryNSteps", "KeepAny", "KeepBest", "KeepEvery", "KeepInterval", "KeepLast",
           "KeepNewerThan", "RetentionPolicy", "Trigger"]
