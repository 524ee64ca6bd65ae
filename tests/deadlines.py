"""Deadlines that catch hangs without timing the machine: every wall-clock limit in the suite is
a base, sized on an idle 2-core machine running the whole suite (``-n auto``), times one factor.

The factor is ``RECIPES_TEST_TIME_FACTOR`` when it is set (a number >= 1: set it on a machine you
know to be slow). Otherwise the controller measures it once when the run starts, from a fixed
small workload (pure Python, as most of a test's CPU is), against what the same workload took
on the machine the bases were sized on, and exports it to the workers and every process they
start. A machine 3 times slower, or one shared with busy processes, gets 3 times the deadlines.
The factor never goes below 1: a faster machine keeps the bases.

A bound that is part of a claim (a survivor names a dead rank within the collective timeout) is
stated relative to that configured timeout in its test, and is not scaled here.
"""

from __future__ import annotations

import os
import statistics
import time

ENV = "RECIPES_TEST_TIME_FACTOR"
# What ``_workload`` took, median of 5, on the idle 2-core AMD EPYC machine the bases were sized
# on (2026-11-28).
REFERENCE_WORKLOAD_S = 0.055
MAX_FACTOR = 20.0  # past this a deadline is no longer a deadline: say so instead


class TimeFactorError(ValueError):
    pass


def _workload() -> float:
    started = time.perf_counter()
    total = 0
    for i in range(400_000):
        total += (i * i) % 7
    data = sorted(str(i) for i in range(40_000))
    assert total and data
    return time.perf_counter() - started


def measure() -> float:
    """The factor this machine needs now: the median workload time over the reference's."""
    elapsed = statistics.median(_workload() for _ in range(5))
    return min(MAX_FACTOR, max(1.0, elapsed / REFERENCE_WORKLOAD_S))


def parse(value: str) -> float:
    try:
        factor = float(value)
    except ValueError:
        raise TimeFactorError(
            f"{ENV}={value!r} is not a number; set it to a factor >= 1 (e.g. 3 on a machine "
            "3 times slower), or unset it and the suite measures one"
        ) from None
    if not 1.0 <= factor <= MAX_FACTOR:  # also refuses nan
        raise TimeFactorError(
            f"{ENV}={value!r} is out of range; set a factor from 1 to {MAX_FACTOR:g}"
        )
    return factor


def time_factor() -> float:
    """The run's factor: what the environment says, else measured (and then exported)."""
    value = os.environ.get(ENV)
    if value is None:
        factor = measure()
        os.environ[ENV] = f"{factor:.2f}"
        return float(os.environ[ENV])
    return parse(value)


def scaled(seconds: float) -> float:
    """A base deadline in seconds, times the run's factor."""
    return seconds * time_factor()
