"""Pools of gloo worker processes shared by the whole session (tests/runtime/dist_pool.py):
the runtime tests and the reliability suite's training sample run on the same warm ranks
instead of starting (and importing torch in) new ones. Imported lazily: suites that need no
pool never import torch."""

import sys
from pathlib import Path

import pytest

RUNTIME_TESTS = Path(__file__).parent / "runtime"


def _pool(world: int):
    if str(RUNTIME_TESTS) not in sys.path:
        sys.path.insert(0, str(RUNTIME_TESTS))
    from dist_pool import DistPool

    return DistPool(world)


@pytest.fixture(scope="session")
def pool2():
    pool = _pool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = _pool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool8():
    pool = _pool(8)
    yield pool
    pool.close()
