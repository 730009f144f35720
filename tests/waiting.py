"""Waiting on an event in a test, never on time: one bounded poll for every test and test process.

``wait_until(predicate, timeout_s, what=...)`` calls ``predicate`` until it returns something
true and returns that; when ``timeout_s`` passes first it raises an ``AssertionError`` that names
``what`` and the time waited, so a test fails (never hangs) and says what did not happen.
``poll_until`` is the same poll answering ``None`` at the deadline instead, for a helper process
that must go on (a gated write, a worker that dies on its own deadline) rather than fail a test.

The poll sleeps ``poll_s`` (short, bounded by the time left) between two looks: it only paces the
looks; the test goes on as soon as the predicate says the event happened. A predicate may raise
(an assertion, ``pytest.fail``) to end the wait early, as when the process it waits on has died.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01


def poll_until(predicate: Callable[[], T], timeout_s: float, *, poll_s: float = POLL_S) -> T | None:
    """The first true answer of ``predicate`` within ``timeout_s`` seconds, or ``None`` once they pass
    (the predicate is asked once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = predicate()
        if answer:
            return answer
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(poll_s, left))


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str = "the condition", *,
               poll_s: float = POLL_S) -> T:
    """The first true answer of ``predicate``; an ``AssertionError`` naming ``what`` if none comes
    within ``timeout_s`` seconds."""
    started = time.monotonic()
    answer = poll_until(predicate, timeout_s, poll_s=poll_s)
    if not answer:
        raise AssertionError(f"waited {time.monotonic() - started:.1f} s (bound {timeout_s:g} s) for {what}: "
                             "it never happened")
    return answer
