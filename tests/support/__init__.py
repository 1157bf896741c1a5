"""What the tests share that is not a fixture: processes they start (``processes``), the
network-namespace fleet (``fleet``), the scripted OpenAI-compatible server (``scripted_server``) and
a live `lab.py sweep` watched for what it leaves behind (``sweep_run``).

Fixtures live in tests/conftest.py; these are plain modules, imported as ``tests.support.<name>``
(pytest puts the repository root on sys.path because tests/ is a package).
"""

import os

import pytest

# `make test` sets it: there a missing system dependency fails the test instead of skipping it, so
# a suite that ran green ran everything (scripts/test-setup.sh installs the dependencies first).
REQUIRE_ALL = "LAB_TESTS_REQUIRE_ALL"


def worker() -> tuple[int, int]:
    """This pytest-xdist worker's index and the number of workers; (0, 1) without xdist.

    What the tests pick from a shared space (ports, the fleet's subnets) comes from the worker's
    own slice of it, so tests running at once on two workers never pick the same one.
    """
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3" -> 3
    return int(name[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def slice_of(low: int, high: int) -> range:
    """This worker's share of range(low, high)."""
    index, count = worker()
    size = (high - low) // count
    return range(low + index * size, low + (index + 1) * size)


def require(missing: str | None) -> None:
    """Skip the test for ``missing`` (why it cannot run here), or fail it under `make test`."""
    if not missing:
        return
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{missing} ({REQUIRE_ALL}=1: make test runs every test)", pytrace=False)
    pytest.skip(missing)
