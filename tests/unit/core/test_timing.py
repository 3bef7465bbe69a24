"""The phase timer: every instant of an interval charged to one phase, the parts summing to the interval."""

from __future__ import annotations

import threading
import time

import pytest

from sparrow.timing import OTHER, PhaseError, PhaseTimer


class Clock:
    """A clock the test moves by hand (integer nanoseconds)."""

    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now

    def tick(self, ns: int) -> None:
        self.now += ns


def test_parts_sum_to_the_interval_exactly():
    clock = Clock()
    timer = PhaseTimer(("a", "b"), clock)
    clock.tick(7)  # nothing open: other
    with timer.phase("a"):
        clock.tick(100)
    with timer.phase("b"):
        clock.tick(30)
    with timer.phase("a"):
        clock.tick(5)
    clock.tick(3)
    assert timer.take_ns() == {"a": 105, "b": 30, OTHER: 10}
    # The next interval starts where the last one ended.
    clock.tick(11)
    assert timer.take_ns() == {"a": 0, "b": 0, OTHER: 11}


def test_a_nested_phase_pauses_the_outer_one():
    clock = Clock()
    timer = PhaseTimer(("score", "exact"), clock)
    with timer.phase("score"):
        clock.tick(10)
        with timer.phase("exact"):
            clock.tick(4)
        clock.tick(6)
        with timer.phase("score"):  # the same phase again inside itself: still one phase's time
            clock.tick(1)
    assert timer.take_ns() == {"score": 17, "exact": 4, OTHER: 0}


def test_a_phase_open_across_take_goes_on_into_the_next_interval():
    clock = Clock()
    timer = PhaseTimer(("wait",), clock)
    with timer.phase("wait"):
        clock.tick(20)
        assert timer.take_ns() == {"wait": 20, OTHER: 0}
        clock.tick(5)
    clock.tick(2)
    assert timer.take_ns() == {"wait": 5, OTHER: 2}


def test_real_clock_seconds_sum_to_wall_time():
    timer = PhaseTimer(("sleep",))
    start = time.monotonic_ns()
    timer.take()  # starts a fresh interval now
    with timer.phase("sleep"):
        time.sleep(0.02)
    time.sleep(0.01)
    ns = timer.take_ns()
    wall = time.monotonic_ns() - start
    assert sum(ns.values()) <= wall
    assert ns["sleep"] >= 20_000_000 and ns[OTHER] >= 10_000_000
    assert all(v >= 0 for v in ns.values())


def test_seconds_are_the_nanoseconds():
    clock = Clock()
    timer = PhaseTimer(("a",), clock)
    with timer.phase("a"):
        clock.tick(1_500_000_000)
    clock.tick(250_000_000)
    assert timer.take() == {"a": 1.5, OTHER: 0.25}


def test_unknown_names_and_other_are_refused():
    timer = PhaseTimer(("a",))
    with pytest.raises(ValueError, match="not one of"):
        with timer.phase("typo"):
            pass
    with pytest.raises(ValueError, match="remainder"):
        PhaseTimer(("a", OTHER))


def test_closing_out_of_order_is_refused():
    timer = PhaseTimer(("a", "b"))
    outer, inner = timer.phase("a"), timer.phase("b")
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(PhaseError, match="still open"):
        outer.__exit__(None, None, None)


def test_another_thread_is_refused():
    timer = PhaseTimer(("a",))
    errors = []

    def use():
        try:
            with timer.phase("a"):
                pass
        except PhaseError as exc:
            errors.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert len(errors) == 1 and "another thread" in str(errors[0])


def test_timed_charges_each_call():
    clock = Clock()
    timer = PhaseTimer(("f",), clock)
    f = timer.timed("f", lambda n: clock.tick(n) or n)
    assert f(3) == 3 and f(4) == 4
    assert timer.take_ns() == {"f": 7, OTHER: 0}
