"""Repository-wide pytest configuration: markers are declared in pyproject.toml; GPU lanes
select them with ``-m``. Tests that need hardware skip with a reason when it is absent."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--replays", type=int, default=3,
                     help="bitwise replays per determinism check (default 3)")


@pytest.fixture
def replays(request):
    return request.config.getoption("--replays")
