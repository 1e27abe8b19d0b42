import os
import sys

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

    yield make
    for lab in labs:
        lab.down()


@pytest.fixture
def make_lab():
    yield from teardown_always(lambda **kw: labctl.Lab(**kw).up())


def report(msg):
    """Measured figures go to the terminal (pytest -s) and to the CI log."""
    print(f"[measure] {msg}", flush=True)
