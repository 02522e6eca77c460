from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.proxy import FaultProxy
from tests.faults.scenario import Scenario


@pytest.fixture
def scenario(
    request: pytest.FixtureRequest, tmp_path: Path, name: str, pg_ready: None
) -> Iterator[Callable[[str], Scenario]]:
    """A factory of one scenario per test (its own directory, lock name and counter
    row); every worker it spawned is gone after the test, whatever happened."""
    from distlocks.fencing import unfenced
    from tests.testapp.models import Counter

    made: list[Scenario] = []

    def make(label: str) -> Scenario:
        with unfenced():
            row = Counter.objects.create(value=0)
        work = tmp_path / label
        work.mkdir()
        made.append(Scenario(label, work, name, row.pk))
        return made[-1]

    yield make
    for one in made:
        one.cleanup()


@pytest.fixture
def proxies() -> Iterator[Callable[[int], FaultProxy]]:
    """Start fault proxies in front of loopback ports; all closed after the test."""
    started: list[FaultProxy] = []

    def start(port: int) -> FaultProxy:
        started.append(FaultProxy(port).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.close()
