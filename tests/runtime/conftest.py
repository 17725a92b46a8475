import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dist_pool import DistPool  # noqa: E402


@pytest.fixture(scope="session")
def pool2():
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = DistPool(4)
    yield pool
    pool.close()
