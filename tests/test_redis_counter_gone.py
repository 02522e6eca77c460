"""``fencing_counter(name)`` once the name's counter has expired, on Redis and Redlock:
it reads 0, as for a name never locked (what docs/backends.md says), and the next
token is still above every token issued before (the clock floor)."""

from __future__ import annotations

import pytest

from distlocks import get_backend
from distlocks.backends.base import Holder
from distlocks.backends.redis import FENCE_GRACE_MS, RedisBackend
from tests.waiting import wait_for

HOLDER = Holder("host", 1, "thread")


def fence_keys(alias: str, name: str) -> list[tuple[RedisBackend, str]]:
    backend = get_backend(alias)
    masters = getattr(backend, "masters", None) or [backend]
    return [(master, master.all_keys(name).fence) for master in masters]


@pytest.mark.parametrize("alias", ["redis", "redlock"])
def test_the_counter_reads_zero_once_gone_and_tokens_still_increase(alias: str, name: str) -> None:
    backend = get_backend(alias)
    tokens = []
    for owner in ("a", "b"):
        result = backend.acquire(name, owner, 0.2, HOLDER)
        assert result.acquired
        tokens.append(result.fencing_token)
        assert backend.fencing_counter(name) == result.fencing_token
        assert backend.release(name, owner) is True
    assert backend.fencing_counter(name) == tokens[-1]  # within the grace: still there
    wait_for(
        lambda: not any(master.client.exists(key) for master, key in fence_keys(alias, name)),
        limit=FENCE_GRACE_MS / 1000 + 30,
        what="the counter to expire",
    )
    assert backend.fencing_counter(name) == 0
    after = backend.acquire(name, "c", 10, HOLDER)
    assert after.acquired and after.fencing_token > tokens[-1]
    assert backend.fencing_counter(name) == after.fencing_token
    assert backend.release(name, "c") is True
