"""Bounded retries with exponential backoff and full jitter, shared by the remote backends.

Only ``TransientStorageError`` is retried: backends translate their client's throttling,
5xx and connection errors into it before this helper sees them, and every other error (not
found, conflict, bad credentials) propagates on the first attempt. After the last attempt the
failure is raised as ``TransientStorageError`` naming what was being done, chained to the last
cause. The clock and the random source are parameters so tests never sleep.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from mpckpt.errors import ConfigError, TransientStorageError

log = logging.getLogger("mpckpt")

T = TypeVar("T")

#: Errors that mean a bug in mpckpt or a client library, never a storage condition: the
#: backends re-raise them at once instead of translating or retrying them.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, AssertionError, NotImplementedError)

DEFAULT_ATTEMPTS = 5
DEFAULT_BASE_S = 0.2
DEFAULT_MAX_S = 5.0


def backoff_s(attempt: int, *, base_s: float, max_s: float, rng: Callable[[], float]) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (0-based): full jitter."""
    ceiling = min(max_s, base_s * (2 ** attempt))
    return ceiling * rng()


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int = DEFAULT_ATTEMPTS,
    base_s: float = DEFAULT_BASE_S,
    max_s: float = DEFAULT_MAX_S,
    sleep: Callable[[float], None] = time.sleep,
    rng: Callable[[], float] = random.random,
) -> T:
    """Call ``fn`` until it succeeds, retrying ``TransientStorageError`` up to ``attempts`` times.

    ``what`` describes the operation and its target (``"upload s3://b/run/1/shard.st"``); it
    names the failure when the budget runs out.
    """
    if attempts < 1:
        raise ConfigError(f"retry attempts must be at least 1, got {attempts}")
    for attempt in range(attempts):
        try:
            return fn()
        except TransientStorageError as e:
            if attempt + 1 >= attempts:
                raise TransientStorageError(
                    f"{what}: still failing after {attempts} attempts ({e}); "
                    "check the storage service and the network, then save again"
                ) from e
            wait_s = backoff_s(attempt, base_s=base_s, max_s=max_s, rng=rng)
            log.warning("mpckpt: %s failed (%s); retrying in %.1f s (attempt %d of %d)",
                        what, e, wait_s, attempt + 2, attempts)
            sleep(wait_s)
    raise AssertionError("unreachable")  # pragma: no cover
