"""PostgreSQL tokens under concurrent raises of the ceiling G, force releases and a
crash in the middle of a raise burst (docs/safety.md, "PostgreSQL tokens").

A raise is a row lock on G's one row, held until its durable commit; every mint that
passes G at the same time queues on it while holding its own advisory lock. The
test makes every round a raise burst: at a quiet point (no mint in flight) G is set
down to the highest token issued so far (still at or above every token ever issued,
so invariant C holds), and every registry row's ceiling down to at most that G (each is
a promise that G on disk covers tokens up to it: invariant C also bounds them), so the
next mint of every name passes it. Threads, each with a
backend (a pool) of its own, lock shared and distinct names meanwhile, and a force
releaser bumps the shared names. It checks that no statement fails (a deadlock
between raises would be reported by the server after deadlock_timeout), that no
(name, token) is issued twice, and, after an immediate shutdown in the middle of the
last burst, that every token issued after the crash is above every token before it,
for any name. A raise committed asynchronously (lost in the crash) fails it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from distlocks.backends.base import Holder
from distlocks.backends.postgres import TABLE
from distlocks.backends.postgres.sql import EPOCH, FENCE
from distlocks.testing.servers import PostgresServer
from tests.test_postgres_durable import (  # noqa: F401 - the fixtures
    durable,
    durable_template,
)
from tests.test_postgres_token_crash import _ahead_of_the_clock, _backend, _crash, _cycle, _sql

HOLDER = Holder(host="test", pid=1, thread="burst")
THREADS = 4
SHARED = [f"burst:shared:{i}" for i in range(3)]
_owners = itertools.count()


def _ceiling_down_to_the_highest_token(server: PostgresServer) -> int:
    """G set down to the highest token issued in this server's lifetime (the rows, and
    F - 1 for those before the last crash), durably, and M removed (always safe: a key
    without a row then takes G + 1). Only at a quiet point. Every new name's first mint
    then passes G, and the first ones race to write M. The rows' ceilings go down with G
    (at most G, as invariant C requires), so known names meet G too."""
    (ceiling,) = _sql(
        server,
        f"""WITH top AS (
            SELECT greatest((SELECT max(fencing_token) FROM {TABLE}),
                            (SELECT floor - 1 FROM {EPOCH} WHERE id = 1)) AS t
        )
        UPDATE {FENCE} SET ceiling = (SELECT t FROM top)
        WHERE id = 1 AND (SELECT t FROM top) IS NOT NULL RETURNING ceiling""",
    )[0]
    _sql(server, f"UPDATE {TABLE} SET ceiling = least(ceiling, %s)", (ceiling,))
    _sql(server, f"DELETE FROM {EPOCH}")
    return int(ceiling)


def _evicted(name: str, exc: BaseException) -> bool:
    """An acquire of a shared name whose session the force releaser ended while its
    statement held the lock (twice: the backend retries once on a new connection)."""
    return name in SHARED and "terminated abnormally" in str(exc)


def _burst(
    server: PostgresServer,
    issued: list[tuple[str, int]],
    errors: list[BaseException],
    *,
    crash_after: int | None = None,
) -> None:
    """One round: THREADS lockers and one force releaser until each locker has done
    30 cycles (or, with crash_after, until that many tokens were issued in the round,
    then the server is crashed under them)."""
    lock = threading.Lock()
    stop = threading.Event()
    enough = threading.Event()
    start = len(issued)

    def locker(index: int) -> None:
        backend = _backend("off")
        try:
            for cycle in range(30):
                if stop.is_set():
                    return
                name = SHARED[cycle % len(SHARED)] if cycle % 2 else f"burst:{index}:{cycle}"
                owner = f"o{next(_owners)}"
                try:
                    result = backend.acquire(name, owner, 30.0, HOLDER, wait=10.0)
                except Exception as exc:
                    if crash_after is None and not _evicted(name, exc):
                        errors.append(exc)
                    if crash_after is None:
                        continue
                    return
                if not result.acquired:
                    errors.append(AssertionError(f"{name} not acquired in 10 s"))
                    return
                with lock:
                    issued.append((name, result.fencing_token))
                    if crash_after is not None and len(issued) - start >= crash_after:
                        enough.set()
                try:
                    backend.release(name, owner)  # False after a force release: fine
                except Exception as exc:
                    if crash_after is None:
                        errors.append(exc)
                    return
        finally:
            backend.close()

    def releaser() -> None:
        backend = _backend("off")
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                try:
                    backend.force_release(SHARED[i % len(SHARED)])
                except Exception as exc:
                    if crash_after is None:
                        errors.append(exc)
                    return
        finally:
            backend.close()

    threads = [threading.Thread(target=locker, args=(i,)) for i in range(THREADS)]
    evictor = threading.Thread(target=releaser)
    for thread in [*threads, evictor]:
        thread.start()
    if crash_after is not None:
        assert enough.wait(120), "the burst issued too few tokens"
        _crash(server)
        stop.set()
    for thread in threads:
        thread.join(120)
    stop.set()
    evictor.join(120)
    assert not any(t.is_alive() for t in [*threads, evictor]), "a thread is stuck"


def test_raise_bursts_with_force_releases_and_a_crash_in_the_middle(
    durable: PostgresServer,  # noqa: F811 - the fixture
    django_db_blocker: Any,
) -> None:
    issued: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    with django_db_blocker.unblock():
        # Tokens far ahead of the clock, so that only G and M order them across the
        # crash; every shared name once, so G can be set down to the rows' highest.
        _ahead_of_the_clock(durable)
        backend = _backend("off")
        try:
            for name in SHARED:
                issued.append((name, _cycle(backend, name)))
        finally:
            backend.close()
        raises = 0
        for _ in range(3):
            _ceiling_down_to_the_highest_token(durable)
            (before,) = _sql(durable, f"SELECT xmin::text FROM {FENCE}")[0]
            _burst(durable, issued, errors)
            assert not errors, errors
            (after,) = _sql(durable, f"SELECT xmin::text FROM {FENCE}")[0]
            raises += before != after
        assert raises == 3, "a round did not raise G: the test exercises nothing"
        assert len(set(issued)) == len(issued), "a (name, token) was issued twice"

        # The last burst, crashed once it is under way.
        _ceiling_down_to_the_highest_token(durable)
        _burst(durable, issued, errors, crash_after=20)
        highest = max(token for _, token in issued)
        assert len(set(issued)) == len(issued), "a (name, token) was issued twice"

        backend = _backend("off")
        try:
            for name in [*SHARED, "burst:0:0", "burst:new-after-crash"]:
                token = _cycle(backend, name)
                assert token > highest, f"{name}: token {token} <= {highest} from before"
        finally:
            backend.close()
