import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lab import topo  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="end-to-end tests need root (network namespaces, TUN)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture
def make_lab():
    """Build labs that are always torn down, whatever the test does."""
    labs = []

    def make(**kw):
        lab = topo.Lab(**kw).up()
        labs.append(lab)
        return lab

    yield make
    for lab in labs:
        lab.down()


def report(msg):
    """Measured figures go to the terminal (pytest -s) and to the CI log."""
    print(f"[measure] {msg}", flush=True)
