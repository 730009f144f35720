"""Unit tests of ``mpckpt.storage._retry``: what is retried, how long it waits, what it raises."""

from __future__ import annotations

import pytest

from mpckpt.errors import CheckpointNotFoundError, ConfigError, TransientStorageError
from mpckpt.storage._retry import backoff_s, retry


class Flaky:
    """Fails with the given errors, one per call, then returns ``"done"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_success_needs_no_sleep() -> None:
    sleeps: list[float] = []
    assert retry(Flaky(), what="x", sleep=sleeps.append) == "done"
    assert sleeps == []


def test_transient_errors_are_retried_with_exponential_capped_backoff(caplog) -> None:
    fn = Flaky(*[TransientStorageError("503")] * 4)
    sleeps: list[float] = []
    with caplog.at_level("WARNING", logger="mpckpt"):
        assert retry(fn, what="x", attempts=5, base_s=1.0, max_s=5.0, sleep=sleeps.append, rng=lambda: 1.0) == "done"
    assert fn.calls == 5
    assert sleeps == [1.0, 2.0, 4.0, 5.0]  # doubling, capped at max_s
    # every retry is a warning naming what, why and which attempt comes next
    assert [r.getMessage() for r in caplog.records][-1] == "mpckpt: x failed (503); retrying in 5.0 s (attempt 5 of 5)"
    assert len(caplog.records) == 4


def test_jitter_scales_each_wait() -> None:
    sleeps: list[float] = []
    retry(Flaky(TransientStorageError("a"), TransientStorageError("b")), what="x", base_s=0.2,
          sleep=sleeps.append, rng=lambda: 0.5)
    assert sleeps == pytest.approx([0.1, 0.2])


def test_backoff_never_exceeds_the_cap_and_never_goes_negative() -> None:
    for attempt in range(40):
        for r in (0.0, 0.3, 0.999):
            assert 0.0 <= backoff_s(attempt, base_s=0.2, max_s=5.0, rng=lambda r=r: r) <= 5.0


def test_the_budget_runs_out_with_a_transient_error_naming_what() -> None:
    last = TransientStorageError("connection reset")
    fn = Flaky(TransientStorageError("first"), TransientStorageError("second"), last)
    sleeps: list[float] = []
    with pytest.raises(TransientStorageError, match="write s3://b/run/1/shard-0") as info:
        retry(fn, what="write s3://b/run/1/shard-0", attempts=3, sleep=sleeps.append, rng=lambda: 0.0)
    assert fn.calls == 3 and len(sleeps) == 2  # no sleep after the last attempt
    assert info.value.__cause__ is last
    assert "3 attempts" in str(info.value)


@pytest.mark.parametrize("error", [CheckpointNotFoundError("gone"), ValueError("bug"), KeyboardInterrupt()])
def test_other_errors_are_not_retried(error: BaseException) -> None:
    fn = Flaky(error)
    sleeps: list[float] = []
    with pytest.raises(type(error)):
        retry(fn, what="x", sleep=sleeps.append)
    assert fn.calls == 1 and sleeps == []


def test_a_single_attempt_does_not_retry() -> None:
    fn = Flaky(TransientStorageError("503"))
    with pytest.raises(TransientStorageError):
        retry(fn, what="x", attempts=1, sleep=lambda s: pytest.fail("slept"))


def test_attempts_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="attempts"):
        retry(Flaky(), what="x", attempts=0)
