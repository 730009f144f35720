"""The keeper's threads are running when it is made (a thread started inside a save waits for the
process's memory map behind the pages being faulted in), and each job of its pools gets a thread."""

from __future__ import annotations

import threading

from mpckpt._keep.keeper import running_threads


def test_running_threads_are_up_when_returned_and_go_at_shutdown() -> None:
    pool = running_threads(2, "mpckpt-test-up")
    try:
        names = [t.name for t in threading.enumerate() if t.name.startswith("mpckpt-test-up")]
        assert len(names) == 2, names
        both = threading.Barrier(3)  # two jobs at once: each has a thread of its own
        jobs = [pool.submit(both.wait, 10.0) for _ in range(2)]
        both.wait(10.0)
        assert [j.result(10.0) is not None for j in jobs] == [True, True]
    finally:
        pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("mpckpt-test-up")]
