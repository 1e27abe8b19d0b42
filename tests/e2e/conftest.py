import functools
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import labctl  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="end-to-end tests need root (network namespaces, TUN)")
        for item in items:
            item.add_marker(skip)


def teardown_always(build):
    """A fixture body: `build(...)` makes a lab; every lab made is torn down (`.down()`) after the
    test, whatever the test does."""
    labs = []

    def make(*args, **kw):
        lab = build(*args, **kw)
        labs.append(lab)
        return lab

    def down_all():
        while labs:
            labs.pop().down()

    make.down_all = down_all
    yield make
    down_all()


@pytest.fixture
def make_lab():
    yield from teardown_always(lambda **kw: labctl.Lab(**kw).up())


def report(msg):
    """Measured figures go to the terminal (pytest -s) and to the CI log."""
    print(f"[measure] {msg}", flush=True)


def stolen_ticks():
    """CPU time the hypervisor has given to other guests while this VM had work to run (all
    CPUs, in 1/100 s): the `steal` column of /proc/stat."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


# A measurement during which the hypervisor took the vCPUs away for more than this (ticks per
# second of the measurement, both vCPUs together: 0.5% of the machine) says little about the
# product: a stolen vCPU stalls the tunnel, the emulator and the traffic's endpoints for
# milliseconds at a time (a 1 ms sleep then oversleeps by more than 3 ms 1% of the time, up to
# 11 ms). The quiet runs test_emulator.py recorded stole 0.1-0.5 ticks/s; a noisy hour 1.8 idle
# and 8-100 under load.
NOISY_TICKS_PER_S = 1.0


class Window:
    """Stolen ticks over a measurement's wall time."""

    def __init__(self):
        self.t0, self.s0 = time.monotonic(), stolen_ticks()

    def rate(self):
        return (stolen_ticks() - self.s0) / max(time.monotonic() - self.t0, 1e-3)


def measured(test):
    """For a test whose assertions are figures measured on this shared 2-core host (rates, losses,
    RSS): when an assertion fails, the labs (of every `teardown_always` fixture the test takes)
    are torn down and the test runs once more on fresh ones;
    it fails if the second run fails too. A regression fails both runs; a neighbour's CPU burst
    during one 10 s measurement does not fail the suite. The first run's failure is printed, so the
    log shows every miss. Only for figure tests: a functional check never gets a second run.
    When both runs missed while the hypervisor stole the CPUs (`NOISY_TICKS_PER_S`), the test is
    skipped with both misses and the steal in its reason: the figure could not be measured on
    this host then (on a quiet host the same misses fail it)."""

    @functools.wraps(test)
    def run(*args, **kw):
        w1 = Window()
        try:
            return test(*args, **kw)
        except AssertionError as first:
            steal1 = w1.rate()
            report(f"MISSED on the first run (hypervisor steal {steal1:.1f} ticks/s), measuring once "
                   f"more on a fresh lab: {first!r}")
            for fixture in kw.values():
                if hasattr(fixture, "down_all"):
                    fixture.down_all()
            w2 = Window()
            try:
                return test(*args, **kw)
            except AssertionError as second:
                steal2 = w2.rate()
                if min(steal1, steal2) < NOISY_TICKS_PER_S:
                    raise
                report(f"MISSED twice on a noisy host (steal {steal1:.1f} and {steal2:.1f} ticks/s): "
                       f"{second!r}")
                pytest.skip(f"missed twice while the hypervisor stole the CPUs ({steal1:.1f} and "
                            f"{steal2:.1f} ticks/s, noisy from {NOISY_TICKS_PER_S}): {first!r}; "
                            f"{second!r}")

    return run
