"""The tests' one bounded wait (``tests.waiting``): it answers at the event, fails naming what it
waited for, and never hangs."""

from __future__ import annotations

import threading

import pytest

from tests.waiting import poll_until, wait_until


def test_the_first_true_answer_is_returned() -> None:
    answers = iter([0, None, [], "ready", "later"])
    assert wait_until(lambda: next(answers), 5, "the third answer", poll_s=0.001) == "ready"
    assert next(answers) == "later"  # asked no more once it answered


def test_an_event_from_another_thread_ends_the_wait() -> None:
    happened = threading.Event()
    threading.Timer(0.05, happened.set).start()
    assert wait_until(happened.is_set, 30, "the timer")


def test_a_deadline_passed_fails_naming_what_and_how_long() -> None:
    with pytest.raises(AssertionError, match=r"waited 0\.\d s \(bound 0\.05 s\) for the gate to open"):
        wait_until(lambda: False, 0.05, "the gate to open")
    assert poll_until(lambda: False, 0.05) is None
    assert poll_until(lambda: False, 0) is None  # asked once, no wait


def test_a_predicate_that_raises_ends_the_wait_with_its_error() -> None:
    def dead() -> bool:
        raise AssertionError("the writer ended")

    with pytest.raises(AssertionError, match="the writer ended"):
        wait_until(dead, 30, "the writer's first commit")
